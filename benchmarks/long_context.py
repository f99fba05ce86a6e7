"""Long context: one sequence of T tokens per optimizer step through `Trainer(strategy=MegaTrainStrategy(...))`.

Workload: the benchmark's random-init Llama shapes (benchmarks/workloads.py), optionally truncated to --layers decoder
layers (a full-depth 7B step at 512K tokens runs ~10 minutes of attention alone, past one device command), the
project's CausalLMModule with the chunked loss, bf16-mixed, torch AdamW, clip 1.0, one row of T random token ids per
step (micro-batch 1, no accumulation), the strategy's defaults unless --strategy-args names options. Each T runs in
its own subprocess (an OOM or a kill becomes a row with "error"); the first step (compile, placement) is reported
apart, the rest are measured.

Row keys: model, layers, seq_len, steps, first_step_s, step_s (median of the steps after the first that compiled no
graph: per_step's graphs_compiled), step_times_s, per_step, tokens_per_s, mfu, mfu_attn_causal, losses,
peak_gpu_alloc_gib, peak_gpu_reserved_gib, peak_host_gib (VmHWM of the subprocess), placement (the engine's resolved
options), planned (what ``planner.plan`` predicts for the same shape and options), error.
  mfu              6 * parameters * tokens/s / 989e12 (nanoGPT/PaLM's 6N, no attention), as the throughput benchmark.
  mfu_attn_causal  (6 * N + 6 * L * H * T) * tokens/s / 989e12: PaLM appendix B counts 12 * L * H * T attention FLOPs
                   per token for forward and backward of full attention (2 matmuls of 2 * H * T FLOPs per token, x3);
                   a causal kernel does half of them, so 6 * L * H * T. H = heads * head_dim. Recompute not counted.

Usage (on the GPU machine, .whl carried as for benchmarks/throughput.py):
  python benchmarks/long_context.py --model llama-2-7b --layers 4 --seq-lens 32768,131072,262144,524288 \
      --out $OUT --budget-s 540
Check on a CPU first: python benchmarks/long_context.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEAK_FLOPS = 989e12


def _step_counters() -> dict:
    """Counters whose growth over a step says what one-time work it did: graphs dynamo compiled (a recompile) and the
    process's minor page faults (host memory touched for the first time)."""
    import resource

    from torch._dynamo.utils import counters

    return {"graphs_compiled": counters["stats"]["unique_graphs"],
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}


