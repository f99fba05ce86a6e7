"""CUDA: all-or-nothing steps (engine/optimizer_step.py, [Note: all-or-nothing steps]) where the finite decision is
taken on the device: grads landing late, the device groups' fused AdamW reading the flag as ``found_inf``, the host
step's worker reading it from the pinned copy.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightning_megatrain.engine.optimizer_step import OptimizerStep
from lightning_megatrain.engine.step_guard import NonFiniteError

from helpers.faults import Faulty, Snapshots, assert_bitwise_equal, fit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTIONS = dict(accelerator="cuda", cpu_adam="torch", overlap_optimizer=True, compile_layers=False)


class ReadsGrads(Snapshots):
    """Snapshots, with a hook that may read ``p.grad`` before the step: grads land, the training thread decides."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


@pytest.mark.parametrize(("groups", "late"), [(0, True), (2, True), (2, False)])
def test_cuda_nonfinite_step_skipped(groups, late):
    """A NaN loss at micro-batch 1, clipping on: step 1 updates nothing (parameters, moments and step counts bit for
    bit as after step 0), and the run ends where a run without that batch ends. Late grads: the device groups' kernel
    and the host worker skip it; else the training thread skips the device groups' step too (and drops the residents'
    device grads it would have consumed)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    got, ref = (Snapshots(), Snapshots()) if late else (ReadsGrads(), ReadsGrads())
    landed = mock.patch.object(OptimizerStep, "_landed_update", autospec=True, side_effect=OptimizerStep._landed_update)
    with landed as spy:
        trainer = fit(Faulty(nan_loss={1}), 4, clip=1.0, callbacks=[got], gpu_optimizer_groups=groups, **OPTIONS)
    assert spy.call_count == (4 if late else 0)  # where each step's decision was read
    assert trainer.strategy.skipped_steps == 1
    assert_bitwise_equal(got.after_batch[1], got.after_batch[0])
    fit(Faulty(drop={1}), 3, clip=1.0, callbacks=[ref], gpu_optimizer_groups=groups, **OPTIONS)
    for name, p in got.final["params"].items():
        torch.testing.assert_close(p, ref.final["params"][name], rtol=1e-6, atol=1e-8, msg=name)


def test_cuda_nonfinite_raise_with_device_groups_updates_nothing():
    got = Snapshots()
    with pytest.raises(RuntimeError, match=r"optimizer step 1 has a non-finite gradient norm nan, loss nan") as info:
        fit(Faulty(nan_loss={1}), 3, callbacks=[got], gpu_optimizer_groups=2, nonfinite="raise", **OPTIONS)
    assert isinstance(info.value.__cause__, NonFiniteError)
    assert_bitwise_equal(got.at_exception, got.after_batch[0])
