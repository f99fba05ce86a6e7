"""The optimizer step on CPU: its contract with device groups (stand-ins: the real ones need CUDA), and steps that
are all or nothing: non-finite steps skipped or refused, failed updates that leave no trace."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import lightning as L
import pytest
import torch
from torch import nn

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import MegaTrainEngine
from lightning_megatrain.engine.optimizer_step import OptimizerStep
from lightning_megatrain.engine.step_guard import NonFiniteError, StepFailed
from lightning_megatrain.optim import host_optimizer
from lightning_megatrain.optim.host_optimizer import to_host_optimizer

from helpers.faults import Faulty, Snapshots, assert_bitwise_equal, fit, state_of


def _step(device_groups: list, **config) -> OptimizerStep:
    # transfer and residents are not reached by what these tests call
    step = OptimizerStep(EngineConfig(**config), torch.device("cpu"), [], None, None, None)
    step.set_device_groups(device_groups)
    return step


def _device_group() -> SimpleNamespace:
    return SimpleNamespace(group=SimpleNamespace(params=[]), clear_grads=mock.Mock())


def test_device_groups_take_adam_only_and_hook_zero_grad():
    params = [nn.Parameter(torch.zeros(2))]
    step = _step([_device_group()], gpu_optimizer_groups=1, cpu_adam="torch")
    assert step.steps_after_return  # device groups write their masters back when the host reads them
    with pytest.raises(ValueError, match=r"gpu_optimizer_groups=1\) steps Adam/AdamW on the GPU, got SGD"):
        step.to_host_optimizers([torch.optim.SGD(params, lr=0.1)], [])

    adamw = torch.optim.AdamW(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda epoch: 1.0)
    (host,) = step.to_host_optimizers([adamw], [scheduler])
    assert all(group["fused"] for group in host.param_groups)  # cpu_adam="torch": torch's fused AdamW
    assert scheduler.optimizer is host and step.takes_step(host)
    host.zero_grad()  # hooked: waits for the host step in flight, then restarts the device groups' grad sums
    step.device_groups[0].clear_grads.assert_called_once_with()


def test_host_fallbacks_refused_with_device_groups():
    with pytest.raises(RuntimeError, match=r"gpu_optimizer_groups=1\) does not support gradient_clip_algorithm"):
        _step([_device_group()], gpu_optimizer_groups=1).refuse_host_fallback("gradient_clip_algorithm='value'")
    _step([]).refuse_host_fallback("gradient_clip_algorithm='value'")  # nothing on the GPU: torch's paths apply


def test_without_overlap_or_device_groups_the_step_runs_at_once():
    params = [nn.Parameter(torch.zeros(2))]
    step = _step([], cpu_adam="torch")
    (host,) = step.to_host_optimizers([torch.optim.AdamW(params, lr=0.1)], [])
    # the engine takes the host Adam's step (all or nothing), synchronously; other optimizers step as given
    assert not step.steps_after_return and step.takes_step(host)
    assert not step.takes_step(torch.optim.SGD(params, lr=0.1))
    assert "zero_grad" not in vars(host)  # not hooked: nothing runs after the step returned


def test_clipping_before_the_step_finalizes_once_and_the_step_keeps_its_factor():
    # Manual optimization clips between manual_backward and optimizer.step(): clipping lands the grads first (the
    # layers' drains, the residents'), and the step's own finalization then changes nothing: no second drain (a
    # device group's resident grads would reach the host twice) and the deferred factor kept for the update.
    residents = mock.Mock(norm_after_landing=False)
    transfer = SimpleNamespace(take_host_added=lambda: False, wait_drained=mock.Mock())
    step = OptimizerStep(EngineConfig(), torch.device("cpu"), [], SimpleNamespace(wait_all=mock.Mock()), transfer,
                         residents)
    step._host_norm_sq = lambda: torch.tensor(4.0)  # norm 2 against max_norm 1: the clip fires
    for backward in range(2):
        step.backward_starts()
        assert step.clip_grad_norm_([], 1.0, defer=True)
        assert residents.drain.call_args_list == [mock.call(wait=True)] * (backward + 1)
        assert transfer.wait_drained.call_count == backward + 1  # landed before the norm was read
        step.finalize_gradients(grads_read=True)  # optimizer.step()'s, after the clip
        assert residents.drain.call_count == backward + 1 and transfer.wait_drained.call_count == backward + 1
        torch.testing.assert_close(step._deferred_grad_scale, torch.tensor(1.0 / (2.0 + 1e-6)))


def test_engine_step_exists_between_setup_and_teardown():
    engine = MegaTrainEngine(nn.Linear(1, 1), torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match=r"MegaTrainEngine.step exists between setup\(\) and teardown\(\)"):
        engine.step
    engine.wait_for_optimizer()  # a no-op before setup


# - all-or-nothing steps ([Note: all-or-nothing steps]): non-finite steps skipped, failed updates leave no trace


def _host_adam(cpu_adam: str) -> str:
    if cpu_adam == "deepspeed":
        try:
            to_host_optimizer(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), "deepspeed")
        except RuntimeError as e:
            pytest.skip(f"DeepSpeedCPUAdam does not build here: {e}")
    return cpu_adam


def _late_grads(monkeypatch) -> None:
    """Make the CPU backend's grads land late ([Note: late grads]), as a CUDA drain's do: the overlapped step's
    worker, not the training thread, then reads the step's finite flag."""
    from lightning_megatrain.engine.transfer import HostTransfer

    monkeypatch.setattr(HostTransfer, "take_host_added", lambda self: False)


