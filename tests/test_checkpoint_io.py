"""Atomic, streamed checkpoint saves (checkpoint_io.py, [Note: atomic checkpoints]), and resuming from the newest
checkpoint that loads ([Note: resuming from a readable checkpoint])."""

from __future__ import annotations

import io
import os
import re
import shutil
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.checkpoint_io import AtomicCheckpointIO

from helpers.parity import ParityLM
from helpers.trainers import cpu_trainer


def test_save_streams_to_a_file_beside_the_target_and_renames_it(tmp_path, monkeypatch):
    target = tmp_path / "ckpts" / "last.ckpt"
    written, replaced = [], []
    save, replace = torch.save, os.replace

    def spy_save(obj, f, *args, **kwargs):
        written.append(f)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy_save)
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((src, dst)), replace(src, dst))[1])
    AtomicCheckpointIO().save_checkpoint({"w": torch.arange(4.0)}, target)
    assert not isinstance(written[0], io.BytesIO)  # a file, not the whole checkpoint held in host RAM
    (src, dst), = replaced
    assert os.path.dirname(src) == str(target.parent) and dst == target  # same directory: the rename is atomic
    assert torch.equal(torch.load(target)["w"], torch.arange(4.0))
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_a_failed_save_keeps_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    checkpoint_io = AtomicCheckpointIO()
    checkpoint_io.save_checkpoint({"step": 1}, target)
    save = torch.save

    def killed_midway(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # as a kill or an out-of-memory error between the first and the last byte

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_io.save_checkpoint({"step": 2}, target)
    monkeypatch.setattr(torch, "save", save)
    assert torch.load(target) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_temp_file_left_by_a_killed_save_is_removed_by_the_next(tmp_path):
    target = tmp_path / "last.ckpt"
    stale = tmp_path / ".last.ckpt.abc123.tmp"  # what SIGKILL during a save leaves
    stale.write_bytes(b"x" * 100)
    other = tmp_path / ".epoch=1.ckpt.def456.tmp"  # another checkpoint's: not this save's to remove
    other.write_bytes(b"y")
    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert not stale.exists() and other.exists() and torch.load(target) == {"step": 3}


def test_storage_options_are_refused_as_lightning_refuses_them(tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


def test_strategy_saves_atomically_by_default_and_takes_a_given_plugin():
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    assert isinstance(MegaTrainStrategy().checkpoint_io, AtomicCheckpointIO)
    given = TorchCheckpointIO()
    assert MegaTrainStrategy(checkpoint_io=given).checkpoint_io is given


# - resuming from a readable checkpoint ([Note: resuming from a readable checkpoint])


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _age(path, seconds: float) -> None:
    """Make ``path`` ``seconds`` older than now (the order "last" and the fallback go by)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


def _fit(root, steps, ckpt_path=None, callbacks=()):
    L.seed_everything(0)
    module = ParityLM("qwen3")
    checkpoints = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                  every_n_train_steps=1, save_last=True)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch"), max_steps=steps, default_root_dir=root,
                          enable_checkpointing=True, callbacks=[checkpoints, *callbacks])
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


class StartStep(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.global_step = trainer.global_step


def test_resume_from_last_skips_a_truncated_last_checkpoint(tmp_path):
    """last.ckpt cut in half beside a good step2 checkpoint: fit(ckpt_path="last") warns, names both, resumes from
    step 2 and ends exactly where resuming from that file by name ends."""
    _fit(tmp_path, 2)
    good = tmp_path / "step2.ckpt"
    assert good.is_file()
    _age(good, 60)
    _truncate(tmp_path / "last.ckpt")
    start = StartStep()
    with pytest.warns(UserWarning, match=rf"resuming from {re.escape(str(good))}, the newest checkpoint that loads: "
                                         rf"ckpt_path='last' chose {re.escape(str(tmp_path / 'last.ckpt'))}, which "
                                         "does not load"):
        trainer, got = _fit(tmp_path, 3, ckpt_path="last", callbacks=[start])
    assert start.global_step == 2 and trainer.global_step == 3
    assert trainer.ckpt_path == str(good)

    root = tmp_path / "by_name"
    root.mkdir()
    shutil.copy(good, root / "step2.ckpt")
    _, ref = _fit(root, 3, ckpt_path=str(root / "step2.ckpt"))
    for (name, a), b in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_resume_from_last_with_no_readable_checkpoint_names_every_file(tmp_path):
    _fit(tmp_path, 1)
    _age(tmp_path / "step1.ckpt", 60)
    for name in ("last.ckpt", "step1.ckpt"):
        _truncate(tmp_path / name)
    with pytest.raises(RuntimeError, match=r"could not load any checkpoint for ckpt_path='last' \(newest first\):\n"
                                           r"- .*last\.ckpt: .*\n- .*step1\.ckpt: (.|\n)*HINT"):
        _fit(tmp_path, 2, ckpt_path="last")


def test_a_checkpoint_named_by_path_does_not_fall_back(tmp_path):
    _fit(tmp_path, 1)
    _truncate(tmp_path / "step1.ckpt")
    with pytest.raises(RuntimeError, match="PytorchStreamReader"):
        _fit(tmp_path, 2, ckpt_path=str(tmp_path / "step1.ckpt"))
