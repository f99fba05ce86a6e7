"""Atomic, streamed checkpoint saves (checkpoint_io.py, [Note: atomic checkpoints])."""

from __future__ import annotations

import io
import os

import pytest
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.checkpoint_io import AtomicCheckpointIO


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