@pytest.mark.parametrize("cpu_adam", ["torch", "deepspeed"])
@pytest.mark.parametrize(("overlap", "late"), [(False, False), (True, False), (True, True)])
def test_nonfinite_step_is_skipped_as_if_its_batch_were_not_there(overlap, late, cpu_adam, caplog, monkeypatch):
    """A NaN loss at micro-batch 1: that step updates nothing (masters, moments and step counts bit for bit as after
    step 0), it is logged and counted, and the run then ends exactly where a run without that batch ends; the
    decision is read on the training thread, or on the overlapped step's worker when grads land late."""
    if late:
        _late_grads(monkeypatch)
    options = dict(overlap_optimizer=overlap, cpu_adam=_host_adam(cpu_adam))
    got = Snapshots()
    with caplog.at_level("WARNING", logger="lightning_megatrain"):
        trainer = fit(Faulty(nan_loss={1}), 4, callbacks=[got], **options)
    assert_bitwise_equal(got.after_batch[1], got.after_batch[0])
    assert trainer.strategy.skipped_steps == 1 and trainer.global_step == 4
    assert trainer.callback_metrics["skipped_steps"] == 1.0  # on the progress bar and to loggers
    (message,) = [r.getMessage() for r in caplog.records if "skipped optimizer step" in r.getMessage()]
    assert "skipped optimizer step 1: non-finite gradient norm nan, loss nan" in message

    ref = Snapshots()
    fit(Faulty(drop={1}), 3, callbacks=[ref], **options)
    assert_bitwise_equal(got.final, ref.final)


@pytest.mark.parametrize("overlap", [False, True])
def test_nonfinite_gradient_in_one_micro_batch_skips_its_step(overlap):
    """Finite losses, NaN gradients in the second micro-batch of step 1 (of 2 accumulated), clipping on: step 1 is
    skipped whole, and the run ends where one without step 1's two micro-batches ends."""
    options = dict(overlap_optimizer=overlap, cpu_adam="torch")
    got, ref = Snapshots(), Snapshots()
    trainer = fit(Faulty(nan_grad={3}), 3, accumulate=2, clip=1.0, callbacks=[got], **options)
    assert trainer.strategy.skipped_steps == 1
    assert_bitwise_equal(got.after_batch[3], got.after_batch[1])
    fit(Faulty(drop={2, 3}), 2, accumulate=2, clip=1.0, callbacks=[ref], **options)
    assert_bitwise_equal(got.final, ref.final)


@pytest.mark.parametrize(("overlap", "late"), [(False, False), (True, False), (True, True)])
def test_nonfinite_raise_stops_before_any_update(overlap, late, monkeypatch):
    """With grads landing late the worker raises, and the error surfaces at the next forward."""
    if late:
        _late_grads(monkeypatch)
    got = Snapshots()
    with pytest.raises(RuntimeError, match=r"nonfinite='raise'\): optimizer step 1 has a non-finite gradient norm "
                                           r"nan, loss nan; nothing was updated") as info:
        fit(Faulty(nan_loss={1}), 3, callbacks=[got], overlap_optimizer=overlap, cpu_adam="torch",
             nonfinite="raise")
    assert isinstance(info.value.__cause__ if late else info.value, NonFiniteError)
    assert_bitwise_equal(got.at_exception, got.after_batch[0])


def test_nonfinite_option_is_validated():
    with pytest.raises(ValueError, match=r"nonfinite='ignore': choose one of \('skip', 'raise'\)"):
        MegaTrainStrategy(nonfinite="ignore")


@pytest.mark.parametrize("cpu_adam", ["torch", "deepspeed"])
@pytest.mark.parametrize("overlap", [False, True])
def test_failed_state_allocation_updates_nothing(overlap, cpu_adam, monkeypatch):
    """Host RAM runs out while the first step allocates the Adam states of a middle group: no parameter is updated and
    no state is left behind, and the error says so."""
    module = Faulty()
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    new_state, calls = host_optimizer._new_state, []

    def out_of_memory_halfway(p, deepspeed):
        calls.append(p)
        if len(calls) == len(initial) // 2:
            raise MemoryError("cannot allocate the Adam state")
        return new_state(p, deepspeed)

    monkeypatch.setattr(host_optimizer, "_new_state", out_of_memory_halfway)
    got = Snapshots()
    with pytest.raises(StepFailed, match=r"optimizer step 0 failed before updating anything: every master, Adam state "
                                         r"and step count is as it was before the step \(MemoryError"):
        fit(module, 2, callbacks=[got], overlap_optimizer=overlap, cpu_adam=_host_adam(cpu_adam))
    assert not got.at_exception["states"]  # the states allocated before the failure are gone
    for name, p in got.at_exception["params"].items():
        assert torch.equal(p, initial[name]), name


