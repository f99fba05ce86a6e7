"""Host optimizer step of Muon against AdamW on Llama-shaped layers, as the engine runs it (one call per layer).

Each layer holds q, o (hidden x hidden), k, v (kv_dim x hidden), gate, up (intermediate x hidden), down
(hidden x intermediate) and two norm weights, packed into flat fp32 host buffers as the engine packs them (pinned
when CUDA is present). Timed per optimizer step, median of ``--repeats`` after one warm-up step that allocates the
states:

- ``adamw``: torch's fused AdamW on the host (what ``cpu_adam="torch"`` and the overlapped step run), 28 B/param of
  host traffic.
- ``muon``: :class:`~lightning_megatrain.optim.Muon` (the norms with AdamW), its Newton-Schulz iteration on
  ``--ns-device`` (``auto``: CUDA when present, as under ``MegaTrainStrategy`` on a GPU): the host momentum and
  update passes, each matrix's bf16 trip over PCIe and the iteration itself.
- ``ns_only``: the iteration alone on the NS device for every matrix of the step (inputs already there), and its
  FLOPs (``ns_flops``) and rate.

Usage: python benchmarks/muon_step.py --hidden 4096 --intermediate 11008 --layers 4 --out DIR
       (writes DIR/muon_step.json); --dry-run: a tiny shape on this machine, 2 repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from statistics import median

import torch
from torch import nn

# the GPU machine's copy of the tree has the package uninstalled: import it from this checkout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_megatrain.engine.discovery import tensor_slots  # noqa: E402
from lightning_megatrain.engine.host_store import pack_group  # noqa: E402
from lightning_megatrain.engine.pinned import HostRegistry  # noqa: E402
from lightning_megatrain.optim import Muon, muon_param_groups  # noqa: E402
from lightning_megatrain.optim.host_optimizer import to_host_optimizer  # noqa: E402
from lightning_megatrain.optim.newton_schulz import newton_schulz, ns_flops  # noqa: E402
from lightning_megatrain.optim.updates import host_update  # noqa: E402


class LlamaLayer(nn.Module):
    """The parameters of one Llama decoder layer (no forward: only the optimizer touches them)."""

    def __init__(self, hidden: int, intermediate: int, kv_dim: int) -> None:
        super().__init__()
        shapes = {"q": (hidden, hidden), "k": (kv_dim, hidden), "v": (kv_dim, hidden), "o": (hidden, hidden),
                  "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
        self.proj = nn.ParameterDict({k: nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()})
        self.norms = nn.ParameterList([nn.Parameter(torch.ones(hidden)) for _ in range(2)])


def build(args: argparse.Namespace, registry: HostRegistry | None):
    layers = nn.ModuleList(LlamaLayer(args.hidden, args.intermediate, args.kv_dim) for _ in range(args.layers))
    groups = [pack_group(tensor_slots(layer), registry) for layer in layers]
    for g in groups:
        g.grad.normal_()
        g.attach_grads()
    return layers, groups


def time_steps(optimizer, groups, device: torch.device, repeats: int) -> list[float]:
    """Seconds per host step, the engine's way: one update built and prepared per step, then called per layer."""
    times = []
    for _ in range(repeats + 1):  # the first allocates the states
        t = time.perf_counter()
        update = host_update(optimizer, None, frozenset(), None, device)
        update.prepare([g.params for g in groups])
        for g in groups:
            update(g.params)
        times.append(time.perf_counter() - t)
    return times[1:]


def state_bytes_per_param(optimizer, n_params: int) -> float:
    total = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return total / n_params


def time_ns_only(layers, ns_device: torch.device, repeats: int) -> float:
    dtype = torch.bfloat16 if ns_device.type == "cuda" else torch.float32
    mats = [p.detach().to(ns_device, dtype) for layer in layers for p in layer.proj.values()]
    times = []
    for _ in range(repeats + 1):
        if ns_device.type == "cuda":
            torch.cuda.synchronize(ns_device)
        t = time.perf_counter()
        for m in mats:
            newton_schulz(m)
        if ns_device.type == "cuda":
            torch.cuda.synchronize(ns_device)
        times.append(time.perf_counter() - t)
    return median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--kv-dim", type=int, default=None, help="rows of k and v (default: hidden, no GQA)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ns-device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--out", default=".")
    parser.add_argument("--dry-run", action="store_true", help="a tiny shape on this machine, 2 repeats")
    args = parser.parse_args()
    if args.dry_run:
        args.hidden, args.intermediate, args.kv_dim, args.layers, args.repeats = 64, 176, 32, 2, 2
    args.kv_dim = args.kv_dim or args.hidden
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")  # the engine's
    ns_device = device if args.ns_device == "auto" else torch.device(args.ns_device)
    registry = HostRegistry() if cuda else None

    layers, groups = build(args, registry)
    n = sum(g.numel for g in groups)
    matrices = [p.shape for layer in layers for p in layer.proj.values()]
    flops = sum(ns_flops(*s) for s in matrices)
    row = {
        "shape": {"hidden": args.hidden, "intermediate": args.intermediate, "kv_dim": args.kv_dim,
                  "layers": args.layers},
        "params": n, "matrix_params": sum(s.numel() for s in matrices), "threads": torch.get_num_threads(),
        "device": str(device), "ns_device": str(ns_device), "dry_run": args.dry_run,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
    }
    adamw = to_host_optimizer(torch.optim.AdamW([p for layer in layers for p in layer.parameters()], lr=1e-4,
                                                weight_decay=0.1), "torch")
    times = time_steps(adamw, groups, device, args.repeats)
    row["adamw"] = {"step_s": median(times), "steps_s": times, "gparam_per_s": n / median(times) / 1e9,
                    "state_bytes_per_param": state_bytes_per_param(adamw, n)}
    del adamw
    muon = Muon(muon_param_groups(layers), lr=1e-4, weight_decay=0.1, ns_device=ns_device)
    times = time_steps(muon, groups, device, args.repeats)
    row["muon"] = {"step_s": median(times), "steps_s": times, "gparam_per_s": n / median(times) / 1e9,
                   "state_bytes_per_param": state_bytes_per_param(muon, n)}
    ns_s = time_ns_only(layers, ns_device, args.repeats)
    row["ns_only"] = {"step_s": ns_s, "tflop": flops / 1e12, "tflop_per_s": flops / ns_s / 1e12,
                      "dtype": "bfloat16" if ns_device.type == "cuda" else "float32"}
    row["muon_over_adamw"] = row["muon"]["step_s"] / row["adamw"]["step_s"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "muon_step.json"), "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps(row, indent=1))
    print(f"| {args.layers} x Llama layer h={args.hidden} i={args.intermediate} kv={args.kv_dim} | {n / 1e9:.3f}B "
          f"| AdamW {row['adamw']['step_s']:.3f} s | Muon {row['muon']['step_s']:.3f} s (NS on {ns_device}: "
          f"{ns_s:.3f} s, {row['ns_only']['tflop_per_s']:.3f} TFLOP/s) | {row['muon_over_adamw']:.2f}x |")
    if registry is not None:
        del groups, layers, muon
        torch.cuda.synchronize()
        registry.release()


if __name__ == "__main__":
    main()
