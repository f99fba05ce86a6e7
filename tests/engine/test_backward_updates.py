"""Host updates during backward ([Note: updates during backward] in engine/backward_updates.py): the speculated layers'
updates are kept when the step neither clips nor is skipped and undone from snapshots when it does, so every run ends
bit for bit where the same run without them ends."""

from __future__ import annotations

import logging
from unittest import mock

import lightning as L
import pytest
import torch
from torch import nn

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import backward_updates
from lightning_megatrain.engine.optimizer_step import OptimizerStep
from lightning_megatrain.engine.step_guard import StepFailed
from lightning_megatrain.optim import host_optimizer
from lightning_megatrain.optim.host_optimizer import to_host_optimizer

from helpers.faults import Faulty, Snapshots, assert_bitwise_equal, fit, state_of


class Speculation(L.Callback):
    """How many layer updates the run speculated and how many it undid (read before the engine's teardown)."""

    megatrain_reads_state = False

    def on_train_end(self, trainer, pl_module):
        updates = trainer.strategy.engine.backward_updates
        self.speculated, self.undone = (None, None) if updates is None else (updates.speculated, updates.undone)

    def on_exception(self, trainer, pl_module, exception):
        self.on_train_end(trainer, pl_module)


@pytest.fixture
def host_keeps_up(monkeypatch):
    """Each layer's speculative update finishes before the backward goes on, as when the host keeps up with the
    GPU: what is speculated no longer depends on timing, so the tests can count it (without this fixture a layer
    still queued when the step closes the speculation is the step's, as in training)."""
    landed = backward_updates.BackwardUpdates._landed

    def keeping_up(self, speculation, index):
        landed(self, speculation, index)
        self._queue.join()

    monkeypatch.setattr(backward_updates.BackwardUpdates, "_landed", keeping_up)


def _late_grads(monkeypatch) -> None:
    """The CPU backend's grads land late ([Note: late grads]), as a CUDA drain's do: the overlapped step's worker
    then decides whether the speculation stands."""
    from lightning_megatrain.engine.transfer import HostTransfer

    monkeypatch.setattr(HostTransfer, "take_host_added", lambda self: False)


def _both(module_args: dict, steps: int, **options) -> tuple[Snapshots, Snapshots, Speculation]:
    """The same run with and without updates during backward: (with, without, what the first speculated)."""
    got, ref, speculation = Snapshots(), Snapshots(), Speculation()
    fit(Faulty(**module_args), steps, callbacks=[got, speculation], update_during_backward=True,
        overlap_optimizer=True, **options)
    fit(Faulty(**module_args), steps, callbacks=[ref], update_during_backward=False, overlap_optimizer=True, **options)
    return got, ref, speculation


N_LAYERS = 3  # llama_tied's decoder layers (helpers/families.py)


@pytest.mark.parametrize(("late", "clip", "accumulate"), [
    (False, None, 1), (True, None, 2),  # no clipping: every speculation stands
    (True, 1e3, 1), (False, 1e3, 2),  # clipping that never fires: they stand
    (False, 1e-3, 2), (True, 1e-3, 1),  # clipping that always fires: every one is undone and redone
])
def test_results_equal_the_step_without_them_bitwise(late, clip, accumulate, monkeypatch, host_keeps_up):
    if late:
        _late_grads(monkeypatch)
    steps = 4
    got, ref, speculation = _both({}, steps, clip=clip, accumulate=accumulate, cpu_adam="torch")
    for batch in ref.after_batch:
        assert_bitwise_equal(got.after_batch[batch], ref.after_batch[batch])
    assert_bitwise_equal(got.final, ref.final)
    # the first step creates the Adam states and does not speculate; every later step speculates every layer
    assert speculation.speculated == (steps - 1) * N_LAYERS
    assert speculation.undone == (speculation.speculated if clip == 1e-3 else 0)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("fault", [{"nan_grad": {2}}, {"nan_loss": {2}}])
def test_a_skipped_step_undoes_them(late, fault, monkeypatch, host_keeps_up):
    """NaN gradients (or a NaN loss) at step 2: the layers updated during its backward are restored, the step is
    skipped whole, and the run ends where the same run without them ends."""
    if late:
        _late_grads(monkeypatch)
    got, ref, speculation = _both(fault, 4, cpu_adam="torch")
    assert_bitwise_equal(got.after_batch[2], got.after_batch[1])  # skipped: as after step 1
    assert_bitwise_equal(got.final, ref.final)
    assert speculation.undone == N_LAYERS  # step 2's, whose grads are all NaN
    assert speculation.speculated == 3 * N_LAYERS


def test_deepspeed_adam(host_keeps_up):
    """DeepSpeedCPUAdam counts steps in a Python int: the snapshot restores it too (clipping fires every step)."""
    try:
        to_host_optimizer(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), "deepspeed")
    except RuntimeError as e:
        pytest.skip(f"DeepSpeedCPUAdam does not build here: {e}")
    got, ref, speculation = _both({}, 3, clip=1e-3, cpu_adam="deepspeed")
    assert_bitwise_equal(got.final, ref.final)
    assert speculation.undone == speculation.speculated == 2 * N_LAYERS


