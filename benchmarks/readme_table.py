"""The full performance table of docs/performance.md, generated from the committed result rows.

    python benchmarks/readme_table.py            # print the table (markdown)
    python benchmarks/readme_table.py --write    # replace the table in docs/performance.md
    python benchmarks/readme_table.py --check    # exit 1 when docs/performance.md does not hold the current table

Each line of ``ROWS`` names exactly one row of a committed ``benchmarks/results/*.json`` file (by commit, system,
loss and tokens per step; the script fails when a selector matches none or several). Each section of the table names
its result file, where every row records the commit it ran at; the table itself shows no commits. The ratio columns
divide by the rows marked as the references of the same model and tokens per step: ``ZERO3`` (the fastest DeepSpeed
ZeRO-3 offload as a Lightning user runs it: eager layers, HF's loss) and ``PLAIN`` (the fastest plain GPU-resident
training measured). A row whose run synchronized the GPU at every phase mark (``breakdown.sync_marks``) says so; a
peak host figure read after the profiled step (a row without ``peak_host_with_profiler_gib``, so the profiler's
buffers are included) is marked with a dagger. tests/test_benchmark_scripts.py checks that docs/performance.md holds
this output verbatim between the ``BEGIN`` and ``END`` markers, so the table cannot drift from the files, and that
README.md's summary quotes the megatrain rows' numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BEGIN, END = "<!-- benchmarks/readme_table.py: begin -->\n", "\n<!-- benchmarks/readme_table.py: end -->"
PROFILER_MARK = " †"  # peak host read after the profiled step: includes the profiler's buffers
ZERO3, PLAIN = "zero3", "plain"


class Row(NamedTuple):
    label: str  # the table's system column
    results: str  # file under benchmarks/results
    commit: str  # prefix of the row's git_commit
    system: str  # benchmarks/throughput.py system
    loss: str  # "hf" or "chunked"
    tokens_per_step: int
    reference: str | None = None  # ZERO3 or PLAIN: the ratio columns divide by this row
    micro_batch: int | None = None  # where one commit ran the same system at two micro-batch sizes
    headline: bool = False  # README.md's summary quotes this row


_3B, _7B, _MOE = ("2026-11-29-llama-3.2-3b-h200.json", "2026-11-29-llama-2-7b-h200.json",
                  "2026-11-29-qwen3-30b-a3b-4l-h200.json")
_MT = "**megatrain**, `compile_layers`, `overlap_optimizer`"
_3B_NOW, _7B_NOW = "2026-12-01-llama-3.2-3b-h200.json", "2026-12-02-llama-2-7b-h200-defaults-66386d7.json"
_MOE_NOW = "2026-12-02-qwen3-30b-a3b-4l-h200-defaults-360d5cf.json"
_DEFAULTS = '**megatrain**, `strategy="megatrain"` (no options)'
_TUNED = "megatrain, hand-tuned: `compile_layers`, `overlap_optimizer`"

ROWS = [
    # what a user gets: the user-style module (HF's loss, torch AdamW, clip 1.0) with the defaults, peers in one call
    Row("plain GPU Lightning, compiled layers", _3B_NOW, "5dfbb39", "plain_compiled", "hf", 32768, PLAIN),
    Row("DeepSpeed ZeRO-3 offload params + optimizer", _3B_NOW, "5dfbb39", "deepspeed_zero3_offload", "hf", 32768,
        ZERO3),
    Row(f"{_TUNED}, `gpu_optimizer_groups=18`", _3B_NOW, "5dfbb39", "megatrain_overlap_gpu18_compiled", "hf", 32768),
    Row(_DEFAULTS, _3B_NOW, "5dfbb39", "megatrain", "hf", 32768, headline=True),
    Row("DeepSpeed ZeRO-3 offload params + optimizer", _3B_NOW, "5dfbb39", "deepspeed_zero3_offload", "hf", 65536,
        ZERO3),
    Row(f"{_TUNED}, `gpu_optimizer_groups=10`", _3B_NOW, "5dfbb39", "megatrain_overlap_gpu10_compiled", "hf", 65536),
    Row(_DEFAULTS, _3B_NOW, "5dfbb39", "megatrain", "hf", 65536, micro_batch=64, headline=True),
    Row(_DEFAULTS, _3B_NOW, "5dfbb39", "megatrain", "hf", 65536, micro_batch=32, headline=True),
    Row(_DEFAULTS, _7B_NOW, "66386d7", "megatrain", "hf", 32768, headline=True),
    Row("megatrain, defaults with `update_during_backward=False`", _7B_NOW, "66386d7",
        "megatrain_no_backward_updates", "hf", 32768),
    Row(_DEFAULTS, _MOE_NOW, "360d5cf", "megatrain", "hf", 32768, headline=True),
    # earlier engine, options set by hand
    Row("plain GPU Lightning (fp32 params, fused AdamW, HF grad ckpt)", _3B, "ac46662", "plain", "hf", 32768),
    Row("plain GPU Lightning, compiled layers", _3B, "72f8b74", "plain_compiled", "hf", 32768, PLAIN),
    Row("DeepSpeed ZeRO-3 offload params + optimizer", _3B, "ac46662", "deepspeed_zero3_offload", "hf",
        32768),
    Row("DeepSpeed ZeRO-3 offload params + optimizer", _3B, "d731175", "deepspeed_zero3_offload", "hf", 32768, ZERO3),
    Row("DeepSpeed ZeRO-3 offload, compiled layers", _3B, "03a9900", "deepspeed_zero3_offload_compiled",
        "hf", 32768),
    Row("FSDP `cpu_offload=True` (no clipping)", _3B, "ac46662", "fsdp_cpu_offload", "hf", 32768),
    Row(f"{_MT}, `gpu_optimizer_groups=18`", _3B, "b064dab", "megatrain_overlap_gpu18_compiled", "hf", 32768),
    Row("plain GPU Lightning (fp32 params, fused AdamW, HF grad ckpt)", _3B, "787580c", "plain", "chunked",
        65536),
    Row("plain GPU Lightning, compiled layers", _3B, "72f8b74", "plain_compiled", "chunked", 65536, PLAIN),
    Row("DeepSpeed ZeRO-3 offload params + optimizer", _3B, "e1f81d7", "deepspeed_zero3_offload", "hf", 65536, ZERO3),
    Row("DeepSpeed ZeRO-3 offload params + optimizer, repeat run", _3B, "d731175", "deepspeed_zero3_offload", "hf",
        65536),
    Row("DeepSpeed ZeRO-3 offload, compiled layers, our chunked loss", _3B, "e1f81d7",
        "deepspeed_zero3_offload_compiled", "chunked", 65536),
    Row(f"{_MT}, `gpu_optimizer_groups=10`", _3B, "b064dab", "megatrain_overlap_gpu10_compiled", "chunked", 65536),
    Row(f"{_MT}, `gpu_optimizer_groups=8`", _7B, "d731175", "megatrain_overlap_gpu8_compiled", "hf", 32768),
    Row("plain GPU Lightning (fp32 params, fused AdamW, HF grad ckpt)", _MOE, "787580c", "plain", "hf",
        32768, PLAIN),
    Row("DeepSpeed ZeRO-3 offload params + optimizer", _MOE, "787580c", "deepspeed_zero3_offload", "hf",
        32768, ZERO3),
    Row(f"{_MT}, `gpu_optimizer_groups=3`", _MOE, "d731175", "megatrain_overlap_gpu3_compiled", "hf", 32768),
]

_MODELS = {_3B_NOW: "Llama-3.2-3B shape (3.21B)", _7B_NOW: "Llama-2-7B shape (6.74B)",
           _MOE_NOW: "Qwen3-30B-A3B shape, 4 of 48 layers (3.11B, 0.85B active)",
           _3B: "Llama-3.2-3B shape (3.21B)", _7B: "Llama-2-7B shape (6.74B)",
           _MOE: "Qwen3-30B-A3B shape, 4 of 48 layers (3.11B, 0.85B active)"}


def _find(row: Row) -> dict:
    data = json.loads((RESULTS / row.results).read_text())
    results = [{"git_commit": data["git_commit"], **r} for r in data["results"]]  # a merged file's rows carry theirs
    found = [r for r in results
             if r["git_commit"].startswith(row.commit) and r["system"] == row.system and r["loss"] == row.loss
             and r["tokens_per_step"] == row.tokens_per_step and r["error"] is None
             and row.micro_batch in (None, r["micro_batch"])]
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows in {row.results} match {row}; a selector must match exactly one")
    return found[0]


def _ratio(value: float, reference: dict | None) -> str:
    return f"{value / reference['tokens_per_s']:.2f}" if reference is not None else ""


def table() -> str:
    """The markdown table, one section per model and tokens per step, in ``ROWS``' order."""
    found = [(row, _find(row)) for row in ROWS]
    refs = {(row.results, row.tokens_per_step, row.reference): r for row, r in found if row.reference}
    lines = ["| system | loss | micro x acc | tokens/s | vs ZeRO-3 | vs plain | MFU | peak GPU GiB | "
             "peak host GiB (B/param) |", "|---|---|---|---|---|---|---|---|---|"]
    section = None
    for row, r in found:
        if (row.results, row.tokens_per_step) != section:
            section = (row.results, row.tokens_per_step)
            lines.append(f"| *{_MODELS[row.results]}, {row.tokens_per_step // 1024}K tokens/step* "
                         f"(`{row.results}`) |" + " |" * 8)
        tokens_per_s = r["tokens_per_s"]
        mfu = f"{r['mfu_active']:.1%} active" if "mfu_active" in r else f"{r['mfu']:.1%}"
        ours = row.label.startswith("**megatrain**")
        shown = f"**{tokens_per_s:,.0f}**" if ours else f"{tokens_per_s:,.0f}"
        system = row.label + (" (sync marks)" if r["breakdown"].get("sync_marks") else "")
        profiler = "" if "peak_host_with_profiler_gib" in r else PROFILER_MARK
        lines.append(
            f"| {system} | {'HF' if row.loss == 'hf' else 'chunked'} | {r['micro_batch']} x {r['accumulate']} "
            f"| {shown} | {_ratio(tokens_per_s, refs.get((*section, ZERO3)))} "
            f"| {_ratio(tokens_per_s, refs.get((*section, PLAIN)))} | {mfu} | {r['peak_gpu_gib']:.1f} "
            f"| {r['peak_host_gib']:.1f} ({r['host_bytes_per_param']:.1f}){profiler} |"
        )
    return "\n".join(lines)


def committed(text: str) -> str:
    """The table between the markers of ``text`` (docs/performance.md's content)."""
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)]


def write(path: Path = TARGET) -> bool:
    """Replace the table between the markers of ``path``; returns whether the file changed."""
    text = path.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + table() + text[stop:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"replace the table in {TARGET.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {TARGET.name} holds a stale table")
    args = parser.parse_args()
    if args.write:
        print(f"{TARGET}: {'updated' if write() else 'already current'}")
    elif args.check:
        stale = committed(TARGET.read_text()) != table()
        print(f"{TARGET}: {'stale, run: python benchmarks/readme_table.py --write' if stale else 'current'}")
        sys.exit(1 if stale else 0)
    else:
        print(table())
