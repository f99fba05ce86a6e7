"""Both memories as one pool, measured against the planner (planner/pool.py, [Note: memory pool]).

Trains the Llama-2-13B shape (13.02B parameters, fp32 masters, grads and AdamW moments: 194 GiB of state, more than
the H200's 128 GiB host) with ``MegaTrainStrategy()`` and no options, so ``gpu_optimizer_groups="auto"`` must keep
the state of the first groups on the GPU, and writes one JSON row: the groups chosen, tokens/s, peak host RSS and
peak GPU memory, each beside the planner's prediction for the same run. ``--layers`` truncates the depth (the row
says so); ``--host-gib`` makes the engine see at most that much host memory (its free memory is the budget less this
process's RSS), so a truncated model needs the split too.

    python benchmarks/memory_pool.py                      # H200: full depth, 8 x 1024 tokens, about 4-5 minutes
    python benchmarks/memory_pool.py --layers 20 --host-gib 60
    python benchmarks/memory_pool.py --dry-run            # CPU: tiny Llama, the code path (no split without CUDA)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402

GIB = 2**30
LLAMA2_13B = dict(workloads._LLAMA, vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=40, tie_word_embeddings=False,
                  max_position_embeddings=4096, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def force_host_budget(budget_gib: float) -> None:
    """Make the engine's host checks and its split see at most ``budget_gib`` for this whole process."""
    from lightning_megatrain import _hardware
    from lightning_megatrain.engine import host_store, placement

    def bounded():
        real = _hardware.available_host_bytes()
        rss = (_hardware.host_rss_gib() or 0.0) * GIB
        forced = int(budget_gib * GIB - rss)
        return (forced, f"forced: {budget_gib:g} GiB budget") if real is None or forced < real[0] else real

    placement.available_host_bytes = host_store.available_host_bytes = bounded


def planned(config: dict, micro_batch: int, seq_len: int, host_gib: float | None, gpu_gib: float | None) -> dict:
    """The planner's prediction of this run: a machine whose usable host RAM is the budget (or this machine's)."""
    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.planner import HOST_OS_RESERVE_FRACTION, HOST_OS_RESERVE_MIN_GIB, Machine, plan

    host_ram = None
    if host_gib is not None:  # usable = limit - max(min reserve, fraction x limit): the limit whose usable is host_gib
        host_ram = max(host_gib + HOST_OS_RESERVE_MIN_GIB, host_gib / (1 - HOST_OS_RESERVE_FRACTION))
    p = plan(workloads.hf_config(config), seq_len=seq_len, micro_batch=micro_batch, config=EngineConfig(),
             machine=Machine(host_ram_gib=host_ram, gpu_mem_gib=gpu_gib))
    return {"fits": p.fits, "gpu_optimizer_groups": p.assumptions["gpu_optimizer_groups"],
            "memory_pool": p.memory_pool, "tokens_per_s": p.tokens_per_s, "host_gib": p.host_total / GIB,
            "host_usable_gib": p.host_usable / GIB, "gpu_peak_gib": p.gpu_total / GIB, "verdict": p.verdict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40, help="decoder layers (40: the full Llama-2-13B shape)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps; the first 3 are not timed")
    ap.add_argument("--host-gib", type=float, help="host memory the engine may use in all (default: the machine's)")
    ap.add_argument("--out", default="benchmarks/results/memory-pool-h200.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny Llama on this machine (CPU): the code path")
    args = ap.parse_args()

    import lightning as L
    import torch

    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain._hardware import host_rss_gib

    config = dict(workloads.MODELS["tiny-llama"]["config"]) if args.dry_run else dict(LLAMA2_13B)
    config["num_hidden_layers"] = 2 if args.dry_run else args.layers
    micro_batch, seq_len = (2, 64) if args.dry_run else (args.micro_batch, args.seq_len)
    steps = 4 if args.dry_run else args.steps
    on_cuda = torch.cuda.is_available() and not args.dry_run
    gpu_gib = torch.cuda.mem_get_info()[1] / GIB if on_cuda else None
    prediction = planned(config, micro_batch, seq_len, args.host_gib, gpu_gib)
    print("planned:", prediction["verdict"], flush=True)
    if args.host_gib is not None:
        force_host_budget(args.host_gib)

    times: list[float] = []

    class Chosen(L.Callback):
        groups = None

        def on_train_end(self, trainer, pl_module):  # the engine's decision ("auto" resolved at the first batch)
            Chosen.groups = trainer.strategy.engine.config.gpu_optimizer_groups

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    module = workloads.make_module(config, loss="chunked", optimizer="adamw", grad_ckpt=False, direct_clip=False)
    data = torch.randint(0, config["vocab_size"], (micro_batch * steps, seq_len))
    loader = torch.utils.data.DataLoader(data, batch_size=micro_batch)
    strategy = MegaTrainStrategy()
    trainer = L.Trainer(accelerator="cuda" if on_cuda else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed" if on_cuda else "32-true", max_steps=steps, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock(), Chosen()])
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    timed = times[3:] if len(times) > 4 else times[1:]
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1 else float("nan")
    chosen = Chosen.groups
    row = {
        "model": "llama-2-13b" if config["num_hidden_layers"] == 40 and not args.dry_run else
        f"llama-2-13b shape TRUNCATED to {config['num_hidden_layers']} layers" if not args.dry_run else "tiny-llama",
        "n_params": sum(p.numel() for p in module.parameters()),
        "micro_batch": micro_batch, "seq_len": seq_len, "steps": steps, "host_budget_gib": args.host_gib,
        "measured": {"tokens_per_s": micro_batch * seq_len / step_s, "step_s": step_s,
                     "gpu_optimizer_groups": chosen,
                     "peak_host_rss_gib": host_rss_gib("VmHWM"),
                     "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
                     "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_cuda else None,
                     "wall_s": time.perf_counter() - t0},
        "planned": prediction,
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
    }
    print(json.dumps(row, indent=1, default=str))
    if not args.dry_run:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
