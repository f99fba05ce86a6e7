"""The 70B/120B class with `megatrain plan`: the truncated-depth H200 runs of the Llama-3.1-70B shape against the plan,
the full-depth plans of Llama-3.1-70B and gpt-oss-120b on a 1.5 TiB and a 1 TiB host with one H200 in each
host_state, and the deepest model of the Llama-3.1-70B width that fits (docs/scale.md holds the tables).

Usage (CPU only; prints markdown):
  python benchmarks/scale_plan.py measured   # the 4-layer runs (benchmarks/results/*-llama-3.1-70b-4l-h200.json)
  python benchmarks/scale_plan.py full       # full depth, each host_state, 1,536 and 1,024 GiB of host RAM
  python benchmarks/scale_plan.py largest    # megatrain plan --largest, 1,536 and 128 GiB of host RAM

Every plan is the engine with its GPU defaults as flags (`--overlap-optimizer --compile-layers`, no device groups
and no host updates during backward: ``ENGINE``) on one H200 (139 GiB) with the 16 host cores its rates were measured
on (planner/constants.py). The runs predate the updates during backward, and their snapshots only take the host
memory a plan leaves free, so the host RAM each model needs, and what fits, are the same without them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import HOST_STATE_BYTES, Machine, host_os_reserve, plan
from lightning_megatrain.planner.capacity import largest_models

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "results" / "2026-11-30-llama-3.1-70b-4l-h200.json"
# Llama-3.1-70B's config.json shape (meta-llama/Llama-3.1-70B; rope scaling does not change a plan)
LLAMA_31_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 131072}
GPT_OSS_120B = ROOT / "configs" / "hf" / "gpt-oss-120b.json"  # the Hub config.json without quantization_config
MODELS = {"Llama-3.1-70B": LLAMA_31_70B, "gpt-oss-120b": GPT_OSS_120B}
ENGINE = EngineConfig(overlap_optimizer=True, compile_layers=True, gpu_optimizer_groups=0, update_during_backward=False)
HOSTS_GIB = (1536, 1024)  # "1.5 TB" (the MegaTrain paper's host) and "1 TB" as DIMMs come: 1.5 and 1 TiB
SEQ, MICRO_BATCH = 4096, 8  # 32,768 tokens per step; gpt-oss's eager attention fits 9 rows of 4,096 on the H200


def machine(host_gib: float) -> Machine:
    return Machine(host_ram_gib=host_gib, gpu_mem_gib=139, cpu_cores=16)


def measured_rows() -> list[dict]:
    """Each measured 4-layer row beside its plan: host RAM, GPU (the plan's floor, and the floor with the other
    layers' saved activations kept, as keep_layers="auto" keeps them), tokens/s, and the relative errors."""
    data = json.loads(MEASURED.read_text())
    config = LLAMA_31_70B | {"num_hidden_layers": 4}
    out = []
    for r in data["results"]:
        p = plan(config, seq_len=r["seq_len"], micro_batch=r["micro_batch"], grad_accum=r["accumulate"],
                 config=ENGINE, machine=machine(125))
        tokens = r["micro_batch"] * r["seq_len"]
        floor = (p.gpu_total - p.gpu["runtime reserve"]) / GIB  # allocated tensors: the plan less its reserve
        kept = floor + (p.n_layers - 1) * p.activation_per_token["saved"] * tokens / GIB
        host = p.host_total / GIB
        out.append({
            "micro_batch": r["micro_batch"], "seq_len": r["seq_len"], "plan": p,
            "host_plan": host, "host_measured": r["peak_host_gib"],
            "host_err": host / r["peak_host_gib"] - 1 if r["peak_host_gib"] else None,
            "gpu_floor": floor, "gpu_all_kept": kept, "gpu_measured": r["peak_gpu_gib"],
            "gpu_all_kept_err": kept / r["peak_gpu_gib"] - 1,
            "tokens_per_s_plan": p.tokens_per_s, "tokens_per_s_measured": r["tokens_per_s"],
            "tokens_per_s_err": p.tokens_per_s / r["tokens_per_s"] - 1,
            "step_plan": p.time["step total"], "step_measured": tokens / r["tokens_per_s"],
        })
    return out


def step_line(rows: list[dict]) -> dict[str, float]:
    """Step time = fixed + per_token x tokens through two rows, measured and planned: which part the plan misses."""
    a, b = rows[0], rows[1]
    ta, tb = a["micro_batch"] * a["seq_len"], b["micro_batch"] * b["seq_len"]
    out = {}
    for kind in ("measured", "plan"):
        slope = (a[f"step_{kind}"] - b[f"step_{kind}"]) / (ta - tb)
        out[f"{kind}_per_16k"] = slope * 16384
        out[f"{kind}_fixed"] = a[f"step_{kind}"] - slope * ta
    return out


def full_rows() -> list[dict]:
    """Full depth, each host_state, at ``MICRO_BATCH x SEQ``: the plan on the 1.5 TiB host and, as the same plan
    judged against 1 TiB less its OS reserve (planning.py ``host_os_reserve``), whether it fits 1 TiB."""
    out = []
    for name, model in MODELS.items():
        for state in HOST_STATE_BYTES:
            p = plan(model, seq_len=SEQ, micro_batch=MICRO_BATCH, config=ENGINE, machine=machine(HOSTS_GIB[0]),
                     host_state=state)
            fits = {}
            for gib in HOSTS_GIB:
                limit = int(gib * GIB)
                fits[gib] = p.host_total <= limit - host_os_reserve(limit) and p.gpu_total <= p.gpu_limit
            out.append({"model": name, "host_state": state, "plan": p, "fits": fits})
    return out


def largest_rows() -> dict[int, list]:
    """``megatrain plan --largest`` for the Llama-3.1-70B width at ``MICRO_BATCH x SEQ`` on 1.5 TiB and 128 GiB."""
    return {gib: largest_models(LLAMA_31_70B, seq_len=SEQ, micro_batch=MICRO_BATCH, config=ENGINE,
                                machine=machine(gib)) for gib in (HOSTS_GIB[0], 128)}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.0%}"


