"""The 70B/120B class with `megatrain plan`: the truncated-depth H200 runs (Llama-3.1-70B, gpt-oss-120b) against
their plans, the full-depth plans of Llama-3.1-70B and gpt-oss-120b on a 1.5 TiB and a 1 TiB host with one H200 in each
host_state, and the deepest model of the Llama-3.1-70B width that fits (docs/scale.md holds the tables).

Usage (CPU only; prints markdown):
  python benchmarks/scale_plan.py measured   # the truncated runs of ``RUNS``, one layer of each pair, each step split
  python benchmarks/scale_plan.py full       # full depth, each host_state, 1,536 and 1,024 GiB of host RAM
  python benchmarks/scale_plan.py largest    # megatrain plan --largest, 1,536 and 128 GiB of host RAM

Every plan is the engine with its GPU defaults (overlapped host step, ``compile_layers="auto"``: compiled Llama,
uncompiled gpt-oss; no device groups
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
from lightning_megatrain.planner.capacity import largest_models, with_layers
from lightning_megatrain.planner.planning import host_update_gparams
from lightning_megatrain.planner.shape import load_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The truncated-depth runs (`benchmarks/memory_pool.py`, 8 x 4,096 tokens, ENGINE's options, every layer recomputed),
# in pairs of depths of one model; gpt-oss with transformers' grouped_mm experts and eager layers (what
# compile_layers="auto" chooses for it, engine/compiled.py ``compile_hazard``), then with eager experts and compiled
# layers (the pair before; its experts loop is what the plan does not price, docs/scale.md).
RUNS = ("2026-12-04-memory-pool-llama-3.1-70b-2l-h200-23adbf1.json",
        "2026-12-04-memory-pool-llama-3.1-70b-4l-h200-c61a4e0.json",
        "2026-12-04-memory-pool-gpt-oss-120b-2l-compact-grouped-mm-eager-layers-h200-a82a356.json",
        "2026-12-04-memory-pool-gpt-oss-120b-3l-compact-grouped-mm-eager-layers-h200-f1fa33b.json",
        "2026-12-04-memory-pool-gpt-oss-120b-2l-compact-eager-experts-h200-23adbf1.json",
        "2026-12-04-memory-pool-gpt-oss-120b-3l-compact-eager-experts-h200-23adbf1.json")
# Llama-3.1-70B's config.json shape (meta-llama/Llama-3.1-70B; rope scaling does not change a plan)
LLAMA_31_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 131072}
GPT_OSS_120B = ROOT / "configs" / "hf" / "gpt-oss-120b.json"  # the Hub config.json without quantization_config
MODELS = {"Llama-3.1-70B": LLAMA_31_70B, "gpt-oss-120b": GPT_OSS_120B}
# compile_layers "auto": as the strategy resolves it on a GPU (compiled Llama, eager gpt-oss: engine/compiled.py)
ENGINE = EngineConfig(overlap_optimizer=True, compile_layers="auto", gpu_optimizer_groups=0,
                      update_during_backward=False)
HOSTS_GIB = (1536, 1024)  # "1.5 TB" (the MegaTrain paper's host) and "1 TB" as DIMMs come: 1.5 and 1 TiB
SEQ, MICRO_BATCH = 4096, 8  # 32,768 tokens per step; gpt-oss's eager attention fits 9 rows of 4,096 on the H200


def machine(host_gib: float) -> Machine:
    return Machine(host_ram_gib=host_gib, gpu_mem_gib=139, cpu_cores=16)


# the lent H200 as the runs saw it: MemTotal 125.85 GiB, the GPU's 139.8 GiB total, 16 cores
H200_AS_RUN = Machine(host_ram_gib=125.85, gpu_mem_gib=139.8, cpu_cores=16)


def measured_rows() -> list[dict]:
    """Each truncated-depth H200 run (``RUNS``) beside the plan of the same run, made now: host RAM (peak RSS), GPU
    (allocated tensors: the plan less its runtime reserve), tokens/s, and the relative errors of the plan."""
    out = []
    for name in RUNS:
        run = json.loads((RESULTS / name).read_text())
        model = {"llama-3.1-70b": LLAMA_31_70B, "gpt-oss-120b": GPT_OSS_120B}[run["model"].split(" ")[0]]
        config = with_layers(load_config(model), run["layers"])
        p = plan(config, seq_len=run["seq_len"], micro_batch=run["micro_batch"], host_state=run["host_state"],
                 attn_implementation=run["attn_implementation"], machine=H200_AS_RUN,
                 config=ENGINE.replace(host_state=run["host_state"], keep_layers=run["keep_layers"],
                                       # runs before memory_pool.py's --compile-layers ran "auto": compiled
                                       compile_layers=run.get("compile_layers", True)))
        m = run["measured"]
        host_steps = sorted(m["host_step_s"][1:])  # the first step's builds the states
        gpu = p.gpu_allocated / GIB
        out.append({
            "model": run["model"].split(" ")[0] + (f" ({run['experts_implementation']} experts)"
                                                    if run.get("experts_implementation") else ""),
            "layers": run["layers"], "host_state": run["host_state"], "result": name,
            "n_params": run["n_params"], "plan": p,
            "host_plan": p.host_total / GIB, "host_measured": m["peak_host_rss_gib"],
            "gpu_plan": gpu, "gpu_measured": m["peak_gpu_allocated_gib"],
            "step_plan": p.time["step total"], "step_measured": m["step_s"],
            "tokens_per_s_plan": p.tokens_per_s, "tokens_per_s_measured": m["tokens_per_s"],
            "host_step_measured": host_steps[len(host_steps) // 2],
        })
        for k in ("host", "gpu", "tokens_per_s"):
            out[-1][f"{k}_err"] = out[-1][f"{k}_plan"] / out[-1][f"{k}_measured"] - 1
    return out


def step_split(rows: list[dict]) -> list[dict]:
    """Where each run's measured step (the mean of steps 5 and 6) goes against its plan: the host step's wall time
    on the worker and the training thread's wait for it (the launches at the end of steps 4 and 5, which those two
    steps overlap), the rest of the step (the step less the wait: GPU work and the thread's own), and the plan's
    two parts: its host term (the host step beyond the next forward) and everything else."""
    out = []
    for r in rows:
        m = json.loads((RESULTS / r["result"]).read_text())["measured"]
        host, waited = (sum(m[k][3:5]) / 2 for k in ("host_step_s", "host_step_waited_s"))
        t = r["plan"].time
        planned_host = t.get("CPU optimizer (beyond the next forward)", 0.0)
        out.append({"model": r["model"], "layers": r["layers"], "step": r["step_measured"], "host_step": host,
                    "waited": waited, "rest": r["step_measured"] - waited, "plan_host": planned_host,
                    "plan_rest": t["step total"] - planned_host})
    return out


def per_layer(rows: list[dict]) -> list[dict]:
    """One decoder layer of each model, from its two depths: step seconds, peak host GiB and the in-run host step,
    measured and planned (a gpt-oss layer of the pair is a sliding-window one: 2 -> 3 layers)."""
    out = []
    for a, b in zip(rows[::2], rows[1::2]):
        n = b["layers"] - a["layers"]
        d = {k: (b[k] - a[k]) / n for k in ("step_plan", "step_measured", "host_plan", "host_measured",
                                             "host_step_measured")}
        rate = host_update_gparams("adamw", a["host_state"], overlapped=True)  # on 16 cores, as the runs had
        d["host_step_plan"] = (b["n_params"] - a["n_params"]) / n / (rate * 1e9)
        out.append({"model": a["model"], "host_state": a["host_state"], "layers": (a["layers"], b["layers"]), **d})
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
    print("| model, layers, host_state | host GiB plan / measured | GPU GiB allocated plan / measured | "
          "tokens/s plan / measured |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']}, {r['layers']}, `{r['host_state']}` | {r['host_plan']:.1f} / {r['host_measured']:.1f} "
              f"({_pct(r['host_err'])}) | {r['gpu_plan']:.1f} / {r['gpu_measured']:.1f} ({_pct(r['gpu_err'])}) | "
              f"{r['tokens_per_s_plan']:,.0f} / {r['tokens_per_s_measured']:,.0f} ({_pct(r['tokens_per_s_err'])}) |")
    print("\n| one layer of | step s plan / measured | host GiB plan / measured | host step s plan / measured |")
    print("|---|---|---|---|")
    for d in per_layer(rows):
        print(f"| {d['model']} (`{d['host_state']}`, {d['layers'][0]} -> {d['layers'][1]} layers) | "
              f"{d['step_plan']:.3f} / {d['step_measured']:.3f} | {d['host_plan']:.1f} / {d['host_measured']:.1f} | "
              f"{d['host_step_plan']:.3f} / {d['host_step_measured']:.3f} |")
    print("\n| run | step s | host step s (worker) | thread waited s | rest s | plan: host term s | plan: rest s |")
    print("|---|---|---|---|---|---|---|")
    for d in step_split(rows):
        print(f"| {d['model']}, {d['layers']} | {d['step']:.3f} | {d['host_step']:.3f} | {d['waited']:.3f} | "
              f"{d['rest']:.3f} | {d['plan_host']:.3f} | {d['plan_rest']:.3f} |")


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
