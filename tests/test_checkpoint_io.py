"""Atomic, streamed checkpoint saves (checkpoint_io.py, [Note: atomic checkpoints]), and resuming from the newest
checkpoint that loads ([Note: resuming from a readable checkpoint])."""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatrain import MegaTrainStrategy, checkpoint_io
from lightning_megatrain.checkpoint_io import AtomicCheckpointIO

from helpers.host_ram import MEASURABLE, SaveAndMeasure, Wide
from helpers.kills import kill_during_saves
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
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a process that is gone
    stale = tmp_path / ".last.ckpt.abc123.tmp"  # what SIGKILL during a save of this name leaves
    killed = tmp_path / f".step5.ckpt.pid{dead}.def456.tmp"  # another name's, its writer gone: a step5-v1 case
    writing = tmp_path / f".step6.ckpt.pid{os.getppid()}.ghi789.tmp"  # another name's, its writer alive
    unknown = tmp_path / ".epoch=1.ckpt.jkl012.tmp"  # another name's, no writer recorded
    for path in (stale, killed, writing, unknown):
        path.write_bytes(b"x" * 100)
    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert not stale.exists() and not killed.exists() and torch.load(target) == {"step": 3}
    assert writing.exists() and unknown.exists()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True).stdout)


def test_a_save_leaves_another_hosts_temporaries_to_that_host(tmp_path, monkeypatch):
    """Two hosts (the host name patched) save into one directory, as ranks of ``num_nodes=2`` do: a save on host
    alpha during host beta's leaves beta's temporary alone, although beta's pid is no process on alpha, and beta's
    rename succeeds. A killed save's leftovers: this host's and an earlier version's (no host) go with the next save
    here; another host's go with a save on that host, or here once unmodified for ``FOREIGN_STALE_S``."""
    host = ["beta"]
    monkeypatch.setattr(socket, "gethostname", lambda: host[0])
    getpid, save, dead = os.getpid, torch.save, _dead_pid()

    def beta_writes_while_alpha_saves(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        if obj.get("rank") == 1:  # beta's temporary is written, not yet renamed: alpha's rank 0 saves now
            host[0] = "alpha"
            monkeypatch.setattr(os, "getpid", getpid)
            AtomicCheckpointIO().save_checkpoint({"rank": 0}, tmp_path / "last.ckpt-shard0-of-2")
            host[0] = "beta"

    monkeypatch.setattr(torch, "save", beta_writes_while_alpha_saves)
    monkeypatch.setattr(os, "getpid", lambda: dead)  # beta's pid: no process on alpha
    AtomicCheckpointIO().save_checkpoint({"rank": 1}, tmp_path / "last.ckpt-shard1-of-2")
    monkeypatch.setattr(os, "getpid", getpid)
    monkeypatch.setattr(torch, "save", save)
    assert torch.load(tmp_path / "last.ckpt-shard0-of-2") == {"rank": 0}
    assert torch.load(tmp_path / "last.ckpt-shard1-of-2") == {"rank": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt-shard0-of-2", "last.ckpt-shard1-of-2"]

    ours = tmp_path / f".step5.ckpt.pid{dead}@alpha.abcdefgh.tmp"
    earlier = tmp_path / f".step6.ckpt.pid{dead}.abcdefgh.tmp"  # an earlier version's name: no host
    beta_file = tmp_path / f".step7.ckpt.pid{dead}@beta.abcdefgh.tmp"
    beta_old = tmp_path / f".step8.ckpt.pid{dead}@beta.ijklmnop.tmp"
    beta_dir = tmp_path / f".step9.ckpt.pid{dead}@beta.qrstuvwx.old"  # a sharded save's previous directory
    for path in (ours, earlier, beta_file, beta_old):
        path.write_bytes(b"x")
    beta_dir.mkdir()
    (beta_dir / "index.json").write_text("{}")
    long_ago = time.time() - checkpoint_io.FOREIGN_STALE_S - 60
    os.utime(beta_old, (long_ago, long_ago))
    host[0] = "alpha"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert not ours.exists() and not earlier.exists() and not beta_old.exists()
    assert beta_file.exists() and beta_dir.exists()
    host[0] = "beta"
    AtomicCheckpointIO().save_checkpoint({"step": 2}, tmp_path / "last.ckpt")
    assert not beta_file.exists() and not beta_dir.exists()


def test_a_temporary_name_carries_the_host_in_a_file_name_safe_form(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node 1/a@b")
    assert checkpoint_io.this_host() == "node_1_a_b"
    assert checkpoint_io.temporary_prefix(Path("x/last.ckpt")) == f".last.ckpt.pid{os.getpid()}@node_1_a_b."
    long = [f"n{i}." + "cluster" * 9 for i in (1, 2)]
    shortened = []
    for name in long:
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        shortened.append(checkpoint_io.this_host())
    assert all(len(h) == 40 for h in shortened) and shortened[0] != shortened[1]
    assert checkpoint_io.temporary_of(f".last.ckpt.pid5@{shortened[0]}.abcdefgh.tmp") == "last.ckpt"
    assert checkpoint_io.temporary_of(".last.ckpt.pid5.abcdefgh.old") == "last.ckpt"  # an earlier version's
    assert checkpoint_io.temporary_of("last.ckpt") is None


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_a_checkpoint_has_the_mode_an_ordinary_save_gives(tmp_path, mask):
    old = os.umask(mask)
    try:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == 0o666 & ~mask


def test_storage_options_are_refused_as_lightning_refuses_them(tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


def test_strategy_saves_atomically_by_default_and_takes_a_given_plugin():
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    assert isinstance(MegaTrainStrategy().checkpoint_io, AtomicCheckpointIO)
    given = TorchCheckpointIO()
    assert MegaTrainStrategy(checkpoint_io=given).checkpoint_io is given


# - host RAM during a save


@pytest.mark.skipif(not MEASURABLE, reason="needs Linux's /proc/self/clear_refs")
def test_a_save_holds_no_second_copy_of_the_checkpoint_in_host_ram(tmp_path):
    """[Note: atomic checkpoints]: a 78 MiB checkpoint saved through the strategy raises the peak RSS by under 4 MiB
    (2.0 MiB measured), where Lightning's TorchCheckpointIO holds the whole checkpoint in a buffer first. The file
    holds 12 bytes per parameter: fp32 masters and both moments, no grads."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    extra = {}
    for plugin in (AtomicCheckpointIO(), TorchCheckpointIO()):
        measure = SaveAndMeasure(tmp_path / f"{type(plugin).__name__}.ckpt")
        strategy = MegaTrainStrategy(layers="blocks", cpu_adam="torch", checkpoint_io=plugin)
        module = Wide()
        cpu_trainer(strategy=strategy, max_steps=2, callbacks=[measure]).fit(module)
        extra[type(plugin).__name__] = measure.extra
    size = (tmp_path / "AtomicCheckpointIO.ckpt").stat().st_size
    n_params = sum(p.numel() for p in module.parameters())
    assert 12 * n_params <= size <= 12 * n_params + 2**20
    assert extra["AtomicCheckpointIO"] < 4 * 2**20, extra
    assert extra["TorchCheckpointIO"] > 0.9 * size, extra  # the measurement sees a copy where there is one


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


# - SIGKILL during saves, $TMPDIR on another filesystem


BALLAST = 4 << 20  # fp32 values added to each checkpoint (16 MiB): saves take most of the child's time


class _Ballast(L.Callback):
    def __init__(self) -> None:
        self.tensor = torch.randn(BALLAST, generator=torch.Generator().manual_seed(0))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["ballast"] = self.tensor


def _train_saving_every_step(root, tmpdir, max_steps) -> None:
    """The child: resume from ``root``'s last checkpoint and train, saving every step (top 2 and last)."""
    os.environ["TMPDIR"] = str(tmpdir)
    tempfile.tempdir = None  # tempfile reads $TMPDIR again
    torch.set_num_threads(1)
    module = ParityLM("qwen3")
    checkpoints = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                  every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch"), max_steps=max_steps, default_root_dir=root,
                          enable_checkpointing=True, callbacks=[checkpoints, _Ballast()])
    trainer.fit(module, ckpt_path="last" if (root / "last.ckpt").exists() else None)


def _other_filesystem(tmp_path):
    """/dev/shm when it is another filesystem than ``tmp_path``'s (a rename across the two would be a copy), else a
    folder beside the checkpoints."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        return Path(tempfile.mkdtemp(prefix="megatrain-tmpdir-", dir=shm))
    (tmp_path / "tmpdir").mkdir()
    return tmp_path / "tmpdir"


def test_sigkill_during_saves_leaves_every_checkpoint_loadable(tmp_path):
    """A child process fits and saves every step; it is SIGKILLed at random times while a save's temporary file is
    being written, 8 times, each child resuming from ``"last"``. After every kill each ``*.ckpt`` loads; a last child's
    saves leave no temporary file of any kill behind; ``$TMPDIR`` (another filesystem where there is one) stays empty.
    With Lightning's ``TorchCheckpointIO`` (its temporary file in ``$TMPDIR``, then a copy) a kill leaves a truncated
    checkpoint here."""
    root = tmp_path / "ckpts"
    root.mkdir()
    tmpdir = _other_filesystem(tmp_path)
    try:
        start = kill_during_saves(root, functools.partial(_train_saving_every_step, root, tmpdir),
                                  lambda path: torch.load(path, weights_only=False, mmap=True),
                                  kills=8, max_saves=5, max_pause=0.1)
        assert not list(root.glob(".*.tmp")), "a temporary file survived the next save"
        assert torch.load(root / "last.ckpt", weights_only=False, mmap=True)["global_step"] == start + 1
        assert not list(tmpdir.iterdir())  # nothing went through $TMPDIR
    finally:
        if tmpdir.parent != tmp_path:
            shutil.rmtree(tmpdir, ignore_errors=True)
