"""The planner's step time against the measured long-context runs: each row of the named results re-planned offline
with the options the engine resolved in that run (its ``placement``), on the machine it ran on (one H200: 139.8 GiB
usable GPU, 125.85 GiB host, 16 cores), once with the attention kernel's own measured rates (constants.py
``ATTN_FWD_TFLOPS``, ``ATTN_BWD_TFLOPS``: what ``plan()`` uses) and once with one rate for the whole layer (before
them). No GPU: this reads committed results.

    python benchmarks/planner_attention_check.py --out benchmarks/results/planner-attention-check.json

Row keys: result, model, layers, seq_len, attention_memo, measured_steps, measured_tokens_per_s, planned (the rates
now), planned_one_rate, error_pct and error_one_rate_pct ((planned - measured) / measured).

Measured: the median step from the third on, where the run has one, else its second step (``measured_steps`` says
which). Until the recompute replayed its forward's autocast cache flag (engine/segments.py ``autocast_state``), the
second step compiled the first kept layer's graph: 4.3 s of the 3B shape's 7.2 s step at 32,768 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The full-depth 7B runs, defaults and with the memo (compiled layers): the plan recomputes every layer and these
# kept 1-3 of 32. (The 4-layer runs keep all 4 from their second step: nothing to compare the recompute with.)
RUNS = (
    "2026-12-02-long-context-llama-2-7b-32l-defaults-bb2b8ae.json",
    "2026-12-04-long-context-llama-2-7b-32l-memo-h200-83af007.json",
    # 262,144 with the defaults again, attention_memo="auto" declining the memos (one measured step)
    "2026-12-04-long-context-llama-2-7b-32l-262k-auto-memo-h200-3120d8e.json",
    # the defaults with attention_memo="auto" taking the memos
    "2026-12-04-long-context-llama-2-7b-32l-32k-auto-memo-h200-3120d8e.json",
    "2026-12-04-long-context-llama-2-7b-32l-auto-memo-h200-3120d8e.json",
    # the 3B shape (28 layers) with the defaults; at 32,768 every layer is kept from the second step on
    "2026-12-04-long-context-llama-3.2-3b-28l-32k-step2-fixed-h200-1276a9d.json",
    "2026-12-04-long-context-llama-3.2-3b-28l-131k-defaults-h200-45ad0ff.json",
    "2026-12-04-long-context-llama-3.2-3b-28l-262k-defaults-h200-45ad0ff.json",
)
# Runs measured at step 2 only whose step 2 compiled a graph: their logs say a layer was kept from step 2 on, and
# these ran before the autocast fix (the module docstring); such a row is not a measure of the planner
STEP2_COMPILED = {"2026-12-04-long-context-llama-3.2-3b-28l-262k-defaults-h200-45ad0ff.json"}
H200 = dict(host_ram_gib=125.85, gpu_mem_gib=139.8, cpu_cores=16)


def measured(run: dict) -> tuple[float, str]:
    """tokens/s of ``run`` past its warm-up, and which steps that is (see the module docstring)."""
    from statistics import median

    times = run["step_times_s"]
    steady = times[2:] or times[1:] or times
    which = (f"steps 3-{len(times)}" if len(times) > 3 else "step 3" if len(times) == 3
             else "step 2" if len(times) == 2 else "step 1 (with its compile)")
    return run["seq_len"] / median(steady), which


def replan(run: dict) -> tuple[float, float]:
    """tokens/s of ``run`` as planned now, and as planned with one rate for the whole layer: the same plan on a
    machine that names its rate (the one the plan chose), which prices attention at it too (planning.py)."""
    from workloads import MODELS, hf_config

    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.planner import Machine, plan

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    # runs from before the memo existed ran without it ("auto" would plan it now)
    config = EngineConfig(**{"attention_memo": False, **{k: v for k, v in run["placement"].items() if k in fields}})
    model = hf_config(dict(MODELS[run["model"]]["config"], num_hidden_layers=run["layers"],
                           max_position_embeddings=run["seq_len"]))
    kw = dict(seq_len=run["seq_len"], micro_batch=1, grad_accum=1, precision="bf16-mixed", loss="chunked",
              config=config)
    now = plan(model, machine=Machine(**H200), **kw)
    one_rate = plan(model, machine=Machine(**H200, achieved_tflops=now.assumptions["achieved_tflops"]), **kw)
    return now.tokens_per_s, one_rate.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for name in RUNS:
        with open(os.path.join(RESULTS, name)) as f:
            runs = json.load(f)
        for run in runs:
            if run.get("error") or not run.get("tokens_per_s"):
                continue
            tokens_per_s, which = measured(run)
            which += " (with a compile)" if name in STEP2_COMPILED else ""
            now, before = replan(run)
            rows.append({"result": name, "model": run["model"], "layers": run["layers"], "seq_len": run["seq_len"],
                         "attention_memo": bool(run["placement"].get("attention_memo")), "measured_steps": which,
                         "measured_tokens_per_s": tokens_per_s, "planned": now, "planned_one_rate": before,
                         "error_pct": 100 * (now - tokens_per_s) / tokens_per_s,
                         "error_one_rate_pct": 100 * (before - tokens_per_s) / tokens_per_s})
    print("| model | tokens | memo | measured | tokens/s | planned | error | one rate | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} ({r['layers']}L) | {r['seq_len']:,} | {'yes' if r['attention_memo'] else 'no'} | "
              f"{r['measured_steps']} | {r['measured_tokens_per_s']:,.0f} | {r['planned']:,.0f} | "
              f"{r['error_pct']:+.1f}% | "
              f"{r['planned_one_rate']:,.0f} | {r['error_one_rate_pct']:+.1f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": H200, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
