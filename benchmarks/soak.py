"""Soak: hundreds of optimizer steps under `strategy="megatrain"` with no options, beside plain GPU Lightning.

What it checks (issue: reliability, the soak): over `--steps` optimizer steps of a 1B-class model with gradient
accumulation and clipping, (1) host memory does not grow after warm-up, (2) GPU memory does not grow, (3) the loss
follows plain Lightning's on the same data, init and hyperparameters within float noise.

Workload: the Llama-3.2-1B shape of benchmarks/workloads.py (1.24B, HF-like random init, seed 0), HF's loss
(`model(input_ids, labels)`), `torch.optim.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)`, bf16-mixed,
`gradient_clip_val=1.0`, `accumulate_grad_batches=--accum`, micro-batches of `--micro-batch` x `--seq` tokens drawn
from `--distinct` fixed random sequences (cycled in order, so the loss falls as the model memorises them).
  megatrain  `Trainer(strategy="megatrain")`: the defaults run the host step overlapped with torch's fused AdamW
             on the CPU (fp32 masters and moments in host RAM).
  plain      `Trainer(strategy="auto")` on the GPU: the same torch AdamW formula run by its CUDA kernel, so the
             two trajectories differ by float rounding (bf16 compute on both sides), not by the algorithm.
Each system runs in its own subprocess. Per optimizer step the recorder keeps the mean micro-batch loss (as device
tensors, read once at the end: no sync in the loop), VmRSS, `torch.cuda.memory_allocated` and the wall clock.

Summary: host growth = (max RSS over steps after `--warmup`) / (RSS at `--warmup`) - 1 (target <= 1%); GPU growth
the same on allocated bytes (target 0); loss: the mean absolute and the largest per-step difference between the two
curves, and their mean and largest relative difference over the steps before plain's loss first falls under 0.1 (once
the sequences are memorised the loss is near 0 and AdamW spikes now and then on both systems: a ratio there is noise).
VmRSS does not count CUDA's pinned host buffers (allocated once at setup); VmHWM does.

On the device: python3 benchmarks/soak.py --out $OUT --commit SHA  (about 5 minutes for both systems on one H200)
On a CPU:      python benchmarks/soak.py --dry-run --out /tmp/soak  (tiny model, both systems on the CPU)
Writes <date>-soak-<model>-<device>.json and .csv into --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the device's copy of the tree has no install
sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import MODELS, count_params, make_module  # noqa: E402

GIB = 1 << 30
SYSTEMS = ("megatrain", "plain")
LOSS_FLOOR = 0.1  # relative loss differences are compared until plain's loss first falls under it


def train(spec: dict) -> dict:
    """One system's run (in the child process): the per-step records."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_megatrain._hardware import host_rss_gib

    on_cuda = spec["device"] == "cuda"
    torch.manual_seed(0)
    config = MODELS[spec["model"]]["config"]
    generator = torch.Generator().manual_seed(1)
    distinct = torch.randint(0, config["vocab_size"], (spec["distinct"], spec["seq"]), generator=generator)
    micro_batches = spec["steps"] * spec["accum"]
    rows = distinct.repeat((micro_batches * spec["micro_batch"]) // spec["distinct"] + 1, 1)
    loader = DataLoader(rows[: micro_batches * spec["micro_batch"]], batch_size=spec["micro_batch"], shuffle=False)
    module = make_module(config, loss="hf", optimizer="adamw", grad_ckpt=False, direct_clip=False)
    losses: list[torch.Tensor] = []  # one per micro-batch, read at the end
    records: list[dict] = []
    deadline = time.monotonic() + spec["budget_s"]

    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append((outputs["loss"] if isinstance(outputs, dict) else outputs).detach().float())
            if (batch_idx + 1) % spec["accum"]:
                return
            records.append({"step": trainer.global_step, "time_s": time.perf_counter(),
                            "host_rss_gib": host_rss_gib(),
                            "gpu_alloc_gib": torch.cuda.memory_allocated() / GIB if on_cuda else None})
            if time.monotonic() > deadline:
                trainer.should_stop = True

    strategy = "megatrain" if spec["system"] == "megatrain" else "auto"
    if spec["system"] == "megatrain" and not on_cuda:  # the dry run: the CPU has no overlapped DeepSpeed choice
        import lightning_megatrain

        strategy = lightning_megatrain.MegaTrainStrategy(cpu_adam="torch")
    trainer = L.Trainer(strategy=strategy, accelerator="cuda" if on_cuda else "cpu", devices=1,
                        precision="bf16-mixed", max_steps=spec["steps"], accumulate_grad_batches=spec["accum"],
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Recorder()])
    trainer.fit(module, train_dataloaders=loader)
    per_step = torch.stack(losses).view(-1, spec["accum"]).mean(1).tolist() if losses else []
    for record, loss in zip(records, per_step):
        record["loss"] = loss
    return {**spec, "records": records, "peak_host_gib": host_rss_gib("VmHWM"),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None, "error": None}


def growth(values: list[float], warmup: int) -> float | None:
    """max(values after warm-up) / values[warm-up] - 1, or None when too short."""
    if len(values) <= warmup or not values[warmup]:
        return None
    return max(values[warmup:]) / values[warmup] - 1.0


