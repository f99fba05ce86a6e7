"""Sharded checkpoints (sharded_checkpoint.py, [Note: sharded checkpoints]): the directory layout, exact resume
through Lightning, host RAM during a save and a load, atomic swaps and SIGKILL during saves, conversion to one file
that plain Lightning loads."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from safetensors.torch import load_file

from lightning_megatrain import MegaTrainStrategy, checkpoint_io, sharded_checkpoint
from lightning_megatrain.checkpoint_io import AtomicCheckpointIO
from lightning_megatrain.cli import main as megatrain_main
from lightning_megatrain.data import SFTDataModule
from lightning_megatrain.models import CausalLMModule
from lightning_megatrain.sharded_checkpoint import convert_to_file, load_sharded, recover, save_sharded

from helpers.forked import in_child
from helpers.host_ram import MEASURABLE, LoadAndMeasure, SaveAndMeasure, Wide, exact_rss
from helpers.kills import kill_during_saves
from helpers.parity import ParityLM
from helpers.trainers import StepLosses, cpu_trainer


def _load(path):
    return load_sharded(path, lambda meta: torch.load(meta, weights_only=False))


def _assert_same(a, b, where="checkpoint"):
    """``a`` and ``b`` hold the same keys and values, tensors equal to the bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _fit_qwen3(root, steps, fmt="sharded", ckpt_path=None, callbacks=(), **checkpointing):
    L.seed_everything(0)
    module = ParityLM("qwen3")  # 3 decoder layers
    checkpoints = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                  every_n_train_steps=1, save_last=True, **checkpointing)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch", checkpoint_format=fmt), max_steps=steps,
                          default_root_dir=root, enable_checkpointing=True, callbacks=[checkpoints, *callbacks])
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


# - layout


def test_a_checkpoint_is_a_directory_with_one_shard_per_layer(tmp_path):
    """Each layer's shard holds exactly that layer's masters and their Adam states; the directory loads as the same
    checkpoint the file format saves; no temporary directory is left."""
    trainer, module = _fit_qwen3(tmp_path, 2)
    last = tmp_path / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [
        "index.json", "layer_00000.safetensors", "layer_00001.safetensors", "layer_00002.safetensors", "meta.pt",
        "residents.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step2.ckpt"]  # step1 removed (top 1)
    optimizer = trainer.optimizers[0]
    index_of = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for i, layer in enumerate(module.model.model.layers):
        shard = load_file(last / f"layer_{i:05d}.safetensors")  # safetensors' own reader
        want = {}
        for name, p in layer.named_parameters():
            want[f"state_dict/model.model.layers.{i}.{name}"] = p
            for key, value in optimizer.state[p].items():
                want[f"optimizer_states/0/state/{index_of[id(p)]}/{key}"] = value
        assert sorted(shard) == sorted(want)
        for name, value in want.items():
            assert torch.equal(shard[name], value), name
    index = json.loads((last / "index.json").read_text())
    assert index["format"] == "megatrain-sharded"
    again, file = tmp_path / "again.ckpt", tmp_path / "file.ckpt"
    trainer.save_checkpoint(again)
    AtomicCheckpointIO().save_checkpoint(trainer._checkpoint_connector.dump_checkpoint(), file)
    _assert_same(_load(again), torch.load(file, weights_only=False))


