"""Muon under ``strategy="megatrain"`` on the CPU: parity with plain Lightning running the same optimizer (the
engine's host update is ``Muon.step()``'s, overlapped or not, with accumulation, clipping and an LR schedule),
exact resume, skipped non-finite steps, and what is refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.optim import Muon, muon_param_groups

from helpers.faults import Faulty, Snapshots, assert_bitwise_equal, fit
from helpers.parity import MICRO_BATCH, ParityLM, assert_records_close, make_data, run
from helpers.trainers import cpu_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*smaller than the logging interval.*"
)


class MuonLM(ParityLM):
    """A parity module whose ``configure_optimizers`` returns Muon over :func:`muon_param_groups` (lr 1e-2, weight
    decay 0.1, as the AdamW parity runs), with a StepLR halving it each step when ``scheduler``."""

    def __init__(self, family: str, scheduler: bool = False) -> None:
        super().__init__(family, scheduler=scheduler)

    def configure_optimizers(self):
        opt = Muon(muon_param_groups(self.model), lr=1e-2, weight_decay=0.1)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _muon_run(strategy, family, scheduler=False, **kw):
    return run(strategy, None, module=lambda: MuonLM(family, scheduler), **kw)


@pytest.mark.parametrize(
    ("family", "overlap", "accumulate", "clip", "scheduler"),
    [("llama_tied", False, 1, None, False), ("llama_tied", True, 2, 1.0, True), ("qwen2", True, 1, 0.05, False)],
)
def test_muon_parity_with_plain_lightning(family, overlap, accumulate, clip, scheduler):
    """Losses, every gradient and the final weights of 3 steps within 1e-5 of plain Lightning's, with the step
    synchronous or overlapped; clip 0.05 bites on every step (the factor reaches the update, deferred)."""
    kw = dict(steps=3, accumulate=accumulate, clip=clip)
    ref = _muon_run("auto", family, scheduler, **kw)
    got = _muon_run(MegaTrainStrategy(overlap_optimizer=overlap), family, scheduler, **kw)
    assert_records_close(got, ref, rtol=1e-5)
    start = MuonLM(family).model.state_dict()
    moved = [n for n, p in ref.params.items() if not torch.equal(p, start[n.removeprefix("model.")])]
    assert len(moved) == len(ref.params)  # every parameter was updated: both kinds of group ran


def test_muon_parity_with_late_grads(monkeypatch):
    """Nothing reads the grads before the overlapped step: its worker waits for them and the clip factor
    ([Note: late grads]); the record matches plain Lightning's."""
    from lightning_megatrain.engine.transfer import HostTransfer

    monkeypatch.setattr(HostTransfer, "take_host_added", lambda self: False)  # the CPU backend's grads land "late"
    kw = dict(steps=3, accumulate=2, clip=0.05, record_grads=False)
    ref = _muon_run("auto", "llama_tied", **kw)
    got = _muon_run(MegaTrainStrategy(overlap_optimizer=True), "llama_tied", **kw)
    assert_records_close(got, ref, rtol=1e-5)


def test_muon_parity_can_fail():
    """A Muon with a different momentum gives a record the comparison above rejects."""

    class OtherMomentum(MuonLM):
        def configure_optimizers(self):
            return Muon(muon_param_groups(self.model), lr=1e-2, weight_decay=0.1, momentum=0.9)

    ref = _muon_run("auto", "llama_tied", steps=2)
    got = run(MegaTrainStrategy(), None, module=lambda: OtherMomentum("llama_tied"), steps=2)
    with pytest.raises(AssertionError, match="param"):
        assert_records_close(got, ref, rtol=1e-5)


class FaultyMuon(Faulty):
    def configure_optimizers(self):
        return Muon(muon_param_groups(self.model), lr=1e-2, weight_decay=0.1)


class OneBatchMuon(FaultyMuon):
    """Trains on one micro-batch over and over: a run resumed mid-epoch (Lightning restarts a dataloader that is not
    resumable from its first batch) sees the data an uninterrupted run sees."""

    def train_dataloader(self):
        return DataLoader(make_data()[:MICRO_BATCH].repeat(8, 1), batch_size=MICRO_BATCH, shuffle=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_resume_is_bit_for_bit_an_uninterrupted_run(tmp_path, overlap):
    """4 steps straight against 2, a checkpoint, and 2 resumed from it: parameters, momentum buffers and AdamW states
    equal bit for bit; the checkpoint holds them as CPU tensors, the momentum buffers instead of Adam moments."""
    straight = Snapshots()
    fit(OneBatchMuon(), 4, callbacks=[straight], overlap_optimizer=overlap)

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(OneBatchMuon(), 2, callbacks=[ckpt], checkpointing=True, overlap_optimizer=overlap)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["optimizer_states"][0]
    assert [g["use_muon"] for g in saved["param_groups"]] == [True, False]
    kinds = {frozenset(s) for s in saved["state"].values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}

    resumed = Snapshots()
    L.seed_everything(0)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(overlap_optimizer=overlap), max_steps=4, callbacks=[resumed])
    trainer.fit(OneBatchMuon(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert_bitwise_equal(resumed.final, straight.final)


@pytest.mark.parametrize("overlap", [False, True])
def test_nonfinite_step_leaves_muon_state_untouched(overlap):
    """A NaN loss at step 1: masters, momentum buffers and AdamW states bit for bit as after step 0."""
    got = Snapshots()
    trainer = fit(FaultyMuon(nan_loss={1}), 3, callbacks=[got], overlap_optimizer=overlap)
    assert trainer.strategy.skipped_steps == 1
    assert_bitwise_equal(got.after_batch[1], got.after_batch[0])
    name = "model.model.layers.0.mlp.up_proj.weight"  # a Muon matrix, updated by the steps after
    assert not torch.equal(got.final["params"][name], got.after_batch[1]["params"][name])


def test_muon_is_the_engines_step_and_device_groups_refuse_it():
    """The engine takes Muon's step (all or nothing, overlappable, no warning); device groups, which step Adam/AdamW
    on the GPU, refuse it at setup with the fix."""
    from types import SimpleNamespace
    from unittest import mock

    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.engine.optimizer_step import OptimizerStep

    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    step = OptimizerStep(EngineConfig(), torch.device("cpu"), [], None, None, None)
    assert step.takes_step(Muon(params))
    step.set_device_groups([SimpleNamespace(group=SimpleNamespace(params=[]), clear_grads=mock.Mock())])
    with pytest.raises(ValueError, match=r"gpu_optimizer_groups=auto\) steps Adam/AdamW on the GPU, got Muon.*"
                                         r"HINT: use torch.optim.AdamW .*, or gpu_optimizer_groups=0"):
        step.to_host_optimizers([Muon(params)], [])