def print_measured() -> None:
    rows = measured_rows()
    print("| micro x seq | host GiB plan / measured | GPU GiB: plan floor; + 3 layers kept / measured | "
          "tokens/s plan / measured |")
    print("|---|---|---|---|")
    for r in rows:
        host = (f"{r['host_plan']:.1f} / {r['host_measured']:.1f} ({_pct(r['host_err'])})" if r["host_measured"]
                else f"{r['host_plan']:.1f} / not recorded")
        print(f"| {r['micro_batch']} x {r['seq_len']} | {host} | {r['gpu_floor']:.1f}; {r['gpu_all_kept']:.1f} / "
              f"{r['gpu_measured']:.1f} ({_pct(r['gpu_all_kept_err'])}) | {r['tokens_per_s_plan']:,.0f} / "
              f"{r['tokens_per_s_measured']:,} ({_pct(r['tokens_per_s_err'])}) |")
    line = step_line(rows)
    print(f"\nstep = fixed + per 16,384 tokens: measured {line['measured_fixed']:.2f} s + "
          f"{line['measured_per_16k']:.3f} s; planned {line['plan_fixed']:.2f} s + {line['plan_per_16k']:.3f} s")


def print_full() -> None:
    print("| model | host_state | B/param | host RAM GiB | fits 1.5 TiB | fits 1 TiB | GPU peak GiB | step s | "
          "tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in full_rows():
        p = r["plan"]
        yes = lambda ok: "yes" if ok else "**no**"  # noqa: E731
        print(f"| {r['model']} ({p.n_params / 1e9:.1f}B) | `{r['host_state']}` | {p.host_state_bytes_per_param:.2f} | "
              f"{p.host_total / GIB:,.1f} | {yes(r['fits'][1536])} | {yes(r['fits'][1024])} | "
              f"{p.gpu_total / GIB:.1f} | {p.time['step total']:.1f} | {p.tokens_per_s:,.0f} | {p.mfu:.1%} |")


def print_largest() -> None:
    print("| host_state | 1.5 TiB: layers, params, host GiB | 128 GiB: layers, params, host GiB |")
    print("|---|---|---|")
    by_host = largest_rows()
    for big, small in zip(by_host[1536], by_host[128]):
        name = big.host_state + (" + GPU (auto groups)" if big.both_memories else "")
        cells = [f"{c.layers}, {c.n_params / 1e9:.1f}B, {c.host_total / GIB:,.1f}" + (
            f" ({c.gpu_groups} groups on the GPU)" if c.both_memories else "") for c in (big, small)]
        print(f"| `{name}` | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    {"measured": print_measured, "full": print_full, "largest": print_largest}[sys.argv[1]]()
