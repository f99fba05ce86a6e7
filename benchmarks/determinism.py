"""Are repeated CUDA runs bitwise equal, and is a resumed run the uninterrupted one? One tiny Llama fitted several
times per engine configuration (``tests/helpers/resume.py``, as the GPU exact-resume test: bf16-mixed, clipping,
SDPA's math backend), printing per configuration whether every run's losses and weights equal the first run's, and
(``--resume``) whether a run resumed from the step-2 checkpoint ends with the first run's losses and weights.
``--fresh`` clears dynamo's compiled graphs before each fit, as a new process would start.

Run on the GPU machine: ``python benchmarks/determinism.py --runs 3 --configs defaults,no_bwd --fresh --resume``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from lightning_megatrain import MegaTrainStrategy  # noqa: E402

from helpers.resume import fit_tiny_llama  # noqa: E402

# name -> MegaTrainStrategy options (the rest are the defaults)
CONFIGS = {
    "defaults": {},
    "no_bwd": dict(update_during_backward=False),
    "no_overlap": dict(overlap_optimizer=False),
    "no_compile": dict(compile_layers=False),
    "no_groups": dict(gpu_optimizer_groups=0),
    "no_groups_no_bwd": dict(gpu_optimizer_groups=0, update_during_backward=False),
    "plain": dict(compile_layers=False, overlap_optimizer=False, gpu_optimizer_groups=0),
}


def compare(runs: list[tuple[dict, dict]]) -> dict:
    """Whether runs[1:] have runs[0]'s losses (at the steps both ran) and weights, bitwise."""
    (losses, weights), rest = runs[0], runs[1:]
    first_bad = min((k for lo, _ in rest for k in lo if lo[k] != losses.get(k)), default=None)
    max_diff = max((float((w[n] - weights[n]).abs().max()) for _, w in rest for n in weights), default=0.0)
    return dict(equal=first_bad is None and max_diff == 0.0, first_differing_step=first_bad, max_weight_diff=max_diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--fresh", action="store_true", help="clear dynamo's graphs before each fit")
    parser.add_argument("--resume", action="store_true", help="also resume from the first run's step-2 checkpoint")
    parser.add_argument("--out", default=None, help="folder for determinism.json")
    args = parser.parse_args()
    rows = []
    with sdpa_kernel(SDPBackend.MATH), tempfile.TemporaryDirectory() as root:
        for name in args.configs.split(","):
            dirs = [os.path.join(root, f"{name}-{k}") for k in range(args.runs)]
            strategy = functools.partial(MegaTrainStrategy, **CONFIGS[name])
            runs = [fit_tiny_llama(d, strategy, args.steps, fresh=args.fresh) for d in dirs]
            row = dict(config=name, options=CONFIGS[name], runs=args.runs, fresh=args.fresh, **compare(runs))
            if args.resume:
                resumed = fit_tiny_llama(dirs[0] + "-resumed", strategy, args.steps,
                                         os.path.join(dirs[0], "step2.ckpt"), fresh=args.fresh)
                row["resumed"] = compare([runs[0], resumed])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "determinism.json"), "w") as f:
            json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