def test_the_snapshot_budget_bounds_the_speculated_layers(monkeypatch, host_keeps_up):
    """With host memory for one layer's snapshot, only the last layer (the first whose grads are final) speculates;
    the other waits for the end of backward, and results are unchanged."""
    layer = sum(p.numel() for p in Faulty().model.model.layers[0].parameters())
    monkeypatch.setattr(backward_updates, "snapshot_budget", lambda: 12 * layer)
    got, ref, speculation = _both({}, 4, cpu_adam="torch")
    assert_bitwise_equal(got.final, ref.final)
    assert speculation.speculated == 3  # one layer in each step after the first


class Scheduled(Faulty):
    """The learning rate halves after every step (the scheduler steps after the optimizer step); with
    ``lr_in_step`` the module sets the learning rate inside ``training_step`` of micro-batch 2, after the arm."""

    def __init__(self, lr_in_step: bool = False) -> None:
        super().__init__()
        self.lr_in_step = lr_in_step

    def training_step(self, batch, batch_idx):
        if self.lr_in_step and batch_idx == 2:
            self.trainer.optimizers[0].param_groups[0]["lr"] = 3e-3
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


@pytest.mark.parametrize("lr_in_step", [False, True])
def test_each_step_keeps_its_own_learning_rate(lr_in_step, monkeypatch, host_keeps_up):
    """Late grads and no callback that waits for the step: step k's speculation is decided on the overlapped worker
    while step k+1 is already armed, under a scheduler that changes the learning rate every step. Each step's layers
    are updated with its own learning rate; one set inside the closure undoes that step's speculation."""
    _late_grads(monkeypatch)
    finals, speculation = [], Speculation()
    for during in (True, False):
        trainer = fit(Scheduled(lr_in_step), 5, callbacks=[speculation] if during else [], cpu_adam="torch",
                      update_during_backward=during, overlap_optimizer=True)
        finals.append(state_of(trainer, trainer.lightning_module))
    assert_bitwise_equal(*finals)
    assert speculation.speculated == 4 * N_LAYERS
    assert speculation.undone == (N_LAYERS if lr_in_step else 0)


@pytest.mark.parametrize("late", [False, True])
def test_a_step_that_fails_to_prepare_undoes_the_kept_layers(late, monkeypatch, host_keeps_up):
    """The speculated layers stand, then the step's own preparation fails (its host RAM for a state, say): the
    step reports that it updated nothing, and nothing is updated, speculated layers included."""
    if late:
        _late_grads(monkeypatch)
    prepare, calls = host_optimizer.HostUpdate.prepare, []

    def fails_at_step_2(self, groups):
        import threading

        if threading.current_thread().name != "megatrain-backward-updates":
            calls.append(1)
            if len(calls) == 3:  # steps 0 and 1 prepared; step 2's fails
                raise RuntimeError("out of host RAM")
        prepare(self, groups)

    monkeypatch.setattr(host_optimizer.HostUpdate, "prepare", fails_at_step_2)
    got, speculation = Snapshots(), Speculation()
    # raised by the step, or by the overlapped worker's, wrapped
    with pytest.raises((StepFailed, RuntimeError), match=r"optimizer step 2 failed before updating anything"):
        fit(Faulty(), 4, callbacks=[got, speculation], cpu_adam="torch", update_during_backward=True,
            overlap_optimizer=True)
    assert_bitwise_equal(got.at_exception, got.after_batch[1])
    assert speculation.undone == N_LAYERS


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_with_training_timing_the_results_are_the_same(clip, monkeypatch):
    """No fixture: the speculation is closed while layers may still be queued or updating (those queued are the
    step's), as in training; results are bitwise the same either way."""
    _late_grads(monkeypatch)
    got, ref, speculation = _both({}, 5, clip=clip, accumulate=2, cpu_adam="torch")
    assert_bitwise_equal(got.final, ref.final)
    assert speculation.speculated <= 4 * N_LAYERS
    assert speculation.undone == (speculation.speculated if clip else 0)


def test_hooks_that_read_parameters_after_backward_stop_them(caplog):
    """An ``on_after_backward`` would see updated parameters: nothing is speculated, and the log says why."""

    class Reads(Faulty):
        def on_after_backward(self):
            self.seen = float(next(self.parameters()).sum())

    speculation = Speculation()
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        fit(Reads(), 3, callbacks=[speculation], update_during_backward=True, cpu_adam="torch")
    assert speculation.speculated == 0
    assert any("no host updates during backward: Reads.on_after_backward" in r.getMessage() for r in caplog.records)


def test_auto_skips_the_step_after_one_that_clipped():
    """``"auto"`` speculates unless the last step's clipping fired; ``True`` speculates anyway."""
    params = [nn.Parameter(torch.zeros(2))]
    optimizer = to_host_optimizer(torch.optim.AdamW(params), "torch")
    for mode, clipped_last, armed in (("auto", False, True), ("auto", True, False), (True, True, True)):
        updates = mock.Mock(clipped_last=clipped_last)
        config = EngineConfig(update_during_backward=mode, overlap_optimizer=True)
        step = OptimizerStep(config, torch.device("cpu"), [], None, None, None, updates)
        step.arm_backward_updates(optimizer, [])
        assert updates.arm.called == armed, (mode, clipped_last)
        updates.arm.reset_mock()
        step.arm_backward_updates(torch.optim.SGD(params, lr=0.1), [])  # not the host Adam: never
        assert not updates.arm.called


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"update_during_backward=True with overlap_optimizer=False"):
        EngineConfig(update_during_backward=True, overlap_optimizer=False)
    with pytest.raises(ValueError, match=r"update_during_backward='yes': need 'auto', True or False"):
        EngineConfig(update_during_backward="yes")
