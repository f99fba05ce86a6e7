"""CUDA: host updates during backward ([Note: updates during backward] in engine/backward_updates.py) with the CUDA
drain's landed hook, late grads and device groups, against the same run without them.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.faults import Faulty, Snapshots, fit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N_LAYERS = 3  # llama_tied's decoder layers (helpers/families.py)


class Speculation(Snapshots):
    """The states after each step, and how many layer updates the run speculated and undid."""

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        updates = trainer.strategy.engine.backward_updates
        self.speculated, self.undone = updates.speculated, updates.undone


def _close(a: dict, b: dict) -> None:
    """Equal up to the GPU's run-to-run rounding (a wrong speculation differs by whole updates)."""
    for kind in ("params", "states"):
        assert a[kind].keys() == b[kind].keys()
    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], rtol=1e-5, atol=1e-7, msg=name)
    for name, state in a["states"].items():
        for key, value in state.items():
            other = b["states"][name][key]
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(value, other, rtol=1e-5, atol=1e-7, msg=f"{name} {key}")
            else:
                assert value == other, (name, key)


@pytest.mark.parametrize(("clip", "groups", "accumulate"), [(None, 0, 2), (1e3, 2, 1), (1e-3, 0, 1), (1e-3, 2, 2)])
def test_cuda_updates_during_backward_match_the_step_without_them(clip, groups, accumulate):
    torch.backends.cuda.matmul.allow_tf32 = False
    options = dict(cpu_adam="torch", overlap_optimizer=True, compile_layers=False, gpu_optimizer_groups=groups)
    got, ref = Speculation(), Snapshots()
    fit(Faulty(), 4, accumulate=accumulate, clip=clip, callbacks=[got], accelerator="cuda",
        update_during_backward=True, **options)
    fit(Faulty(), 4, accumulate=accumulate, clip=clip, callbacks=[ref], accelerator="cuda",
        update_during_backward=False, **options)
    for batch in ref.after_batch:
        _close(got.after_batch[batch], ref.after_batch[batch])
    _close(got.final, ref.final)
    host_layers = N_LAYERS - max(groups - 1, 0)  # the first device group is the residents'
    assert got.speculated == 3 * host_layers  # every host layer of every step after the first
    assert got.undone == (got.speculated if clip == 1e-3 else 0)


def test_cuda_a_skipped_step_undoes_them():
    torch.backends.cuda.matmul.allow_tf32 = False
    options = dict(cpu_adam="torch", overlap_optimizer=True, compile_layers=False, gpu_optimizer_groups=0)
    got = Speculation()
    fit(Faulty(nan_grad={2}), 4, callbacks=[got], accelerator="cuda", update_during_backward=True, **options)
    _close(got.after_batch[2], got.after_batch[1])  # step 2 skipped whole
    assert got.undone == N_LAYERS
