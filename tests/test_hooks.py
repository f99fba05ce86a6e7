"""User hooks under the overlapped optimizer step (hooks.py, [Note: user hooks]): safe by default, waits only if needed.

An EMA callback reads every parameter in ``on_train_batch_end`` while that batch's overlapped host step may still be
updating them on its worker thread. The barrier waits for the step first, so the EMA equals plain Lightning's;
without that wait it reads the parameters before the update. Which thread runs first depends on scheduling, so
``_record_steps(hold=True)`` forces the worst interleaving on purpose: each step's update starts only once some
reader waits for it (``OverlappedStep.wait`` or ``wait_all``), which is all the engine's contract promises.
"""

from __future__ import annotations

import logging
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.callbacks import ThroughputLogger
from lightning_megatrain.engine.overlap import OverlappedStep
from lightning_megatrain.hooks import (
    PARAMETER_HOOKS,
    OptimizerBarrier,
    backward_update_blockers,
    grads_read_by_hooks,
    parameter_readers,
)

from helpers.parity import ParityLM, run

FAMILY = "llama_tied"
STEPS = 4
DECAY = 0.9
# EMA against plain Lightning, elementwise: the same fp32 forward and the same torch fused AdamW kernel on both sides
# (bitwise equal on the 2-core CPU this was written on); 1e-5 is the parity suite's bound for a different summation
# order (tests/parity.py), atol only for entries near zero. Without the wait the EMA is off by ~0.36 (norm-wise).
RTOL, ATOL = 1e-5, 1e-7


class EMA(L.Callback):
    """Exponential moving average of every parameter, updated in ``on_train_batch_end`` (decay 0.9)."""

    def __init__(self, events: list[str] | None = None) -> None:
        self.ema: dict[str, torch.Tensor] = {}
        self.events = events  # "ema" appended at each read, for the order checks

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.events is not None:
            self.events.append("ema")
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if name not in self.ema:
                    self.ema[name] = p.detach().clone()
                else:
                    self.ema[name].mul_(DECAY).add_(p.detach(), alpha=1 - DECAY)


def _megatrain() -> MegaTrainStrategy:
    # overlap explicit: "auto" turns it off on a CPU compute device (engine/placement.py)
    return MegaTrainStrategy(cpu_adam="torch", overlap_optimizer=True)


def _ema_run(strategy, events: list[str] | None = None) -> dict[str, torch.Tensor]:
    ema = EMA(events)
    run(strategy, FAMILY, steps=STEPS, optimizer="adamw_fused", callbacks=[ema], record_grads=False)
    assert ema.ema, "the EMA callback never ran"
    return ema.ema


@pytest.fixture(scope="module")
def reference_ema() -> dict[str, torch.Tensor]:
    """The EMA under plain Lightning (``strategy="auto"``) with torch ``AdamW(fused=True)``."""
    return _ema_run("auto")


def _assert_ema_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _max_rel_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)


def _record_steps(monkeypatch, events: list[str], hold: bool) -> None:
    """Append "launch" when an overlapped step starts and "wait" when a reader waits for all of it; with ``hold``,
    each launched update runs only once a reader waits for it (``wait`` of any group or ``wait_all``)."""
    launch, wait, wait_all = OverlappedStep.launch, OverlappedStep.wait, OverlappedStep.wait_all

    def held_launch(self, make_update):
        gate = threading.Event()

        def make_held():
            update = make_update()

            def held(params):
                # a safety net only: every step is waited for (next forward, zero_grad, train end) within seconds
                gate.wait(timeout=60)
                update(params)

            return held

        launch(self, make_held if hold else make_update)
        self.test_gate = gate  # after launch: its own wait_all opened the previous step's gate only
        events.append("launch")

    def opening(original, record: bool):
        def waiting(self, *args):
            if hasattr(self, "test_gate"):
                self.test_gate.set()
            if record and self._thread is not None:  # a step in flight (wait_all joins and clears it)
                events.append("wait")
            return original(self, *args)

        return waiting

    monkeypatch.setattr(OverlappedStep, "launch", held_launch)
    monkeypatch.setattr(OverlappedStep, "wait", opening(wait, record=False))
    monkeypatch.setattr(OverlappedStep, "wait_all", opening(wait_all, record=True))


def _assert_each_read_after_its_step(events: list[str]) -> None:
    """Every "ema" comes after a "launch" whose step was waited for in full before it."""
    assert events.count("ema") == STEPS and events.count("launch") == STEPS, events
    for i, event in enumerate(events):
        if event == "ema":
            last_launch = max(j for j in range(i) if events[j] == "launch")
            assert "wait" in events[last_launch:i], f"EMA read #{events[:i].count('ema')} mid-step: {events}"


