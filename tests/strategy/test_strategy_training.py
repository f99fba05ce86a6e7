"""MegaTrainStrategy during fit: validation, LR schedulers, gradient clipping, the hooks that read gradients, and the
host-memory report, against plain Lightning where there is one."""

from __future__ import annotations

import re
from unittest import mock

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy

from helpers.parity import ParityLM, assert_records_close, make_data, run
from helpers.trainers import cpu_trainer


def test_validation_matches_plain(tmp_path):
    class WithVal(ParityLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def val_dataloader(self):
            return DataLoader(make_data()[:4], batch_size=2)

    results = []
    for strategy in ("auto", MegaTrainStrategy(cpu_adam="torch")):
        L.seed_everything(0)
        trainer = cpu_trainer(strategy=strategy, max_steps=2, val_check_interval=2)
        trainer.fit(WithVal("qwen3"))
        results.append(float(trainer.callback_metrics["val_loss"]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=0)


def test_schedulers_follow_replaced_optimizer(recwarn):
    ref = run("auto", "llama_tied", scheduler=True)
    got = run(MegaTrainStrategy(cpu_adam="auto"), "llama_tied", scheduler=True)
    assert got.lrs == ref.lrs and len({lr[0] for lr in got.lrs}) == 3
    assert not [w for w in recwarn if "has been overridden" in str(w.message)]


def test_clipping_uses_the_engine_path():
    """gradient_clip_val goes through the engine's flat-buffer clipping, not torch's per-tensor fallback."""
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", side_effect=AssertionError("fallback used")):
        got = run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", clip=1.0, steps=2)
    ref = run("auto", "llama_tied", clip=1.0, steps=2)
    assert_records_close(got, ref)


def test_grads_read_by_hooks_sees_modules_and_callbacks():
    # what decides whether host grads may land after the optimizer step starts (engine/optimizer_step.py, [Note: late
    # grads])
    from lightning_megatrain.hooks import grads_read_by_hooks

    class Quiet(L.Callback):
        def on_train_batch_end(self, *args):
            pass

    class Reads(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    class ClipsItself(ParityLM):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

    def attached(module, callbacks):
        module.trainer = L.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
        return module

    assert not grads_read_by_hooks(attached(ParityLM("llama_tied"), [Quiet()]))
    assert grads_read_by_hooks(attached(ParityLM("llama_tied"), [Quiet(), Reads()]))
    assert grads_read_by_hooks(attached(ClipsItself("llama_tied"), []))


def test_host_memory_is_reported_by_kind_at_train_end(caplog):
    # masters and grads are 4 bytes per parameter each, AdamW's two moments 8 (plus one step scalar per tensor); the
    # resident set holds them all, and the rest is reported as "other"
    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            self.sizes = trainer.strategy.host_memory()
            self.n_params = sum(p.numel() for p in pl_module.parameters())
            self.n_tensors = sum(1 for _ in pl_module.parameters())

    check = Check()
    with caplog.at_level("INFO", logger="lightning_megatrain"):
        run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", steps=2, callbacks=[check])
    sizes, n = check.sizes, check.n_params
    assert sizes["masters"] == 4 * n and sizes["grads"] == 4 * n
    assert sizes["optimizer_states"] == 8 * n + 4 * check.n_tensors
    assert sizes["other"] == sizes["rss"] - (sizes["masters"] + sizes["grads"] + sizes["optimizer_states"]) > 0
    (message,) = [r.getMessage() for r in caplog.records if "host memory at train end" in r.getMessage()]
    assert "optimizer states" in message
    now, peak = (float(x) for x in re.search(r"at train end ([\d.]+) GiB.*peak so far ([\d.]+) GiB", message).groups())
    assert peak >= now > 0  # the high-water mark, logged beside the resident set
