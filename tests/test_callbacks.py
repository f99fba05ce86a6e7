"""ThroughputLogger in plain Lightning: token counting, the windowed rate, MFU, memory and the one-step trace."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_megatrain  # noqa: F401
from lightning_megatrain import callbacks
from lightning_megatrain._hardware import device_peak_flops
from lightning_megatrain.callbacks import (
    TRACE_FILE_NAME,
    ParamSummary,
    StepProgressBar,
    ThroughputLogger,
    batch_tokens,
    matmul_params,
)
from lightning_megatrain.models import CausalLMModule

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
SEQ, BATCH = 16, 2


def _loader() -> DataLoader:
    ids = torch.randint(3, 128, (16, SEQ), generator=torch.Generator().manual_seed(0))  # [16, SEQ]
    mask = torch.ones_like(ids)  # [16, SEQ]
    mask[:, -4:] = 0  # 4 padding positions per row: not counted
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)]
    return DataLoader(rows, batch_size=BATCH)


def _fit(tmp_path, callback: ThroughputLogger, max_steps: int, **kwargs) -> tuple[L.Trainer, CausalLMModule]:
    module = CausalLMModule(config=TINY)
    trainer = L.Trainer(
        strategy="megatrain",
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
        **kwargs,
    )
    trainer.fit(module, _loader())
    return trainer, module


def test_batch_tokens_counts_real_tokens():
    ids = torch.ones(2, 5, dtype=torch.long)
    assert batch_tokens({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}) == 8
    assert batch_tokens({"input_ids": ids}) == 10  # no mask (e.g. packed rows): every position
    assert batch_tokens([ids]) == 0


def test_matmul_params_skip_lookup_tables_but_count_a_tied_head():
    untied = CausalLMModule(config=TINY)
    tied = CausalLMModule(config={**TINY, "tie_word_embeddings": True})
    for module in (untied, tied):
        module.configure_model()
    total = sum(p.numel() for p in untied.parameters())
    assert matmul_params(untied) == total - 128 * 32  # the [V, H] input embedding is a lookup
    assert matmul_params(tied) == total - 128 * 32  # one [V, H] table, used as the LM head matmul
    assert sum(p.numel() for p in tied.parameters()) == total - 128 * 32


def test_logs_throughput_mfu_and_memory(tmp_path, monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(callbacks, "perf_counter", lambda: 2.0 * next(ticks))  # each batch "takes" 2 s
    callback = ThroughputLogger(window=2, peak_flops=1e9)
    trainer, module = _fit(tmp_path, callback, max_steps=5, logger=CSVLogger(tmp_path))
    metrics = trainer.callback_metrics
    tokens_per_s = BATCH * (SEQ - 4) / 2.0  # real tokens of one batch per 2 s
    assert float(metrics["tokens_per_s"]) == pytest.approx(tokens_per_s)
    n_params = sum(p.numel() for p in module.parameters()) - 128 * 32  # untied: without the input embedding
    assert matmul_params(module) == n_params
    assert float(metrics["mfu"]) == pytest.approx(6 * n_params * tokens_per_s / 1e9, rel=1e-6)
    assert float(metrics["host_rss_gib"]) > 0
    assert "gpu_max_mem_gib" not in metrics  # CPU run
    assert "tokens_per_s" in trainer.progress_bar_metrics
    # Steps 4 and 5 (a window of 2 batches, then the batch whose end reports it) reached the logger.
    header, *rows = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("tokens_per_s")
    assert sum(1 for row in rows if row.split(",")[column]) == 2


def test_a_gpu_count_is_read_a_batch_later_without_waiting_for_the_device(monkeypatch):
    # the CUDA path, with the device stood in for: the count's copy is queued and its event waited for only when a
    # later batch reports the window; nothing reads a device tensor with int()
    events = []

    class Event:
        def __init__(self):
            self.recorded = self.waited = False
            events.append(self)

        def record(self, stream):
            self.recorded = stream == "stream of cuda:0"

        def synchronize(self):
            self.waited = True

    class Count(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: torch.zeros(*a, **k))
    mask = torch.ones(2, 5, dtype=torch.long).as_subclass(Count)
    pending = callbacks._pending({"input_ids": mask, "attention_mask": mask})
    assert isinstance(pending, callbacks._PendingCount)
    assert events[0].recorded and not events[0].waited
    assert pending.value() == 10 and events[0].waited
    assert callbacks._pending({"input_ids": torch.ones(2, 3)}) == 6  # no mask: the shape, on the host


def test_metrics_are_logged_as_host_tensors(tmp_path, monkeypatch):
    # LightningModule.log turns a Python number into a tensor on the module's device: on a GPU a blocking copy
    logged = []
    log = L.LightningModule.log
    monkeypatch.setattr(L.LightningModule, "log", lambda self, name, value, *a, **k: (
        logged.append((name, value)), log(self, name, value, *a, **k))[1])
    _fit(tmp_path, ThroughputLogger(window=1, peak_flops=1e12), max_steps=3)
    mine = [(name, value) for name, value in logged if name in ("tokens_per_s", "mfu", "host_rss_gib")]
    assert {name for name, _ in mine} == {"tokens_per_s", "mfu", "host_rss_gib"}
    assert all(isinstance(value, torch.Tensor) and value.device.type == "cpu" for _, value in mine)


def test_real_clock_gives_positive_throughput(tmp_path):
    trainer, _ = _fit(tmp_path, ThroughputLogger(window=1, peak_flops=1e12), max_steps=3)
    assert float(trainer.callback_metrics["tokens_per_s"]) > 0
    assert float(trainer.callback_metrics["mfu"]) > 0


def test_auto_peak_flops_gives_no_mfu_on_a_cpu(tmp_path):
    trainer, _ = _fit(tmp_path, ThroughputLogger(window=1), max_steps=3)
    assert "tokens_per_s" in trainer.callback_metrics and "mfu" not in trainer.callback_metrics


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("X", None)])
def test_device_peak_flops_by_gpu_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops(torch.device("cuda", 0)) == peak
    assert device_peak_flops(torch.device("cpu")) is None


@pytest.mark.parametrize(("max_epochs", "expected"), [(-1, "Epoch 1"), (3, "Epoch 1/2")])
def test_step_progress_bar_shows_no_negative_epoch_total(max_epochs, expected):
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs)
    assert bar._get_train_description(1).strip() == expected


def test_param_summary_leaves_out_unmeasured_flops(caplog, monkeypatch):
    caplog.set_level("INFO")
    # Lightning's logger stops propagating when it is first imported before any root handler exists (at collection,
    # depending on which test module imports it first): let rank_zero_info's record reach caplog's root handler
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    data = [("Name", ["model"]), ("Type", ["Llama"]), ("Params", ["377 K"]), ("FLOPs", ["0"])]
    ParamSummary.summarize(data, 377_000, 377_000, 1.5, {"train": 1, "eval": 0}, total_flops=0)
    assert "377 K" in caplog.text and "FLOPs" not in caplog.text


@pytest.mark.parametrize("with_logger", [True, False])
def test_profile_step_writes_chrome_trace(tmp_path, with_logger):
    callback = ThroughputLogger(profile_step=1)
    logger = CSVLogger(tmp_path / "logs") if with_logger else False
    trainer, _ = _fit(tmp_path, callback, max_steps=3, logger=logger)
    expected_dir = trainer.log_dir if with_logger else str(tmp_path)
    assert callback.trace_path is not None and str(callback.trace_path.parent) == expected_dir
    assert callback.trace_path.name == TRACE_FILE_NAME
    trace = json.loads(callback.trace_path.read_text())
    assert trace["traceEvents"]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="window"):
        ThroughputLogger(window=0)
    with pytest.raises(ValueError, match="profile_step"):
        ThroughputLogger(profile_step=-1)
    with pytest.raises(ValueError, match="peak_flops"):
        ThroughputLogger(peak_flops=0)
