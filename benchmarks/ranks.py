"""Tokens/s of `Trainer(strategy="megatrain", devices=N)` at the same tokens per GPU per step as `devices=1`.

Run it once per N with the same shape; Lightning's own launcher starts ranks 1..N-1 by running this script again
(`_SubprocessScriptLauncher`), each on its GPU, NCCL between them. On the x2 machine (issue targets: >= 1.9x the
single-GPU tokens/s at the 3B shape):

  python benchmarks/ranks.py --devices 1 --model llama-3.2-3b --micro-batch 8 --accumulate 4 --out benchmarks/results
  python benchmarks/ranks.py --devices 2 --model llama-3.2-3b --micro-batch 8 --accumulate 4 --out benchmarks/results
  python benchmarks/ranks.py --devices 2 --system deepspeed_zero3_offload --out benchmarks/results   # the peer

Each writes <date>-ranks-<system>-<model>-<device>-x<N>.json (rank 0): tokens/s over all ranks, per GPU, the median
step, each rank's peak host RSS and peak GPU memory, and the run's options. Workload as benchmarks/throughput.py (random
init drawn like HF's, synthetic token ids, seq 1024, the chunked loss, AdamW, clipping at 1.0, bf16-mixed), with
Lightning's distributed sampler giving each rank its own micro-batches. `megatrain` options are the defaults (or
`--strategy-args`), so the single-GPU run overlaps its optimizer step and places device groups, which several ranks
do not yet (docs/multi-gpu.md); several ranks overlap theirs and bind each rank to cores of its own. To measure what
the overlapped step and the binding give two ranks:

  python benchmarks/ranks.py --devices 2 --strategy-args '{"overlap_optimizer": false, "cpu_binding": false}' \
      --tag serial

The peer, `--system deepspeed_zero3_offload`, is Lightning's DeepSpeedStrategy (ZeRO-3, parameters
and optimizer offloaded, pinned) with DeepSpeedCPUAdam and HF gradient checkpointing, as in benchmarks/throughput.py.

CPU check (gloo, the tiny model, 2 steps; what tests/test_benchmark_scripts.py runs):
  python benchmarks/ranks.py --dry-run --devices 2 --out /tmp/ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks import each other
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this package, when it is not installed

from workloads import MODELS, count_params, layer_class, make_module, make_strategy  # noqa: E402

SEQ_LEN = 1024
START = time.perf_counter()


class StepTimer:
    """Wall time of each optimizer step (the device synchronized at each boundary), and the peaks at the end."""

    def __init__(self, accumulate: int, profile_step: int | None = None) -> None:
        self.accumulate = accumulate
        self.profile_step = profile_step  # the optimizer step (1-based) rank 0 profiles and prints, or None
        self.profiler = None
        self.times: list[float] = []
        self._last: float | None = None

    def callback(self):
        from lightning.pytorch import Callback

        timer = self

        class _Timer(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                starting = batch_idx % timer.accumulate == 0 and trainer.global_step + 1 == timer.profile_step
                if starting and trainer.is_global_zero:
                    timer.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                        torch.profiler.ProfilerActivity.CUDA],
                                                            with_stack=True)
                    timer.profiler.__enter__()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if (batch_idx + 1) % timer.accumulate:
                    return
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if trainer.is_global_zero:  # where a run's minutes go (setup and compile against steps)
                    print(f"[ranks] step {trainer.global_step} ends {now - START:.1f} s after start", flush=True)
                if timer.profiler is not None and trainer.global_step == timer.profile_step:
                    timer.profiler.__exit__(None, None, None)  # rank 0's step: where its wall time goes
                    print_profile(timer.profiler)
                    timer.profiler = None
                if timer._last is not None:
                    timer.times.append(now - timer._last)
                timer._last = now

        return _Timer()


def print_profile(profiler: torch.profiler.profile) -> None:
    """The profiled step's ops by total and by self CPU time, and the Python stacks of the calls that wait for the
    device (``cuda*Synchronize``)."""
    averages = profiler.key_averages()
    print(averages.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    stacks = profiler.key_averages(group_by_stack_n=8)
    waits = sorted((e for e in stacks if "Synchronize" in e.key), key=lambda e: -e.cpu_time_total)
    for event in waits[:8]:
        print(f"{event.key}: {event.count} calls, {event.cpu_time_total / 1e3:.1f} ms")
        print("    " + "\n    ".join(event.stack))


def peak_host_gib() -> float:
    """This process's resident-set high-water mark (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--model", default="llama-3.2-3b", choices=sorted(MODELS))
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences of 1024 per micro-batch and rank")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7, help="optimizer steps; the first 2 are warm-up")
    parser.add_argument("--profile-step", type=int, help="print rank 0's torch.profiler tables of this step")
    parser.add_argument("--system", default="megatrain", choices=("megatrain", "deepspeed_zero3_offload"),
                        help="MegaTrainStrategy() defaults, or the peer (CUDA only)")
    parser.add_argument("--strategy-args", default="",
                        help='JSON of MegaTrainStrategy arguments instead of its defaults, e.g. '
                             '\'{"overlap_optimizer": false, "cpu_binding": false}\' (--system megatrain)')
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny-llama, 2 steps of 2 micro-batches")
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.micro_batch, args.accumulate, args.steps = "tiny-llama", 2, 2, 3
    on_cuda = torch.cuda.is_available() and not args.dry_run
    seq_len = 64 if args.dry_run else SEQ_LEN

    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    config = MODELS[args.model]["config"]
    strategy, clip, optimizer, _, _ = make_strategy(args.system, layer_class(config), on_cuda)
    if args.strategy_args:
        if args.system != "megatrain":
            parser.error("--strategy-args is for --system megatrain")
        from lightning_megatrain import MegaTrainStrategy

        strategy = MegaTrainStrategy(**json.loads(args.strategy_args))
    module = make_module(config, loss="chunked", optimizer=optimizer, direct_clip=False,
                         grad_ckpt=args.system == "deepspeed_zero3_offload")
    world = args.devices * args.num_nodes
    n_samples = args.micro_batch * args.accumulate * args.steps * world
    data = torch.randint(0, config["vocab_size"], (n_samples, seq_len), generator=torch.Generator().manual_seed(0))
    timer = StepTimer(args.accumulate, args.profile_step)
    trainer = Trainer(
        accelerator="cuda" if on_cuda else "cpu", devices=args.devices, num_nodes=args.num_nodes,
        strategy=strategy, precision="bf16-mixed" if on_cuda else "32-true", max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=clip, callbacks=[timer.callback()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=args.micro_batch))
    strategy = trainer.strategy
    measured = timer.times[1:] if len(timer.times) > 1 else timer.times  # the first interval holds step 2's warm-up
    step_s = median(measured)
    peaks = torch.tensor([peak_host_gib(), torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0,
                          torch.get_num_threads(),  # the host step's threads (Lightning's launcher sets them)
                          len(os.sched_getaffinity(0))])  # the CPUs it may run on (cpu_binding)
    gathered = strategy.all_gather(peaks.to(strategy.root_device)).reshape(-1, 4).cpu().tolist()
    if not strategy.is_global_zero:
        return
    tokens_per_step = args.micro_batch * args.accumulate * seq_len * world
    params, _ = count_params(config)
    device = torch.cuda.get_device_name(0).split()[-1].lower() if on_cuda else "cpu"
    row = {
        "system": args.system, "model": args.model, "params": params, "devices": args.devices,
        "num_nodes": args.num_nodes, "world": world,
        "micro_batch": args.micro_batch, "accumulate": args.accumulate, "seq_len": seq_len,
        "tokens_per_step": tokens_per_step, "tokens_per_gpu_per_step": tokens_per_step // world,
        "step_times_s": timer.times, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
        "tokens_per_s_per_gpu": tokens_per_step / step_s / world,
        "peak_host_gib_by_rank": [p[0] for p in gathered], "peak_gpu_gib_by_rank": [p[1] for p in gathered],
        "threads_by_rank": [int(p[2]) for p in gathered], "cpus_by_rank": [int(p[3]) for p in gathered],
        "device": device, "dry_run": args.dry_run,
        "options": dataclasses.asdict(strategy.config) if args.system == "megatrain" else strategy.config,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = args.out / f"{time.strftime('%Y-%m-%d')}-ranks-{args.system}-{args.model}-{device}-x{world}{tag}.json"
    path.write_text(json.dumps(row, indent=1, default=str))
    print(f"{args.system} {args.model} x{world}: {row['tokens_per_s']:.0f} tokens/s "
          f"({row['tokens_per_s_per_gpu']:.0f} per GPU), "
          f"median step {step_s:.2f} s -> {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