def summarize(runs: dict[str, dict], warmup: int) -> dict:
    """Memory growth per system and the loss difference between the two curves."""
    out: dict = {}
    for system, run in runs.items():
        recs = run.get("records") or []
        if not recs:
            continue
        times = [r["time_s"] for r in recs]
        steps_timed = len(times) - 1 - warmup
        out[system] = {
            "steps": len(recs),
            "host_rss_growth": growth([r["host_rss_gib"] for r in recs], warmup),
            "gpu_alloc_growth": (growth([r["gpu_alloc_gib"] for r in recs], warmup)
                                 if recs[0]["gpu_alloc_gib"] is not None else None),
            "peak_host_gib": run["peak_host_gib"], "peak_gpu_gib": run["peak_gpu_gib"],
            "step_s": (times[-1] - times[warmup]) / steps_timed if steps_timed > 0 else None,
            "final_loss": recs[-1]["loss"],
        }
    if all(s in runs and runs[s].get("records") for s in SYSTEMS):
        a = [r["loss"] for r in runs["megatrain"]["records"]]
        b = [r["loss"] for r in runs["plain"]["records"]]
        n = min(len(a), len(b))
        diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
        # relative differences only while the loss carries signal, up to plain's first loss under the floor: after
        # it the data is memorised, the loss near 0 and an occasional AdamW spike on either system makes ratios noise
        learning = next((i for i, y in enumerate(b[:n]) if y < LOSS_FLOOR), n)
        rel = [abs(x - y) / y for x, y in zip(a[:learning], b[:learning])]
        out["loss"] = {"steps_compared": n, "mean_abs_diff": sum(diffs) / n, "max_abs_diff": max(diffs),
                       "loss_floor": LOSS_FLOOR, "steps_before_floor": len(rel),
                       "mean_rel_diff_before_floor": sum(rel) / len(rel) if rel else None,
                       "max_rel_diff_before_floor": max(rel) if rel else None}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(MODELS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--distinct", type=int, default=64, help="fixed random sequences, cycled")
    parser.add_argument("--warmup", type=int, default=20, help="optimizer steps before the memory baseline")
    parser.add_argument("--budget-s", type=float, default=240.0, help="per system: stop after this many seconds")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, both systems")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(train(json.loads(args.child))), flush=True)
        return {}
    if args.dry_run:
        args.model, args.steps, args.accum, args.micro_batch, args.seq, args.distinct, args.warmup = (
            "tiny-llama", 6, 2, 2, 32, 4, 2)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{out}/{time.strftime('%Y-%m-%d')}-soak-{args.model}-{device}"  # a str: the model name has dots
    params = count_params(MODELS[args.model]["config"])[0]
    runs: dict[str, dict] = {}
    for system in args.systems.split(","):
        spec = {"system": system, "model": args.model, "steps": args.steps, "accum": args.accum,
                "micro_batch": args.micro_batch, "seq": args.seq, "distinct": args.distinct,
                "budget_s": args.budget_s, "device": device}
        proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", json.dumps(spec)],
                              capture_output=True, text=True, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        runs[system] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                        else {**spec, "error": (proc.stderr or proc.stdout)[-3000:]})
        print(f"{system}: " + ("error: " + runs[system]["error"][-600:] if runs[system]["error"]
                               else f"{len(runs[system]['records'])} steps"), flush=True)
        summary = summarize(runs, args.warmup)
        Path(stem + ".json").write_text(json.dumps(
            {"commit": args.commit, "device": device, "params": params, "dry_run": args.dry_run,
             "tokens_per_step": args.accum * args.micro_batch * args.seq, "warmup": args.warmup,
             "summary": summary, "runs": runs}, indent=1))
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["system", "step", "loss", "host_rss_gib", "gpu_alloc_gib", "time_s"])
        for system, run in runs.items():
            for r in run.get("records") or []:
                writer.writerow([system, r["step"], r["loss"], r["host_rss_gib"], r["gpu_alloc_gib"], r["time_s"]])
    for system in SYSTEMS:
        s = summary.get(system)
        if s:
            host = "-" if s["host_rss_growth"] is None else f"{100 * s['host_rss_growth']:.2f}%"
            gpu = "-" if s["gpu_alloc_growth"] is None else f"{100 * s['gpu_alloc_growth']:.2f}%"
            step = "-" if s["step_s"] is None else f"{s['step_s']:.3f} s"
            print(f"| {system} | {s['steps']} steps | {step}/step | host growth {host} | GPU growth {gpu} | "
                  f"final loss {s['final_loss']:.4f} |")
    if "loss" in summary:
        d = summary["loss"]
        rel = ("-" if d["mean_rel_diff_before_floor"] is None else
               f"{100 * d['mean_rel_diff_before_floor']:.2f}% (max {100 * d['max_rel_diff_before_floor']:.2f}%)")
        print(f"| loss | mean |diff| {d['mean_abs_diff']:.4f} | max {d['max_abs_diff']:.4f} | relative until plain's "
              f"< {LOSS_FLOOR}: {rel} over its first {d['steps_before_floor']} steps |")
    return summary


if __name__ == "__main__":
    main()