def test_a_tied_weight_is_stored_once_and_the_module_versions_survive(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    state_dict = module.state_dict()
    state_dict["tied.a"] = state_dict["tied.b"] = tied = torch.randn(5, 2)
    save_sharded({"state_dict": state_dict}, tmp_path / "x.ckpt", lambda place: "residents")
    index = json.loads((tmp_path / "x.ckpt" / "index.json").read_text())
    assert index["shards"]["residents.safetensors"]["tensors"]["state_dict/tied.a"] == [
        ["state_dict", "tied.a"], ["state_dict", "tied.b"]]
    loaded = _load(tmp_path / "x.ckpt")["state_dict"]
    assert loaded["tied.a"] is loaded["tied.b"] and torch.equal(loaded["tied.a"], tied)
    assert loaded._metadata == state_dict._metadata  # the modules' versions, which their load hooks read


# - exact resume through Lightning (the pattern of tests/strategy/test_exact_resume.py)

STEPS = 4  # optimizer steps: epochs of 3 batches (100 rows, micro-batches of 34)
CONFIG = dict(model_type="llama", vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, tie_word_embeddings=False)



def _fit_sft(root, fmt, ckpt_path=None):
    L.seed_everything(0)
    module = CausalLMModule(config=CONFIG, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, betas=(0.9, 0.999))
    data = SFTDataModule(dataset="demo_messages", cutoff_len=48, micro_batch_size=34, seed=3)
    losses = StepLosses()
    every_step = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch", checkpoint_format=fmt), max_steps=STEPS,
                          max_epochs=-1, gradient_clip_val=1.0, default_root_dir=root, enable_checkpointing=True,
                          callbacks=[every_step, losses], num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, losses.by_step, {n: p.detach().clone() for n, p in module.named_parameters()}


def test_resume_from_a_sharded_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path):
    """Saved sharded every step; resumed mid-epoch from step 2's directory by path, and by ``"last"`` into a
    ``checkpoint_format="file"`` strategy (loading reads either format): the losses after the checkpoint and the
    final weights equal the uninterrupted run's to the bit."""
    _, losses, weights = _fit_sft(tmp_path, "sharded")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert (tmp_path / "step2.ckpt" / "index.json").is_file()
    (tmp_path / "last_of_2").mkdir()
    shutil.copytree(tmp_path / "step2.ckpt", tmp_path / "last_of_2" / "last.ckpt")
    for root, ckpt_path, fmt in ((tmp_path / "by_path", tmp_path / "step2.ckpt", "sharded"),
                                 (tmp_path / "last_of_2", "last", "file")):
        trainer, resumed_losses, resumed_weights = _fit_sft(root, fmt, ckpt_path=ckpt_path)
        assert resumed_losses == {k: v for k, v in losses.items() if k > 2}, ckpt_path
        for name, w in weights.items():
            assert torch.equal(resumed_weights[name], w), f"{ckpt_path}: {name}"


def test_resume_from_last_skips_a_sharded_checkpoint_with_a_truncated_shard(tmp_path):
    """A shard of ``last.ckpt/`` cut in half: ``fit(ckpt_path="last")`` warns, names it, and resumes from step 2's
    directory ([Note: resuming from a readable checkpoint])."""
    _fit_qwen3(tmp_path, 2)
    good = tmp_path / "step2.ckpt"
    old = time.time() - 60
    os.utime(good, (old, old))
    shard = tmp_path / "last.ckpt" / "layer_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.warns(UserWarning, match=rf"resuming from {re.escape(str(good))}, the newest checkpoint that loads"
                                         r"(.|\n)*layer_00001.safetensors: \d+ bytes, the index says \d+: truncated"):
        trainer, _ = _fit_qwen3(tmp_path, 3, ckpt_path="last")
    assert trainer.ckpt_path == str(good) and trainer.global_step == 3


# - host RAM


def _save_and_resume(root, fmt, loader_io, results) -> None:
    """The child: save a 6.8M-parameter model's checkpoint in ``fmt``, resume from it (through ``loader_io`` when
    given), send the three numbers."""
    exact_rss()
    save = SaveAndMeasure(root / fmt / "last.ckpt")
    strategy = MegaTrainStrategy(layers="blocks", cpu_adam="torch", checkpoint_format=fmt)
    cpu_trainer(strategy=strategy, max_steps=2, callbacks=[save]).fit(Wide())
    load = LoadAndMeasure()
    strategy = MegaTrainStrategy(layers="blocks", cpu_adam="torch", checkpoint_io=loader_io)
    cpu_trainer(strategy=strategy, max_steps=3, callbacks=[load]).fit(Wide(), ckpt_path=save.path)
    results.send((save.extra, load.extra, load.kept))


