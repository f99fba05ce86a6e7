"""Host AdamW speed by host-state layout: CompactAdamW's formats against torch's fused AdamW and DeepSpeedCPUAdam.

Each system steps the same layer-shaped parameters (``--layers`` flat tensors of ``--params / --layers`` each) with
random gradients; the figure is parameters updated per second (median of ``--repeats`` full steps, the first step,
which allocates the states and compiles, not counted). Memory traffic per parameter (read + write): fp32 AdamW 28 B
(p, g, m, v read; p, m, v written); ``compact`` 10 B (bf16 p and g, 8-bit m and v read; p, m, v written);
``compact_kahan`` 14 B; ``int8_moments`` 16 B. The kernels are optim/compact_adam.py's: the native single-pass
kernel for these 8-bit layouts on the CPU (optim/compact_kernel.py, built on the first step); ``--kernel compiled``
measures inductor's kernel instead (what runs where the native one does not build), ``--kernel eager`` the eager
ops.

Usage (on the H200's 16-core host: the rates the planner quotes; each row prints as it ends, with its first step,
which on a fresh machine builds DeepSpeed's extension and compiles the kernels: give it several minutes):
    python benchmarks/compact_adam.py --params 1.6e9 --layers 16 --out DIR     (writes DIR/compact_adam.json)
    python benchmarks/compact_adam.py --dry-run --out DIR                      (tiny, eager: checks the code path)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from statistics import median

import torch

# the GPU machine's copy of the tree has the package uninstalled: import it from this checkout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_megatrain.optim import compact_adam, compact_kernel  # noqa: E402
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS, CompactAdamW  # noqa: E402
from lightning_megatrain.optim.host_optimizer import to_host_optimizer  # noqa: E402

LAYOUTS = {name: layout for name, layout in HOST_STATE_LAYOUTS.items() if name != "fp32"}  # CompactAdamW's
# system -> (parameter dtype, gradient dtype, CompactAdamW formats or None, host state bytes per parameter)
SYSTEMS = {
    "torch_fused": (torch.float32, torch.float32, None, 16.0),
    "deepspeed": (torch.float32, torch.float32, None, 16.0),
    **{name: (layout.weight_dtype, layout.grad_dtype, (layout.weights, layout.moments),
              sum(layout.bytes_per_param().values())) for name, layout in LAYOUTS.items()},
}
ROW_KEYS = ("system", "params", "threads", "state_bytes_per_param", "kernel", "first_step_s", "step_s",
            "gparam_per_s", "vs_torch_fused", "vs_deepspeed", "error")


_DRAW = 1 << 22  # normals drawn per tensor; the rest repeats them


def _normal(numel: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` values of N(0, std^2) in ``dtype``: 4M normals repeated. torch draws CPU normals on one thread
    (~50M/s), and the 3.2e9 of a 1.6e9-parameter run took longer than a 100 s device command
    (2026-12-03-compact-adam-h200-*.log); the update's speed does not depend on the values being distinct."""
    base = torch.empty(min(numel, _DRAW)).normal_(0.0, std).to(dtype)
    return base.repeat((numel + base.numel() - 1) // base.numel())[:numel]


def _params(n_layers: int, per_layer: int, dtype: torch.dtype, grad_dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = []
    for _ in range(n_layers):
        p = torch.nn.Parameter(_normal(per_layer, 0.02, dtype))
        p.grad = _normal(per_layer, 1.0, grad_dtype)
        params.append(p)
    return params


def _optimizer(system: str, params: list[torch.nn.Parameter], kernel: str) -> torch.optim.Optimizer:
    formats = SYSTEMS[system][2]
    if formats is None:
        return to_host_optimizer(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1),
                                 "torch" if system == "torch_fused" else "deepspeed")
    weights, moments = formats
    return CompactAdamW(params, lr=1e-4, weight_decay=0.1, weights=weights, moments=moments, compile=kernel != "eager")


def _kernel(system: str, kernel: str) -> str:
    """Which kernel a system's step runs: torch's or DeepSpeed's, else CompactAdamW's native, compiled or eager one
    (``--kernel``: "auto" is the native one where it builds)."""
    if SYSTEMS[system][2] is None:
        return {"torch_fused": "torch fused", "deepspeed": "DeepSpeedCPUAdam"}[system]
    if kernel == "auto":
        return "native" if compact_kernel.library() is not None else "compiled"
    return kernel


def measure(system: str, n_layers: int, per_layer: int, repeats: int, kernel: str) -> dict:
    dtype, grad_dtype, formats, state_bytes = SYSTEMS[system]
    row = {"system": system, "params": n_layers * per_layer, "threads": torch.get_num_threads(),
           "state_bytes_per_param": state_bytes, "kernel": _kernel(system, kernel), "first_step_s": None,
           "step_s": None, "gparam_per_s": None, "vs_torch_fused": None, "vs_deepspeed": None, "error": None}
    try:
        params = _params(n_layers, per_layer, dtype, grad_dtype)
        opt = _optimizer(system, params, kernel)
        t = time.perf_counter()
        opt.step()  # allocates the states (and compiles; DeepSpeed's first use builds its extension)
        row["first_step_s"] = time.perf_counter() - t
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        row["step_s"] = median(times)
        row["gparam_per_s"] = row["params"] / row["step_s"] / 1e9
    except Exception as e:  # DeepSpeed not installed or not building: the row says so, the others still run
        row["error"] = f"{type(e).__name__}: {e}"
    gc.collect()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| system | state B/param | kernel | step s | Gparam/s | vs torch fused | vs DeepSpeedCPUAdam |",
             "| --- " * 7 + "|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['system']} | {r['state_bytes_per_param']:.2f} | | | error: {r['error'][:60]} | |")
            continue
        ratios = [f"{r[k]:.2f}x" if r[k] else "" for k in ("vs_torch_fused", "vs_deepspeed")]
        lines.append(f"| {r['system']} | {r['state_bytes_per_param']:.2f} | {r['kernel']} | {r['step_s']:.3f} | "
                     f"{r['gparam_per_s']:.2f} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=1.6e9)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {list(SYSTEMS)}")
    parser.add_argument("--kernel", choices=("auto", "compiled", "eager"), default="auto",
                        help="CompactAdamW's kernel: auto (native where it builds), compiled (inductor), eager")
    parser.add_argument("--dry-run", action="store_true", help="2 layers of 2**16, 1 repeat, eager")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.kernel == "compiled":
        compact_adam._native = lambda *a: False  # inductor's kernel for every layout
    if args.dry_run:
        args.params, args.layers, args.repeats, args.kernel = 2 * 2**16, 2, 1, "eager"
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    per_layer = int(args.params / args.layers)
    rows = []
    for system in systems:  # one line each as it ends: a run cut by a time limit keeps what it measured
        rows.append(measure(system, args.layers, per_layer, args.repeats, args.kernel))
        print(json.dumps(rows[-1]), flush=True)
    for system, key in (("torch_fused", "vs_torch_fused"), ("deepspeed", "vs_deepspeed")):
        reference = next((r["gparam_per_s"] for r in rows if r["system"] == system and not r["error"]), None)
        for r in rows:
            if reference and r["gparam_per_s"]:
                r[key] = r["gparam_per_s"] / reference
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compact_adam.json"), "w") as f:
        json.dump({"dry_run": args.dry_run, "kernel": args.kernel, "results": rows}, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