# - safe by default: the barrier waits before the EMA's on_train_batch_end


def test_ema_callback_matches_plain_lightning_under_the_overlapped_step(reference_ema, monkeypatch, caplog):
    events: list[str] = []
    _record_steps(monkeypatch, events, hold=False)
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        got = _ema_run(_megatrain(), events)
    _assert_ema_close(got, reference_ema)
    _assert_each_read_after_its_step(events)
    (line,) = [r.getMessage() for r in caplog.records if "the optimizer step finishes before" in r.getMessage()]
    assert "on_train_batch_end (" in line and "EMA" in line


def test_ema_callback_matches_plain_lightning_when_the_step_is_held(reference_ema, monkeypatch):
    # the worst interleaving: the update runs only once a reader waits; the barrier is that reader
    events: list[str] = []
    _record_steps(monkeypatch, events, hold=True)
    got = _ema_run(_megatrain(), events)
    _assert_ema_close(got, reference_ema)
    _assert_each_read_after_its_step(events)


def test_without_the_barrier_the_ema_reads_parameters_mid_step(reference_ema, monkeypatch):
    # proves the two tests above can fail: with the barrier's wait gone the EMA reads every step's parameters before
    # its update (the next forward and zero_grad still wait, so training itself is unchanged)
    events: list[str] = []
    _record_steps(monkeypatch, events, hold=True)
    monkeypatch.setattr(OptimizerBarrier, "_wait_before", lambda self, hook, trainer: None)
    got = _ema_run(_megatrain(), events)
    assert _max_rel_diff(got, reference_ema) > 100 * RTOL
    with pytest.raises(AssertionError, match="mid-step"):
        _assert_each_read_after_its_step(events)


def test_no_wait_per_batch_with_only_the_throughput_logger_and_the_progress_bar(monkeypatch, caplog):
    events: list[str] = []
    _record_steps(monkeypatch, events, hold=False)

    class BatchEnds(L.Callback):
        megatrain_reads_state = False  # a spy that reads nothing

        def on_train_batch_end(self, *args) -> None:
            events.append("batch_end")

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=_megatrain(),
        max_steps=STEPS,
        callbacks=[ThroughputLogger(window=2), BatchEnds()],
        enable_progress_bar=True,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    assert any(isinstance(c, ProgressBar) for c in trainer.callbacks)  # Rich's where rich is installed, else TQDM's
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        trainer.fit(ParityLM(FAMILY, optimizer="adamw_fused"))
    (barrier,) = [c for c in trainer.callbacks if isinstance(c, OptimizerBarrier)]
    assert barrier.wait_before == frozenset()
    assert not any("the optimizer step finishes before" in r.getMessage() for r in caplog.records)
    # no reader waits between a step's launch and its batch end: the next backward waits for it instead
    assert events.count("batch_end") == STEPS, events
    for i, event in enumerate(events):
        if event == "batch_end":
            assert events[i - 1] == "launch", events


# - which hooks count


class _Module(ParityLM):
    def __init__(self) -> None:
        super().__init__(FAMILY)


class _ModuleReadsAfterStep(_Module):
    def on_before_zero_grad(self, optimizer) -> None:
        pass


class _ModuleReadsGrads(_Module):
    def on_before_optimizer_step(self, optimizer) -> None:
        pass


class _ModuleClipsItself(_Module):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        pass


class _EMA(L.Callback):
    def on_train_batch_end(self, *args) -> None:
        pass


class _GradNorms(L.Callback):
    def on_before_optimizer_step(self, *args) -> None:
        pass

    def on_after_backward(self, *args) -> None:
        pass


class _OptedOut(_GradNorms):
    megatrain_reads_state = False

    def on_train_batch_end(self, *args) -> None:
        pass


def _builtin_callbacks() -> list[L.Callback]:
    return [TQDMProgressBar(), ModelSummary(), LearningRateMonitor(), Timer(), EarlyStopping("loss"), ModelCheckpoint()]


def _attached(module: L.LightningModule, callbacks: list[L.Callback]) -> L.LightningModule:
    module.trainer = L.Trainer(callbacks=callbacks, logger=False)  # adds a progress bar, summary, checkpointing
    return module


def test_builtin_callbacks_override_the_hooks_they_are_ignored_in():
    # what makes the two tests below meaningful: Lightning's own callbacks do implement some of these hooks
    overriding = {type(c).__name__ for c in _builtin_callbacks() if any(is_overridden(h, c) for h in PARAMETER_HOOKS)}
    assert {"TQDMProgressBar", "LearningRateMonitor", "Timer", "ModelCheckpoint"} <= overriding