def _child(spec: dict) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from workloads import MODELS, count_params, hf_config, make_module

    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain._hardware import GIB, host_rss_gib

    config = dict(MODELS[spec["model"]]["config"], num_hidden_layers=spec["layers"],
                  max_position_embeddings=spec["seq_len"])
    on_cuda = torch.cuda.is_available()
    seq, steps = spec["seq_len"], spec["steps"]
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config["vocab_size"], (seq,), generator=gen) for _ in range(steps)]

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.per_step: list[dict] = []  # what each step added: compiled graphs, host page faults, kept layers

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if on_cuda:
                torch.cuda.synchronize()  # benchmark marks only, never in the engine's path
            self.t0 = time.perf_counter()
            self.before = _step_counters()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if on_cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(float(outputs["loss"]))
            after = _step_counters()
            self.per_step.append({k: after[k] - self.before[k] for k in after}
                                 | {"kept_layers": len(trainer.strategy.engine.streamed.kept)})
            if batch_idx == 0:  # the engine's choices, resolved by the first micro-batch (gone after teardown)
                engine = trainer.strategy.engine
                self.config = engine.config
                self.segments = [engine.streamed.segments.layers, engine.streamed.segments.device_checkpoints]
                self.kept = len(engine.streamed.kept)

    timer = Timer()
    module = make_module(config, loss="chunked", optimizer="adamw", grad_ckpt=False, direct_clip=False)
    strategy = MegaTrainStrategy(**spec["strategy_args"])
    trainer = L.Trainer(
        accelerator="cuda" if on_cuda else "cpu", devices=1, strategy=strategy,
        precision="bf16-mixed" if on_cuda else "32-true", max_steps=steps, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, DataLoader(data, batch_size=1))
    n_params, _ = count_params(config)
    # the steps after the first that compiled no graph (a graph compiled mid-run is one-time work, not the step)
    steady = [t for t, d in zip(timer.times[1:], timer.per_step[1:]) if not d["graphs_compiled"]]
    measured = steady or timer.times[1:] or timer.times
    step_s = median(measured)
    tokens_per_s = seq / step_s
    heads = config["num_attention_heads"]
    heads_dim = heads * config.get("head_dim", config["hidden_size"] // heads)
    attn = 6 * config["num_hidden_layers"] * heads_dim * seq
    row = {
        "first_step_s": timer.times[0], "step_s": step_s, "step_times_s": timer.times, "tokens_per_s": tokens_per_s,
        "mfu": 6 * n_params * tokens_per_s / PEAK_FLOPS,
        "mfu_attn_causal": (6 * n_params + attn) * tokens_per_s / PEAK_FLOPS,
        "losses": timer.losses, "params": n_params,
        "peak_gpu_alloc_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_cuda else None,
        "peak_host_gib": host_rss_gib("VmHWM"),
        "placement": {k: v for k, v in vars(timer.config).items() if k != "layers"},
        "segments": timer.segments,
        "kept_layers_first_step": timer.kept,
        "per_step": timer.per_step,
    }
    try:
        from lightning_megatrain.planner import Machine, plan

        p = plan(hf_config(config), seq_len=seq, micro_batch=1, grad_accum=1,
                 precision="bf16-mixed" if on_cuda else "32-true", loss="chunked", config=timer.config,
                 machine=Machine())
        row["planned"] = {"host_gib": p.host_total / GIB, "gpu_gib": p.gpu_total / GIB, "host": p.host, "gpu": p.gpu,
                          "tokens_per_s": p.tokens_per_s, "warnings": p.warnings}
    except Exception as e:  # the plan is a comparison, not the measurement
        row["planned"] = f"{type(e).__name__}: {e}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's all)")
    ap.add_argument("--seq-lens", default="32768,131072")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per sequence length, the first not measured")
    ap.add_argument("--strategy-args", default="{}", help="JSON of MegaTrainStrategy keyword arguments")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--budget-s", type=float, default=540.0, help="seconds for all runs; a run past it is killed")
    ap.add_argument("--dry-run", action="store_true", help="tiny-llama, 2 sequence lengths, on this machine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        try:
            row = _child(spec)
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print("ROW " + json.dumps(row), flush=True)
        return
    from workloads import MODELS

    model = "tiny-llama" if args.dry_run else args.model
    seq_lens = [64, 128] if args.dry_run else [int(s) for s in args.seq_lens.split(",")]
    layers = args.layers or MODELS[model]["config"]["num_hidden_layers"]
    deadline = time.monotonic() + args.budget_s
    rows = []
    for seq in seq_lens:
        spec = {"model": model, "layers": layers, "seq_len": seq, "steps": 2 if args.dry_run else args.steps,
                "strategy_args": json.loads(args.strategy_args)}
        row = {"model": model, "layers": layers, "seq_len": seq, "strategy_args": spec["strategy_args"]}
        left = deadline - time.monotonic()
        if left < 30:
            rows.append({**row, "error": "skipped: the budget is spent"})
            continue
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            out += "\nkilled: past the budget"
        found = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
        row.update(json.loads(found[-1]) if found else {"error": f"exit {proc.returncode}: " + out[-1500:]})
        for line in out.splitlines():
            if ("MegaTrain:" in line or "Error" in line or "ecompil" in line) and not line.startswith("ROW "):
                print(line[:1500])  # the placement lines carry their numbers at the end; TORCH_LOGS=recompiles
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("seq_len", "step_s", "tokens_per_s", "mfu_attn_causal",
                                                   "peak_gpu_reserved_gib", "peak_host_gib", "error")}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = f"{time.strftime('%Y-%m-%d')}-long-context-{model}-{layers}l{('-' + args.tag) if args.tag else ''}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
