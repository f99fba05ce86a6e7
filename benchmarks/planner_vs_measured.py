"""Compare `megatrain plan` predictions with the runs measured on the H200 (committed result files).

Usage: python benchmarks/planner_vs_measured.py benchmarks/results/2026-11-29-core-*-h200.json \
           benchmarks/results/2026-11-29-llama-*-h200.json
Prints a markdown table: predicted vs measured peak host RSS, peak GPU memory (allocated tensors) and tokens/s.
Core runs (benchmarks/core_gpu.py) predate the exact-size page-locked buffers and recompute every layer; throughput
runs (benchmarks/throughput.py, megatrain rows) use the current engine. Their GPU memory is compared only for
megatrain_recompute_all (keep_layers=0, what the planner models): keep_layers="auto" fills up to 90% of the GPU by
design. Rows of the overlapped optimizer step are planned with overlap_optimizer=True, rows of a system with the
_gpuN suffix with gpu_optimizer_groups=N, _compiled rows with compile_layers=True; every row without host updates
during backward (update_during_backward=False), which the runs predate.
"""

from __future__ import annotations

import json
import sys

from workloads import split_system  # benchmarks/workloads.py: this script's folder is on sys.path

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import Machine, plan

# The shapes of benchmarks/core_gpu.py, as HF config dicts (the planner builds them on the meta device).
CONFIGS = {
    "llama-110m": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000),
    "llama-3.2-3b": dict(num_hidden_layers=28, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256),
    "llama-3.2-3b-x2depth": dict(num_hidden_layers=56, hidden_size=3072, intermediate_size=8192,
                                 num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
    "llama-2-7b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
}
THROUGHPUT_SYSTEMS = ("megatrain", "megatrain_overlap", "megatrain_overlap_deepspeed", "megatrain_recompute_all")


def main(paths: list[str]) -> None:
    print("| model | engine | micro x accum x seq | host GiB plan / measured (err) | GPU GiB plan / measured (err) "
          "| tokens/s plan / measured |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        data = json.load(open(path))
        for r in data["results"]:
            core = r.get("strategy") == "megatrain"
            current = split_system(r.get("system", ""))[0] in THROUGHPUT_SYSTEMS and not r.get("error")
            if core or current:
                print(_row(r, core, data.get("git_commit", "")))


def _row(r: dict, core: bool, commit: str) -> str:
    config = dict(model_type="llama", tie_word_embeddings=True) | CONFIGS[r["model"]]
    # the core runs predate the exact-size page-locked buffers (engine/pinned.py)
    system = r.get("system", "")
    base, groups, compiled = split_system(system)
    options = EngineConfig(overlap_optimizer=base.startswith("megatrain_overlap"), gpu_optimizer_groups=groups,
                           compile_layers=compiled, update_during_backward=False)
    machine = Machine(host_ram_gib=125, gpu_mem_gib=139, cpu_cores=16, pinned_pow2_rounding=core)
    p = plan(config, seq_len=r["seq_len"], micro_batch=r["micro_batch"], grad_accum=r.get("accumulate", 1),
             optimizer=r.get("optimizer", "adamw"), loss="chunked" if r.get("loss") == "chunked" else "naive",
             config=options, machine=machine).to_dict()
    host_measured = r["peak_host_rss_gib"] if core else r["peak_host_gib"]
    host = p["host_total"] / GIB
    host_cell = f"{host:.1f} / {host_measured:.1f} ({host / host_measured - 1:+.0%})"
    if core or system == "megatrain_recompute_all":  # max_memory_allocated counts tensors: the plan less its reserve
        gpu = (p["gpu_total"] - p["gpu"]["runtime reserve"]) / GIB
        gpu_cell = f"{gpu:.1f} / {r['peak_gpu_gib']:.1f} ({gpu / r['peak_gpu_gib'] - 1:+.0%})"
        engine = "core run, recompute all" if core else f"{system} @{r.get('git_commit', commit)[:7]}"
    else:
        gpu_cell = f"n/a: keep_layers='auto' used {r['peak_gpu_gib']:.1f}"
        engine = f"{system} @{r.get('git_commit', commit)[:7]}"
    tokens = f"{r['micro_batch']} x {r.get('accumulate', 1)} x {r['seq_len']}"
    return (f"| {r['model']} | {engine} | {tokens} | {host_cell} | {gpu_cell} | "
            f"{p['tokens_per_s']:,.0f} / {r['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
