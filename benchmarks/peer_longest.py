"""The longest sequence a peer trains on this machine: plain GPU Lightning (what a Lightning user has before
MegaTrain) or DeepSpeed ZeRO-3 offload (what one reaches for when the model does not fit).

``--system plain``: ``Trainer(strategy="auto")`` on one GPU, bf16-mixed, the model's parameters, grads and fused
AdamW states on the GPU (16 bytes per parameter). ``--system deepspeed_zero3_offload``: Lightning's DeepSpeedStrategy,
ZeRO-3 with parameters and optimizer offloaded to pinned host memory, DeepSpeedCPUAdam (benchmarks/workloads.py).
Both: HF gradient checkpointing (``use_reentrant=False``), clip 1.0, one row of ``T`` random token ids per step, HF's
loss (``labels=``, the full ``[T, V]`` logits) or the project's chunked loss (``--loss chunked``). Two optimizer
steps per ``T`` (the second backward holds the Adam states too: the peak), each ``T`` in its own subprocess; a
model's ladder stops at its first failure (out of memory, killed, or past its time; a failed child's last stderr lines
go to stdout). Row keys: system, model, seq_len, loss, ok, step_s (the second step), peak_gpu_alloc_gib,
peak_gpu_reserved_gib, peak_host_gib (VmHWM), error.

    python benchmarks/peer_longest.py --models llama-3.2-3b:32768,65536,131072 --out $OUT/peer-longest.json
    python benchmarks/peer_longest.py --system deepspeed_zero3_offload --models llama-2-7b:16384,32768 --timeout 300
    python benchmarks/peer_longest.py --dry-run    # tiny-llama on this machine's CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _child(spec: dict) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from workloads import MODELS, layer_class, make_module, make_strategy

    from lightning_megatrain._hardware import GIB, host_rss_gib

    on_cuda = torch.cuda.is_available()
    seq = spec["seq_len"]
    config = dict(MODELS[spec["model"]]["config"], max_position_embeddings=seq)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config["vocab_size"], (seq,), generator=gen) for _ in range(2)]
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if on_cuda:
                torch.cuda.synchronize()  # benchmark marks only
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    plain = spec["system"] == "plain"
    strategy, clip, optimizer, _, _ = make_strategy(spec["system"], layer_class(config), on_cuda)
    if plain and not on_cuda:
        optimizer = "adamw"  # the dry run: torch's AdamW on the CPU, not the GPU's fused one
    module = make_module(config, loss=spec["loss"], optimizer=optimizer, grad_ckpt=True,
                         direct_clip=plain)  # Lightning refuses to clip a fused optimizer itself
    trainer = L.Trainer(accelerator="cuda" if on_cuda else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed" if on_cuda else "32-true", max_steps=2, gradient_clip_val=clip,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timer()])
    trainer.fit(module, DataLoader(data, batch_size=1))
    return {"ok": True, "step_s": times[-1],
            "peak_gpu_alloc_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
            "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_cuda else None,
            "peak_host_gib": host_rss_gib("VmHWM")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3.2-3b:32768,65536,131072,262144",
                                                    "llama-2-7b:16384,32768,65536"],
                    help="model:T1,T2,... ladders, shortest first")
    ap.add_argument("--system", default="plain", choices=["plain", "deepspeed_zero3_offload"])
    ap.add_argument("--loss", default="hf", choices=["hf", "chunked"])
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per T")
    ap.add_argument("--out", default="benchmarks/results/peer-longest.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny-llama at 64 and 128 tokens on this machine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("ROW " + json.dumps(_child(json.loads(args.child))), flush=True)
        return
    ladders = ["tiny-llama:64,128"] if args.dry_run else args.models
    rows = []
    for ladder in ladders:
        model, lengths = ladder.split(":")
        for seq in (int(t) for t in lengths.split(",")):
            spec = {"system": args.system, "model": model, "seq_len": seq, "loss": args.loss}
            row = dict(spec, ok=False)
            try:
                r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                   text=True, timeout=args.timeout)
                found = [line[4:] for line in r.stdout.splitlines() if line.startswith("ROW ")]
                if found:
                    row.update(json.loads(found[-1]))
                elif r.returncode < 0:  # a signal: SIGKILL is most often the kernel's OOM killer (host memory)
                    row["error"] = f"killed by signal {-r.returncode} (9: SIGKILL, most often host memory)"
                else:  # the last line of the error: CUDA out of memory, ...
                    errors = [line for line in r.stderr.splitlines() if "Error" in line or "error" in line]
                    row["error"] = (errors or r.stderr.strip().splitlines() or ["no output"])[-1][:300]
                if not found:  # the child's last words, for the log
                    print("\n".join(r.stderr.strip().splitlines()[-15:]), flush=True)
            except subprocess.TimeoutExpired:
                row["error"] = f"timeout after {args.timeout:g} s"
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not row["ok"]:
                break  # longer ones need more memory (or time) still
    if not args.dry_run:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    for r in rows:
        print(f"| {r['system']} | {r['model']} | {r['seq_len']:,} | {'ok' if r['ok'] else 'FAILED'} | "
              f"{r.get('step_s')} | {r.get('peak_gpu_alloc_gib')} | {r.get('peak_host_gib')} | "
              f"{r.get('error', '')[:120]} |")


if __name__ == "__main__":
    main()
