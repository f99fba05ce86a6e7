"""Causal attention at long context through each of SDPA's fused backends: time, TFLOP/s, memory and agreement.

One row per (backend, T): bf16 q/k/v laid out as transformers' Llama attention makes them (``[B, T, heads, D]``
projections viewed as ``[B, heads, T, D]``; ``--contiguous``: ``[B, heads, T, D]`` in memory), ``is_causal=True``,
no mask. Timed with CUDA events around ``reps``
calls after one warm-up: the forward alone, then forward and backward. FLOPs (FlashAttention's convention): a
causal forward is ``2 * B * T^2 * heads * D`` (two matmuls of ``2 * T^2 * D`` per head, halved by the causal mask),
the backward 2.5 times that. Agreement: the largest absolute difference of the output and of dq against the flash
backend's (and the default's output against cuDNN's: 0 where torch chose it), beside flash's own difference from
an fp32 math reference on the first 8,192 positions (the rows that fit the math kernel; past them no reference).

    python benchmarks/attention_backends.py --seq-lens 32768,131072 --out $OUT/attention-backends.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}


def _qkv(seq: int, heads: int, head_dim: int, contiguous: bool, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(3):
        # [B, T, heads, D] -> [B, heads, T, D], as the model's view(...).transpose(1, 2)
        x = torch.randn(1, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = x.transpose(1, 2)
        out.append((x.contiguous() if contiguous else x).requires_grad_())
    return out


def _time(fn, reps: int) -> float:
    fn()  # warm-up (and the backend's plan/graph build)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def run(backend: str, seq: int, heads: int, head_dim: int, reps: int, reference: dict, contiguous: bool) -> dict:
    q, k, v = _qkv(seq, heads, head_dim, contiguous)
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops_fwd = 2 * seq * seq * heads * head_dim
    row = dict(backend=backend, seq_len=seq, heads=heads, head_dim=head_dim, contiguous=contiguous)
    try:
        chosen = BACKENDS[backend]  # None: torch's own choice among them
        with sdpa_kernel(chosen) if chosen is not None else contextlib.nullcontext():
            def fwd():
                with torch.no_grad():
                    return sdpa(q, k, v, is_causal=True)

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                sdpa(q, k, v, is_causal=True).backward(grad)

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_s = _time(fwd, reps)
            both_s = _time(fwd_bwd, reps)
            row.update(fwd_s=round(fwd_s, 4), fwd_bwd_s=round(both_s, 4),
                       fwd_tflops=round(flops_fwd / fwd_s / 1e12, 1),
                       fwd_bwd_tflops=round(3.5 * flops_fwd / both_s / 1e12, 1),
                       bwd_tflops=round(2.5 * flops_fwd / max(both_s - fwd_s, 1e-9) / 1e12, 1),
                       peak_extra_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2))
            out = fwd()
            q.grad = None
            sdpa(q, k, v, is_causal=True).backward(grad)
            dq = q.grad.clone()
        if backend == "flash":
            reference.update(out=out, dq=dq)
            n = min(seq, 8192)
            qs, ks, vs = (t[:, :, :n].detach().float().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.MATH):
                ref = sdpa(qs, ks, vs, is_causal=True)
                ref.backward(grad[:, :, :n].float())
            row.update(out_vs_fp32_math=float((out[:, :, :n].float() - ref).abs().max()),
                       dq_vs_fp32_math=float((dq[:, :, :n].float() - qs.grad).abs().max()))
        elif "out" in reference:  # the flash row ran (it is the reference)
            row.update(out_vs_flash=float((out - reference["out"]).abs().max()),
                       dq_vs_flash=float((dq - reference["dq"]).abs().max()))
        if backend == "cudnn":
            reference.update(cudnn_out=out)
        if backend == "default" and "cudnn_out" in reference:  # 0: torch chose cuDNN
            row.update(out_vs_cudnn=float((out - reference["cudnn_out"]).abs().max()))
    except RuntimeError as err:  # a backend that refuses the shape, or runs out of memory
        row["error"] = str(err).splitlines()[0][:200]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--contiguous", action="store_true", help="q, k, v contiguous as [B, heads, T, D]")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="flash,cudnn,efficient,default",
                    help="flash first: the others are compared to it; default: no backend named (torch chooses)")
    ap.add_argument("--out", default="benchmarks/results/attention-backends.json")
    args = ap.parse_args()
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        reference: dict = {}
        for backend in args.backends.split(","):
            row = run(backend, seq, args.heads, args.head_dim, args.reps, reference, args.contiguous)
            rows.append(row)
            torch.cuda.empty_cache()  # the row's tensors are gone: give their blocks back for a longer T
            print(json.dumps(row), flush=True)
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                cudnn=torch.backends.cudnn.version(), argv=sys.argv[1:])
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("| backend | T | fwd TFLOP/s | fwd+bwd TFLOP/s | bwd TFLOP/s | extra GiB | vs flash (out, dq) |")
    for r in rows:
        print(f"| {r['backend']} | {r['seq_len']} | {r.get('fwd_tflops')} | {r.get('fwd_bwd_tflops')} | "
              f"{r.get('bwd_tflops')} | {r.get('peak_extra_gib')} | "
              f"{r.get('out_vs_flash', r.get('out_vs_fp32_math'))}, {r.get('dq_vs_flash', r.get('dq_vs_fp32_math'))}"
              f" {r.get('error', '')} |")


if __name__ == "__main__":
    main()