@pytest.mark.skipif(not MEASURABLE, reason="needs Linux's /proc/self/clear_refs and glibc")
def test_a_save_and_load_hold_no_second_copy_in_host_ram(tmp_path):
    """The 78 MiB checkpoint of a 6.8M-parameter model: a sharded save raises the peak RSS by a few MiB (2.0 MiB
    measured: the index, the split dicts and meta.pt's pickle). A resume from it, or from the file format (loaded
    mapped), raises the peak by the optimizer states it loads (8 bytes/param, which the optimizer keeps) and a few
    MiB more (1.2 MiB from the file, 1.5 from the shards, measured; the bounds allow 12 MiB for the allocator under
    load): the masters are read from the mapped file
    straight into the host masters, a chunk at a time ([Note: mapped checkpoint tensors]). Lightning's own
    ``TorchCheckpointIO`` reads the whole file, the masters held twice until the restore ends (78.1 MiB measured
    against 52.1). Each runs in a child process whose large allocations the RSS sees exactly."""
    extra = {}
    for fmt, loader_io in (("sharded", None), ("file", None), ("file", TorchCheckpointIO())):
        root = tmp_path / type(loader_io).__name__
        extra[fmt if loader_io is None else "torch_io"] = in_child(_save_and_resume, root, fmt, loader_io)
    n_params = sum(p.numel() for p in Wide().parameters())
    size = sum(f.stat().st_size for f in (tmp_path / "NoneType" / "sharded" / "last.ckpt").iterdir())
    assert 12 * n_params <= size <= 12 * n_params + 2**20
    print({k: tuple(f"{v / 2**20:.2f} MiB" for v in vs) for k, vs in extra.items()})
    for fmt in ("sharded", "file"):
        saved, loaded, kept = extra[fmt]
        assert saved < 12 * 2**20, extra  # a copy of the state would be 78 MiB; allocator noise under load ~MiB
        # the measurement sees the states it loaded (8 B/param): 44-52 MiB of 52 measured, the RSS also giving back
        # pages of the file's mapping the load released meanwhile
        assert kept >= 0.75 * 8 * n_params, extra
        assert loaded < kept + 12 * 2**20, extra  # a copy of the masters would be 26 MiB
    _, loaded, kept = extra["torch_io"]
    assert loaded > kept + 0.5 * 4 * n_params, extra  # ... and a copy of the masters where there is one


# - atomic swaps


def _tensors(value: float) -> dict:
    return {"state_dict": {"blocks.0.weight": torch.full((4, 4), value), "head.weight": torch.full((2,), value)},
            "global_step": int(value)}


