"""CUDA: exact resume. A run resumed mid-epoch from a checkpoint gives bitwise the losses and weights of the
uninterrupted run, in bf16-mixed with clipping, with every engine choice left to the engine (compiled layers, the
overlapped host step and its default host Adam, updates during backward, ``keep_layers`` and
``gpu_optimizer_groups``), with eager layers, and with DeepSpeedCPUAdam asked for by name.

SDPA runs its math backend here: the fused attention backwards may add in a varying order, and then two
uninterrupted runs would differ as well. Skipped without CUDA (CI); run on the GPU machine with
``python -m pytest -m gpu tests/strategy/test_gpu_exact_resume.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_megatrain import MegaTrainStrategy

from helpers.resume import fit_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 5  # epochs of 3 batches: step 2 is mid-epoch


def _fit(root, strategy, ckpt_path=None):
    return fit_tiny_llama(root, strategy, STEPS, ckpt_path)


@pytest.mark.parametrize("strategy", [lambda: MegaTrainStrategy(compile_layers=False),
                                      lambda: MegaTrainStrategy(compile_layers=False, cpu_adam="deepspeed")],
                         ids=["eager", "deepspeed"])
def test_resume_mid_epoch_is_bitwise_the_uninterrupted_run(tmp_path, strategy):
    with sdpa_kernel(SDPBackend.MATH):
        losses, weights = _fit(tmp_path / "a", strategy)
        again_losses, again_weights = _fit(tmp_path / "b", strategy)
        # the bar below needs deterministic kernels: two uninterrupted runs must agree first
        assert again_losses == losses
        assert all(torch.equal(again_weights[n], w) for n, w in weights.items())
        resumed_losses, resumed_weights = _fit(tmp_path / "c", strategy, ckpt_path=tmp_path / "a" / "step2.ckpt")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert resumed_losses == {k: v for k, v in losses.items() if k > 2}
    for name, w in weights.items():
        assert torch.equal(resumed_weights[name], w), name


def test_compiled_layers_resume_bitwise(tmp_path):
    # compiled layers mark their batch and sequence dims dynamic from the first call, so one graph serves every
    # shape whatever the process saw before: a resumed run (its first batch has another shape) runs the same kernels
    with sdpa_kernel(SDPBackend.MATH):
        losses, weights = _fit(tmp_path / "a", lambda: "megatrain")
        again_losses, again_weights = _fit(tmp_path / "b", lambda: "megatrain")
        assert again_losses == losses
        assert all(torch.equal(again_weights[n], w) for n, w in weights.items())
        resumed_losses, resumed_weights = _fit(tmp_path / "c", lambda: "megatrain",
                                               ckpt_path=tmp_path / "a" / "step2.ckpt")
    assert resumed_losses == {k: v for k, v in losses.items() if k > 2}
    worst = max(float((resumed_weights[n] - w).abs().max()) for n, w in weights.items())
    assert worst == 0.0, worst
