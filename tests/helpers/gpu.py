"""The CUDA tests' shared pieces: a strategy with one mechanism at a time, and ``parity.run`` on the GPU."""

from __future__ import annotations

import torch

from lightning_megatrain import MegaTrainStrategy

from helpers.parity import run


def gpu_strategy(**options) -> MegaTrainStrategy:
    """One mechanism at a time: the "auto" choices (compiled layers, overlapped step, device groups, attention memo)
    off unless a test names them; ``test_cuda_defaults_parity`` (tests/test_gpu_defaults.py) runs the defaults."""
    off = {"compile_layers": False, "overlap_optimizer": False, "gpu_optimizer_groups": 0, "attention_memo": False}
    return MegaTrainStrategy(**{**off, **options})


def fit_cuda(strategy, module_factory, **kwargs):
    """``parity.run`` on the GPU: the record and the peak allocated GPU memory."""
    torch.cuda.reset_peak_memory_stats()
    record = run(strategy, None, accelerator="cuda", module=module_factory, **kwargs)
    return record, torch.cuda.max_memory_allocated()