def _save(target, value):
    save_sharded(_tensors(value), target, lambda place: "layer_00000" if "blocks.0" in place[1] else "residents")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_save_replaces_the_previous_checkpoint_and_leaves_nothing_else(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(checkpoint_io, "_exchange", lambda a, b: False)
    target = tmp_path / "last.ckpt"
    for value in (1.0, 2.0):
        _save(target, value)
        assert _load(target)["global_step"] == value
        assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    (tmp_path / "file.ckpt").write_bytes(b"a file-format checkpoint")  # the same name saved sharded replaces it
    _save(tmp_path / "file.ckpt", 3.0)
    assert _load(tmp_path / "file.ckpt")["global_step"] == 3


def test_a_failed_save_keeps_the_previous_checkpoint_and_no_temporary_directory(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    _save(target, 1.0)
    write = sharded_checkpoint.write_safetensors

    def killed_midway(path, tensors):
        write(path, tensors)
        raise KeyboardInterrupt  # as a kill or an out-of-memory error after the first shard

    monkeypatch.setattr(sharded_checkpoint, "write_safetensors", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        _save(target, 2.0)
    assert _load(target)["global_step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_kill_between_the_two_renames_is_recovered(tmp_path):
    """Where the exchange is refused, a kill between ``target -> .old`` and ``.tmp -> target`` leaves both whole
    under temporary names: the complete new one (its index written) comes back; without it the old one; an
    incomplete ``.tmp`` never does, nor a removal's ``.del``; the next save of any name removes what is left."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # the killed writer: a process that is gone
    target, elsewhere = tmp_path / "last.ckpt", tmp_path / "elsewhere"
    for name, value in (("old", 1.0), ("new", 2.0), ("gone", 4.0)):
        _save(elsewhere / name, value)  # saved elsewhere: a save here would recover what follows
    (elsewhere / "old").rename(tmp_path / f".last.ckpt.pid{dead}.a.old")
    (elsewhere / "new").rename(tmp_path / f".last.ckpt.pid{dead}.b.tmp")
    (tmp_path / f".last.ckpt.pid{dead}.c.tmp").mkdir()  # a save killed before its index
    (elsewhere / "gone").rename(tmp_path / f".gone.pid{dead}.d.del")  # a removal killed before its rmtree ended
    elsewhere.rmdir()
    recover(tmp_path)
    assert _load(target)["global_step"] == 2 and not (tmp_path / "gone").exists()
    shutil.rmtree(target)
    recover(tmp_path)
    assert _load(target)["global_step"] == 1
    _save(tmp_path / "step3.ckpt", 3.0)  # another name: recovers and cleans the directory too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step3.ckpt"]


def test_only_the_writers_host_recovers_its_killed_swap(tmp_path, monkeypatch):
    """A complete new directory left by a kill between the two renames on host beta (its pid means nothing on
    alpha) is recovered by a save on beta, not by one on alpha, where a live writer between its renames could not be
    told from it; nor is a live writer's of this host."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    host = ["alpha"]
    monkeypatch.setattr(socket, "gethostname", lambda: host[0])
    _save(tmp_path / "elsewhere" / "new", 2.0)
    _save(tmp_path / "elsewhere" / "live", 3.0)
    beta = tmp_path / f".last.ckpt.pid{dead}@beta.abcdefgh.tmp"
    live = tmp_path / f".step3.ckpt.pid{os.getpid()}@alpha.abcdefgh.tmp"
    (tmp_path / "elsewhere" / "new").rename(beta)
    (tmp_path / "elsewhere" / "live").rename(live)
    (tmp_path / "elsewhere").rmdir()
    recover(tmp_path)
    assert beta.is_dir() and live.is_dir() and not (tmp_path / "last.ckpt").exists()
    host[0] = "beta"
    recover(tmp_path)
    assert _load(tmp_path / "last.ckpt")["global_step"] == 2 and live.is_dir() and not beta.exists()


def _train_saving_every_step(root, max_steps) -> None:
    """The child: resume from ``root``'s last checkpoint and train, saving sharded every step (top 2 and last)."""
    torch.set_num_threads(1)
    _fit_qwen3(root, max_steps, ckpt_path="last" if (root / "last.ckpt").exists() else None, save_top_k=2,
               monitor="step", mode="max", callbacks=[_Ballast()])


class _Ballast(L.Callback):
    """16 MiB more in each checkpoint (its meta.pt): saves take most of the child's time."""

    def __init__(self) -> None:
        self.tensor = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["ballast"] = self.tensor


def test_sigkill_during_sharded_saves_leaves_every_checkpoint_loadable(tmp_path):
    """A child saves a sharded checkpoint every step and is SIGKILLed at random times while a save's temporary
    directory exists, 5 times, each child resuming from ``"last"``: after every kill each ``*.ckpt`` directory loads
    and reads whole; a last child's save leaves no temporary or previous directory behind."""
    root = tmp_path / "ckpts"
    root.mkdir()

    def load_whole(path):
        checkpoint = _load(path)  # raises for a missing index or a truncated shard
        assert all(bool(t.isfinite().all()) for t in checkpoint["state_dict"].values())  # read whole
        return checkpoint

    start = kill_during_saves(root, functools.partial(_train_saving_every_step, root), load_whole,
                              kills=5, max_saves=4, max_pause=0.05)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "a temporary directory survived"
    assert _load(root / "last.ckpt")["global_step"] == start + 1


# - conversion to one file, loaded by plain Lightning


class _Restored(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0]
        self.states = [{k: v.clone() for k, v in optimizer.state[p].items()}
                       for g in optimizer.param_groups for p in g["params"]]
        self.global_step = trainer.global_step


def test_a_converted_checkpoint_resumes_plain_lightning(tmp_path, capsys):
    """``megatrain convert`` writes one ``.ckpt``; ``strategy="auto"`` resumes from it with the masters and Adam
    states of the sharded checkpoint, and trains on."""
    _fit_qwen3(tmp_path, 2)
    out = tmp_path / "plain.ckpt"
    assert megatrain_main(["convert", str(tmp_path / "last.ckpt"), str(out)]) == 0
    assert "Converted" in capsys.readouterr().out
    sharded = _load(tmp_path / "last.ckpt")
    _assert_same(torch.load(out, weights_only=False), sharded)
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_to_file(tmp_path / "last.ckpt", out)

    L.seed_everything(0)
    restored = _Restored()
    trainer = cpu_trainer(strategy="auto", max_steps=3, callbacks=[restored])
    trainer.fit(ParityLM("qwen3"), ckpt_path=out)
    assert restored.global_step == 2 and trainer.global_step == 3
    for name, p in restored.params.items():
        assert torch.equal(p, sharded["state_dict"][name]), name
    for i, state in enumerate(restored.states):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], sharded["optimizer_states"][0]["state"][i][key]), (i, key)


def test_checkpoint_format_is_validated_with_the_other_options():
    with pytest.raises(ValueError, match=r"checkpoint_format='zip': choose one of \('file', 'sharded'\)"):
        MegaTrainStrategy(checkpoint_format="zip")
    with pytest.raises(ValueError, match="checkpoint_format='sharded'.*checkpoint_io=AtomicCheckpointIO"):
        MegaTrainStrategy(checkpoint_format="sharded", checkpoint_io=AtomicCheckpointIO())