def test_parameter_readers():
    assert parameter_readers(_attached(_Module(), [])) == {}
    assert parameter_readers(_attached(_Module(), _builtin_callbacks())) == {}
    assert parameter_readers(_attached(_Module(), [ThroughputLogger(), _OptedOut()])) == {}
    readers = parameter_readers(_attached(_ModuleReadsAfterStep(), []))
    assert readers == {"on_before_zero_grad": ["_ModuleReadsAfterStep"]}
    assert parameter_readers(_attached(_Module(), [_EMA(), *_builtin_callbacks()])) == {"on_train_batch_end": ["_EMA"]}
    # several owners per hook, the module first, hooks in the order Lightning runs them
    readers = parameter_readers(_attached(_ModuleReadsGrads(), [_GradNorms(), _OptedOut(), _EMA()]))
    assert readers == {
        "on_train_batch_end": ["_EMA"],
        "on_after_backward": ["_GradNorms"],
        "on_before_optimizer_step": ["_ModuleReadsGrads", "_GradNorms"],
    }
    assert list(readers) == [h for h in PARAMETER_HOOKS if h in readers]


def test_grads_read_by_hooks():
    assert not grads_read_by_hooks(_attached(_Module(), [_EMA(), *_builtin_callbacks()]))
    assert not grads_read_by_hooks(_attached(_Module(), [_OptedOut()]))  # overrides on_before_optimizer_step, opted out
    assert grads_read_by_hooks(_attached(_Module(), [_GradNorms()]))
    assert grads_read_by_hooks(_attached(_ModuleReadsGrads(), []))
    assert grads_read_by_hooks(_attached(_ModuleClipsItself(), []))


def test_backward_update_blockers():
    """What stops the host updates during backward ([Note: updates during backward]): code that may read grads or
    parameters between backward and the step, manual optimization, value clipping, other than one optimizer."""

    def blockers(module, callbacks, optimizers=1, **trainer):
        module.trainer = L.Trainer(callbacks=callbacks, logger=False, **trainer)
        module.trainer.strategy.optimizers = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])] * optimizers
        return backward_update_blockers(module)

    assert blockers(_Module(), [_EMA(), _OptedOut(), ThroughputLogger(), *_builtin_callbacks()]) == []
    assert blockers(_Module(), [_GradNorms()])[0] == "_GradNorms.on_after_backward"
    assert "a hook that reads grads" in blockers(_ModuleReadsGrads(), [])[0]
    assert blockers(_Module(), [], gradient_clip_val=1.0, gradient_clip_algorithm="value") == [
        "gradient_clip_algorithm='value'"]
    assert blockers(_Module(), [], gradient_clip_val=1.0) == []  # norm clipping: speculated on
    assert blockers(_Module(), [], optimizers=2) == ["2 optimizers"]
    manual = _Module()
    manual.automatic_optimization = False
    assert blockers(manual, []) == ["manual optimization"]


def test_validation_between_steps_waits_for_a_late_host_step(monkeypatch):
    # Lightning sets every p.grad to None before validation (on_validation_model_zero_grad), before any hook the
    # barrier waits in, while the overlapped host step's worker reads p.grad only once the last grads have landed
    # ([Note: late grads]). Landing is slowed down here; the module's zero_grad must wait for the step, or the
    # parameters whose grads were cleared skip their update.
    import time

    from torch.utils.data import DataLoader

    from lightning_megatrain.engine.optimizer_step import OptimizerStep
    from lightning_megatrain.engine.transfer import HostTransfer

    from helpers.parity import make_data

    land = OptimizerStep._land_grads

    def slow_landing(self):
        time.sleep(0.2)
        land(self)

    monkeypatch.setattr(OptimizerStep, "_land_grads", slow_landing)
    # the CPU backend adds every drain on the host, which makes grads land at once; a CUDA drain that wrote the
    # fp32 grads from the device does not: take that path here
    monkeypatch.setattr(HostTransfer, "take_host_added", lambda self: False)

    class WithValidation(ParityLM):
        def validation_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def val_dataloader(self):
            return DataLoader(make_data()[:2], batch_size=2)

    def fit(strategy):
        L.seed_everything(0, verbose=False)
        module = WithValidation(FAMILY, optimizer="adamw_fused")
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, val_check_interval=1,
                            limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module)
        return {name: p.detach().clone() for name, p in module.named_parameters()}

    ref = fit("auto")
    got = fit(MegaTrainStrategy(cpu_adam="torch", overlap_optimizer=True))
    for name, value in got.items():  # the same fused AdamW kernel and fp32 forward: as the EMA test's bound
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-7, msg=name)
