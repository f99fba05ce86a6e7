"""Host-side step cost: CPU Adam implementations and the engine's gradient clipping, on layer-shaped flat buffers.

Prediction (METHOD.md): Adam reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 bytes
per parameter, so at the machine's ~79 GB/s host copy bandwidth (BENCHMARKS.md) the floor is ~2.8 Gparam/s.
Clipping reads the grads once for the norm (4 B/param) and reads+writes them once to scale (8 B/param).

Usage: python benchmarks/host_optimizer.py --params 1.6e9 --layers 16 --out DIR   (writes DIR/host_optimizer.json)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from statistics import median

import torch
from torch import nn

from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.host_store import pack_group
from lightning_megatrain.optim.host_optimizer import to_host_optimizer


def layer_params(n_layers: int, per_layer: int) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """Layers of 4 matrices each, packed into flat host buffers exactly as the engine packs them."""
    side = int((per_layer / 4) ** 0.5)
    layers = [nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(4)) for _ in range(n_layers)]
    groups = [pack_group(tensor_slots(layer)) for layer in layers]
    for g in groups:
        g.grad.normal_()
        g.attach_grads()
    return groups, [p for g in groups for p in g.params]


def time_steps(step, repeats: int = 5) -> float:
    step()  # allocates optimizer states
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=1.6e9)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    groups, params = layer_params(args.layers, int(args.params / args.layers))
    n = sum(p.numel() for p in params)
    rows = {"params": n, "threads": torch.get_num_threads()}
    for mode in ("deepspeed", "torch"):
        try:
            opt = to_host_optimizer(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1), mode)
        except RuntimeError as e:
            rows[f"adam_{mode}"] = {"error": str(e)}
            continue
        s = time_steps(opt.step)
        rows[f"adam_{mode}"] = {"step_s": s, "gparam_per_s": n / s / 1e9, "gb_per_s": 28 * n / s / 1e9}
        del opt
    norm_s = time_steps(lambda: torch.stack([g.grad_norm_sq() for g in groups]).sum().sqrt())
    scale_s = time_steps(lambda: [g.scale_grads(torch.tensor(0.999)) for g in groups])
    rows["clip_norm"] = {"step_s": norm_s, "gb_per_s": 4 * n / norm_s / 1e9}
    rows["clip_scale"] = {"step_s": scale_s, "gb_per_s": 8 * n / scale_s / 1e9}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_optimizer.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
