"""Observability for MegaTrain runs: ``ThroughputLogger`` (tokens/s, MFU, host RSS, GPU peak memory, one-step trace)."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_megatrain._hardware import GIB, H100_BF16_PEAK_FLOPS, host_rss_gib

TRACE_FILE_NAME = "megatrain_trace.json"


def matmul_params(module: nn.Module) -> int:
    """Parameters that do matmul work per token: all of them except embedding tables (lookups), each counted once.

    An embedding weight that is also a ``Linear`` weight (a tied LM head) is counted: the head is a matmul. This is
    Kaplan et al.'s non-embedding N plus the LM head, the convention of ``megatrain plan``'s MFU.
    """
    linear = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    lookup = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)} - linear
    return sum(p.numel() for p in module.parameters() if id(p) not in lookup)


def batch_tokens(batch: Any) -> int:
    """Real (non-padding) tokens of a batch: the ``attention_mask`` sum if there is a mask, else ``input_ids.numel()``.

    Packed batches (``SFTDataModule(packing=True)``) have no mask, so the padding at the end of a packed row counts.
    Batches that are not dicts with ``input_ids`` count 0.
    """
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return 0
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    return int(batch["input_ids"].numel())


class ThroughputLogger(Callback):
    """Logs training throughput and memory to the progress bar and the logger, and can profile one step.

    Logged every training batch once ``window`` batches have been timed (the logger writes them every
    ``Trainer(log_every_n_steps)``):

    - ``tokens_per_s``: real tokens (``attention_mask`` sum, else ``input_ids`` numel) of the last ``window`` batches
      divided by the wall time they took.
    - ``mfu``: model FLOPs utilisation, ``6 * num_params * tokens_per_s / peak_flops``. 6N FLOPs per token is the
      forward (2N) plus backward (4N) matmul cost of a dense transformer with N non-embedding parameters (Kaplan et
      al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1; PaLM, Chowdhery et al. 2022, appendix B);
      attention-score FLOPs and MegaTrain's layer recompute (which makes the hardware do about 8N) are not
      counted, as in PaLM's MFU.
    - ``host_rss_gib``: resident memory of this process (``VmRSS`` of ``/proc/self/status``; Linux only).
    - ``gpu_max_mem_gib``: ``torch.cuda.max_memory_allocated`` of the training device, when it is a CUDA GPU.

    Timing uses ``time.perf_counter`` at ``on_train_batch_end`` and never synchronizes the GPU. A single step's host
    time can differ from its GPU time because kernels run asynchronously, but the host cannot run ahead of the GPU
    by more than a step (the optimizer step waits for the gradients), so the average over a window of several steps
    measures the real throughput.

    Args:
        window: Number of recent training batches the rates are averaged over. Larger is smoother but reacts
            later. The first ``window`` batches (which include warm-up) are not reported.
        peak_flops: Peak FLOP/s of one device at the training precision, the MFU denominator. Default: 989e12, the
            dense bf16 peak of an H100/H200 SXM. Use the peak of your GPU (e.g. 312e12 for an A100 in bf16); on a
            CPU the value is only indicative. ``None`` disables ``mfu``.
        num_params: Parameters used per token for the MFU. Default ``None``: every parameter of the LightningModule
            except embedding tables (a tied LM head counts), see :func:`matmul_params`. That overstates the FLOPs of
            mixture-of-experts models; pass their active (non-embedding) parameter count instead.
        prog_bar: Also show the values in the progress bar.
        profile_step: Optimizer step (``trainer.global_step``, 0-based) to record with ``torch.profiler``; the Chrome
            trace is written to ``<trainer.log_dir>/megatrain_trace.json`` (open it in https://ui.perfetto.dev or
            chrome://tracing to see H2D copies, compute and D2H copies overlap on their CUDA streams). Pick a step
            after warm-up, e.g. 3. Default ``None``: no profiling.
    """

    megatrain_reads_state = False  # reads the loss and the clock, no parameters: no wait for the optimizer step

    def __init__(
        self,
        window: int = 10,
        peak_flops: float | None = H100_BF16_PEAK_FLOPS,
        num_params: int | None = None,
        prog_bar: bool = True,
        profile_step: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}: must be an int >= 1 (e.g. 10)")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops={peak_flops!r}: must be a positive FLOP/s value (e.g. 989e12) or None")
        if num_params is not None and (not isinstance(num_params, int) or num_params < 1):
            raise ValueError(f"num_params={num_params!r}: must be a positive int or None")
        if profile_step is not None and (not isinstance(profile_step, int) or profile_step < 0):
            raise ValueError(f"profile_step={profile_step!r}: must be an int >= 0 or None")
        self.window = window
        self.peak_flops = peak_flops
        self.num_params = num_params
        self.prog_bar = prog_bar
        self.profile_step = profile_step
        self.trace_path: Path | None = None  # set once the trace is written
        self._model_params = 0
        self._ends: collections.deque[float] = collections.deque(maxlen=window + 1)  # batch-end times
        self._tokens: collections.deque[int] = collections.deque(maxlen=window + 1)  # tokens of those batches
        self._profiler: torch.profiler.profile | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model_params = self.num_params or matmul_params(pl_module)
        self._ends.clear()
        self._tokens.clear()
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.profile_step is None or self._profiler is not None or self.trace_path is not None:
            return
        if trainer.global_step == self.profile_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._ends.append(perf_counter())
        self._tokens.append(batch_tokens(batch))
        if self._profiler is not None and trainer.global_step > self.profile_step:
            self._write_trace(trainer)
        if len(self._ends) <= self.window:
            return
        elapsed = self._ends[-1] - self._ends[0]
        tokens = sum(self._tokens) - self._tokens[0]  # tokens of the batches that ended after the first timestamp
        metrics = {}
        if elapsed > 0:
            metrics["tokens_per_s"] = tokens / elapsed
            if self.peak_flops is not None:
                metrics["mfu"] = 6.0 * self._model_params * metrics["tokens_per_s"] / self.peak_flops
        rss = host_rss_gib()
        if rss is not None:
            metrics["host_rss_gib"] = rss
        device = trainer.strategy.root_device
        if device.type == "cuda":
            metrics["gpu_max_mem_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        for name, value in metrics.items():
            pl_module.log(name, float(value), prog_bar=self.prog_bar, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:  # training stopped inside the profiled step
            self._write_trace(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None

    def _write_trace(self, trainer: pl.Trainer) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if trainer.is_global_zero:
            os.makedirs(log_dir, exist_ok=True)
            path = log_dir / TRACE_FILE_NAME
            profiler.export_chrome_trace(str(path))
            self.trace_path = path
            rank_zero_info(f"ThroughputLogger: trace of step {self.profile_step} written to {path}")