@pytest.mark.parametrize("cpu_adam", ["torch", "deepspeed"])
@pytest.mark.parametrize("overlap", [False, True])
def test_kernel_error_in_a_middle_group_updates_nothing(overlap, cpu_adam):
    """After step 0, a middle layer's ``exp_avg`` no longer fits its parameter (a corrupt state): the Adam kernel would
    fail there, after the groups before it were updated. The step updates nothing instead, and the error says so."""

    class CorruptState(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.strategy.wait_for_optimizer()
            p = pl_module.model.model.layers[1].mlp.up_proj.weight
            trainer.optimizers[0].state[p]["exp_avg"] = torch.zeros(3)

    got = Snapshots()
    with pytest.raises(StepFailed, match=r"optimizer step 1 failed before updating anything(.|\n)*the exp_avg of a "
                                         r"host parameter float32 \[\d+, \d+\] on cpu is float32 \[3\] on cpu"):
        fit(Faulty(), 3, callbacks=[CorruptState(), got], overlap_optimizer=overlap, cpu_adam=_host_adam(cpu_adam))
    assert_bitwise_equal(got.at_exception, got.after_batch[0])  # as after step 0 (and the corruption)


def test_failure_after_an_update_began_is_torn_and_refuses_checkpoints(monkeypatch, tmp_path):
    """A fault the prepare cannot foresee, in the second group of an overlapped step (the first, the residents, is
    updated): the error says the step is torn, and the checkpoint an exception would save is refused."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    update, calls = host_optimizer.HostUpdate.__call__, []

    def fails_in_the_second_group(self, params):
        calls.append(params)
        if len(calls) == 2:
            raise RuntimeError("a kernel fault")
        update(self, params)

    monkeypatch.setattr(host_optimizer.HostUpdate, "__call__", fails_in_the_second_group)
    saved = OnExceptionCheckpoint(dirpath=tmp_path)
    with pytest.raises(RuntimeError, match=r"MegaTrain cannot save the parameters: optimizer step 0 failed after "
                                           r"updating \d+ host parameters, so the parameters and optimizer states mix "
                                           r"two steps") as info:
        fit(Faulty(), 2, callbacks=[saved], checkpointing=True, overlap_optimizer=True, cpu_adam="torch")
    assert "StepFailed: MegaTrain: optimizer step 0 failed after updating" in str(info.value.__context__)
    assert not list(tmp_path.iterdir())


class _TensorLR(Faulty):
    """AdamW with a tensor learning rate, halved after every step by a per-step scheduler (in place: torch's
    schedulers ``fill_`` a tensor ``lr``)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=torch.tensor(1e-2), fused=True)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_tensor_learning_rate_is_read_when_the_step_is_taken():
    """The overlapped step (and the updates during backward) read the step's learning rate from a copy: the
    scheduler set the tensor in place while the worker still updated layers with it, which then got the next
    step's rate (the weights differed from the synchronous step's)."""
    finals = []
    for options in (dict(overlap_optimizer=False), dict(overlap_optimizer=True),
                    dict(overlap_optimizer=True, update_during_backward=True)):
        trainer = fit(_TensorLR(), 4, cpu_adam="torch", **options)
        finals.append(state_of(trainer, trainer.lightning_module))
    assert_bitwise_equal(finals[0], finals[1])
    assert_bitwise_equal(finals[0], finals[2])


def test_the_first_steps_host_check_counts_every_rank_of_the_host(monkeypatch):
    """``check_host_bytes_to_come`` with several ranks on the host: each has as much to come, so 600 MiB fits 1 GiB
    for one rank and not for two (the refusal names them); the other ranks' reserve comes off what is available."""
    from lightning_megatrain.engine import host_store

    monkeypatch.setattr(host_store, "placeable_host_bytes", lambda: (2**30, "a test's limit"))
    monkeypatch.delenv("MEGATRAIN_SKIP_MEMORY_CHECK", raising=False)
    host_store.check_host_bytes_to_come(600 * 2**20)
    with pytest.raises(RuntimeError, match=r"needs about 1.2 GiB more host RAM .*2 ranks on this host with 600.0 MiB "
                                           r"each\) but only 1.0 GiB is available \(a test's limit\)"):
        host_store.check_host_bytes_to_come(600 * 2**20, per_host=2)
    host_store.check_host_bytes_to_come(300 * 2**20, per_host=2)
    with pytest.raises(RuntimeError, match=r"only 512.0 MiB is available \(a test's limit, less the 512.0 MiB the "
                                           r"host's other ranks keep free\)"):
        host_store.check_host_bytes_to_come(300 * 2**20, per_host=2, reserve=2**29)
