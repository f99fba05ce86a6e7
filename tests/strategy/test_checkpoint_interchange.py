"""Checkpoints are interchangeable: one saved by plain Lightning (``strategy="auto"``, torch's AdamW) or by
``MegaTrainStrategy`` with either host Adam resumes under every one of them, overlapped or not, and the next step
continues the saver's own run: step counts exact, weights bitwise where the resumed run's Adam kernel is the saver's,
else within fp32 tolerance (optim/host_optimizer.py ``load_host_state``)."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatrain import MegaTrainStrategy

from helpers.parity import ParityLM
from helpers.trainers import cpu_trainer

SAVERS = ("plain", "torch", "deepspeed")  # the three checkpoint formats; overlapping the step changes none of them
LOADERS = ("plain", "torch", "torch-overlapped", "deepspeed", "deepspeed-overlapped")


def _strategy(name: str):
    if name == "plain":
        return "auto"
    cpu_adam, _, overlapped = name.partition("-")
    return MegaTrainStrategy(cpu_adam=cpu_adam, overlap_optimizer=bool(overlapped))


def _kernel(name: str) -> str:
    return name.partition("-")[0]


def _fit(name, root, ckpt_path=None):
    """3 optimizer steps (from ``ckpt_path``'s step 2 when given), a checkpoint after each: the trainer and module."""
    L.seed_everything(0)
    module = ParityLM("qwen3")  # no dropout: Lightning restores no RNG state
    every_step = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=1, save_top_k=-1)
    # epochs of 2 batches: step 2's checkpoint is an epoch's end, where the module's plain DataLoader resumes exactly
    trainer = cpu_trainer(strategy=_strategy(name), max_steps=3, limit_train_batches=2, default_root_dir=root,
                          enable_checkpointing=True, callbacks=[every_step])
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each saver's step-2 checkpoint and its own weights after step 3 (the uninterrupted run)."""
    with pytest.MonkeyPatch.context() as patch:
        cpuinfo = pytest.importorskip("cpuinfo")  # every DeepSpeedCPUAdam calls it: 2 s of subprocesses
        patch.setattr(cpuinfo, "get_cpu_info", functools.lru_cache(cpuinfo.get_cpu_info))
        runs = {}
        for name in SAVERS:
            root = tmp_path_factory.mktemp(f"saved-{name}")
            try:
                _, module = _fit(name, root)
            except RuntimeError as e:
                if "could not build DeepSpeedCPUAdam" not in str(e):
                    raise
                continue  # its pairs skip
            runs[name] = (root / "step2.ckpt", {n: p.detach().clone() for n, p in module.named_parameters()})
        yield runs


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("saver", SAVERS)
def test_checkpoint_resumes_under_every_strategy(saved, saver, loader, tmp_path, fast_cpuinfo):
    if saver not in saved or (_kernel(loader) == "deepspeed" and "deepspeed" not in saved):
        pytest.skip("DeepSpeedCPUAdam does not build here")
    ckpt, expected = saved[saver]
    trainer, module = _fit(loader, tmp_path, ckpt_path=ckpt)
    (optimizer,) = trainer.optimizers
    steps = {int(state["step"]) for state in optimizer.state.values()}
    assert steps == {3}, f"{saver} -> {loader}: step counts {steps} after one resumed step from step 2"
    for name, p in module.named_parameters():
        if _kernel(loader) == saver:  # the same Adam kernel: the run continues to the bit
            assert torch.equal(p, expected[name]), f"{saver} -> {loader}: {name}"
        else:  # another kernel for one step (fp32 rounding of a different instruction order)
            torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=f"{saver} -> {loader}: {name}")
