"""Placement: the engine's ``"auto"`` options resolved into concrete choices, each logged with its reason.

[Note: auto placement]
``MegaTrainStrategy()`` with no arguments should train as fast as a hand-tuned run. Each ``"auto"`` option is
decided once, at setup, from what the engine can see there (the compute device and what it can build), and the log
gets one line per decision saying what was chosen and why; an explicit value is used as given:

- ``compile_layers``: on for a CUDA compute device where Triton is usable. Compiled Llama layers fuse the
  elementwise work between the matmuls and keep 31% fewer activation bytes ([Note: compiled layers]); on the H200
  they made plain GPU training of the 3B shape 1.29x faster (docs/planner.md). Off on a CPU compute device, where inductor's C++ build
  costs more than it saves for the small models one trains there, and where Triton is missing.
- ``overlap_optimizer``: on for a CUDA compute device. The host Adam step otherwise idles the GPU for its whole
  length (0.73 s for 3.2B parameters on 16 cores, longer than a 32K-token forward). What made it opt-in, hooks
  reading parameters mid-update, the strategy now covers: it waits for the step before any user hook that runs
  between the step and the next forward (the strategy's ``_OptimizerBarrier``). Off on a CPU compute device, where
  the step and the forward would share the same cores.

``keep_layers="auto"`` is decided later, from the first micro-batches' measured memory ([Note: keep or recompute]).
"""

from __future__ import annotations

import logging

import torch

from lightning_megatrain.config import EngineConfig

log = logging.getLogger(__name__)


def _triton_usable() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def resolve(config: EngineConfig, device: torch.device) -> EngineConfig:
    """``config`` with every ``"auto"`` decided for ``device`` (see [Note: auto placement]); logs each decision."""
    changes: dict[str, object] = {}
    on_cuda = device.type == "cuda"
    if config.compile_layers == "auto":
        triton = on_cuda and _triton_usable()
        changes["compile_layers"] = triton
        reason = (
            "CUDA with Triton: fused elementwise kernels, fewer saved activations; the first step compiles each "
            "layer class"
            if triton
            else "Triton is not usable here" if on_cuda else "CPU compute device"
        )
        log.info("MegaTrain: compile_layers=%s (auto: %s)", triton, reason)
    if config.overlap_optimizer == "auto":
        changes["overlap_optimizer"] = on_cuda
        reason = (
            "the host Adam step runs beside the next forward instead of idling the GPU; hooks that read parameters "
            "wait for it"
            if on_cuda
            else "CPU compute device: the step and the forward would share its cores"
        )
        log.info("MegaTrain: overlap_optimizer=%s (auto: %s)", on_cuda, reason)
    return config.replace(**changes) if changes else config
