"""Observability for MegaTrain runs: ``ThroughputLogger`` (tokens/s, MFU, host RSS, GPU peak memory, one-step trace),
and the ``megatrain`` CLI's console output: ``FitSummary`` (where the run's files are), ``StepProgressBar`` and
``ParamSummary``."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from time import perf_counter
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary, RichProgressBar
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from torch import Tensor, nn

from lightning_megatrain._hardware import GIB, device_peak_flops, host_rss_gib

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
    return int(_count(batch))


def _count(batch: Any) -> int | Tensor:
    """:func:`batch_tokens`, as a 0-dim tensor on the mask's device where there is a mask."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return 0
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else batch["input_ids"].numel()


class _PendingCount:
    """A batch's token count on its way from a CUDA device to pinned host memory: the copy is queued behind the batch's
    work on the current stream, which records ``copied``; :meth:`value` waits for that event only (a batch later it
    has long completed), never for the whole device as ``int(tensor)`` would."""

    def __init__(self, count: Tensor) -> None:
        self.host = torch.empty((), dtype=count.dtype, pin_memory=True)
        self.host.copy_(count, non_blocking=True)
        stream = torch.cuda.current_stream(count.device)  # the batch's work and the copy's
        self.copied: torch.cuda.Event | None = torch.cuda.Event()  # recorded by that stream; value() waits for it
        self.copied.record(stream)
        self.count = 0  # the count, once value() has read it

    def value(self) -> int:
        if self.copied is not None:  # read once: each later window reuses it
            self.copied.synchronize()
            self.copied, self.count = None, int(self.host)
        return self.count


def _pending(batch: Any) -> int | _PendingCount:
    count = _count(batch)
    if isinstance(count, Tensor) and count.device.type == "cuda":
        return _PendingCount(count)
    return int(count)


class ThroughputLogger(Callback):
    """Logs training throughput and memory to the progress bar and the logger, and can profile one step.

    Logged every training batch once ``window + 1`` batches have been timed (the logger writes them every
    ``Trainer(log_every_n_steps)``):

    - ``tokens_per_s``: real tokens (``attention_mask`` sum, else ``input_ids`` numel) of the ``window`` batches
      before the current one divided by the wall time they took (the current batch's count is still on the GPU).
    - ``mfu``: model FLOPs utilisation, ``6 * num_params * tokens_per_s / peak_flops``. 6N FLOPs per token is the
      forward (2N) plus backward (4N) matmul cost of a dense transformer with N non-embedding parameters (Kaplan et
      al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1; PaLM, Chowdhery et al. 2022, appendix B);
      attention-score FLOPs and MegaTrain's layer recompute (which makes the hardware do about 8N) are not
      counted, as in PaLM's MFU.
    - ``host_rss_gib``: resident memory of this process (``VmRSS`` of ``/proc/self/status``; Linux only).
    - ``gpu_max_mem_gib``: ``torch.cuda.max_memory_allocated`` of the training device, when it is a CUDA GPU.

    Timing uses ``time.perf_counter`` at ``on_train_batch_end`` and never synchronizes the GPU: a batch's token
    count on the GPU comes to the host by a copy queued behind its work, read a batch later. A single step's host
    time can differ from its GPU time because kernels run asynchronously, but the host cannot run ahead of the GPU
    by more than a step (the optimizer step waits for the gradients), so the average over a window of several steps
    measures the real throughput.

    Args:
        window: Number of recent training batches the rates are averaged over. Larger is smoother but reacts
            later. The first ``window + 1`` batches (which include warm-up) are not reported.
        peak_flops: Peak FLOP/s of one device at the training precision, the MFU denominator. Default ``"auto"``: the
            dense bf16 peak of the training GPU when ``_hardware.GPU_BF16_PEAK_FLOPS`` knows it (989e12 for an
            H100/H200, 312e12 for an A100), else no ``mfu`` (a CPU or an unlisted GPU). A number is used as given;
            ``None`` disables ``mfu``.
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
        peak_flops: float | Literal["auto"] | None = "auto",
        num_params: int | None = None,
        prog_bar: bool = True,
        profile_step: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}: must be an int >= 1 (e.g. 10)")
        if peak_flops not in (None, "auto") and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ValueError(f"peak_flops={peak_flops!r}: must be a positive FLOP/s value (e.g. 989e12), auto or None")
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
        # batch-end times and the tokens of those batches: the window and the batch after it
        self._ends: collections.deque[float] = collections.deque(maxlen=window + 2)
        self._tokens: collections.deque[int | _PendingCount] = collections.deque(maxlen=window + 2)
        self._profiler: torch.profiler.profile | None = None
        self._peak_flops: float | None = None  # peak_flops with "auto" resolved for the training device

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model_params = self.num_params or matmul_params(pl_module)
        self._ends.clear()
        self._tokens.clear()
        device = trainer.strategy.root_device
        self._peak_flops = device_peak_flops(device) if self.peak_flops == "auto" else self.peak_flops
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
        self._tokens.append(_pending(batch))
        if self._profiler is not None and trainer.global_step > self.profile_step:
            self._write_trace(trainer)
        if len(self._ends) <= self.window + 1:
            return
        # the window ends at the batch before this one, whose count has landed on the host (this one's is queued
        # behind its backward): the tokens of the batches that ended after the window's first timestamp
        elapsed = self._ends[-2] - self._ends[0]
        tokens = sum(c if isinstance(c, int) else c.value() for c in list(self._tokens)[1:-1])
        metrics = {}
        if elapsed > 0:
            metrics["tokens_per_s"] = tokens / elapsed
            if self._peak_flops is not None:
                metrics["mfu"] = 6.0 * self._model_params * metrics["tokens_per_s"] / self._peak_flops
        rss = host_rss_gib()
        if rss is not None:
            metrics["host_rss_gib"] = rss
        device = trainer.strategy.root_device
        if device.type == "cuda":
            metrics["gpu_max_mem_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        for name, value in metrics.items():  # host tensors: a Python number would become a tensor on the
            # module's device (LightningModule.log), a blocking copy behind the step's work
            pl_module.log(name, torch.tensor(float(value)), prog_bar=self.prog_bar, on_step=True, on_epoch=False,
                          batch_size=1)

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


class FitSummary(Callback):
    """Records the first ``train_loss``; :meth:`lines` then say how the loss went and where the run's files are.

    The ``megatrain`` CLI adds it and logs the lines once ``fit`` returned (after the progress bar's last render):
    ``train_loss`` at the first and the last optimizer step (and the last ``val_loss``), the checkpoint to resume from
    or export (``ModelCheckpoint``'s ``last.ckpt``, else its best, else that none was written) with the
    ``megatrain export`` command, and the logger's folder (``metrics.csv``, ``config.yaml``, a profiler trace).
    """

    megatrain_reads_state = False  # reads logged metrics and paths, no parameters

    def __init__(self) -> None:
        super().__init__()
        self.first_loss: tuple[int, float] | None = None  # (optimizer step, train_loss) of the first step logged

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if self.first_loss is None and loss is not None:
            self.first_loss = (trainer.global_step, float(loss))

    def lines(self, trainer: pl.Trainer) -> list[str]:
        """The summary, one string per line."""
        lines = []
        metrics = trainer.callback_metrics
        if self.first_loss is not None and "train_loss" in metrics:
            step, loss = self.first_loss
            line = f"megatrain: train_loss {loss:.3f} at step {step} -> {float(metrics['train_loss']):.3f} at step "
            line += f"{trainer.global_step}"
            if "val_loss" in metrics:
                line += f" (val_loss {float(metrics['val_loss']):.3f})"
            lines.append(line)
        checkpoint = _checkpoint_path(trainer)
        if checkpoint is None:
            lines.append("megatrain: no checkpoint written (add a ModelCheckpoint callback to keep the weights)")
        else:
            lines.append(f"megatrain: checkpoint {checkpoint} (resume: --ckpt_path {checkpoint})")
            lines.append(f"megatrain: export to a HuggingFace folder: megatrain export {checkpoint} OUT_DIR")
        if trainer.logger is not None and trainer.log_dir is not None:
            lines.append(f"megatrain: logs in {trainer.log_dir}")
        return lines


def _checkpoint_path(trainer: pl.Trainer) -> str | None:
    """``last.ckpt`` of the first ``ModelCheckpoint`` that wrote one, else its best checkpoint; None if none."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            path = callback.last_model_path or callback.best_model_path
            if path:
                return path
    return None


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar without a bogus epoch total: a run bounded by ``max_steps`` (``max_epochs=-1``,
    as in the demo) shows ``Epoch 1`` where Lightning shows ``Epoch 1/-2``; the logger's ``v_num`` is left out."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the log folder's version: FitSummary names the folder at the end
        return metrics

    def _get_train_description(self, current_epoch: int) -> str:  # the one place RichProgressBar names the epoch
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 1:
            description = description.replace(f"/{max_epochs - 1}", "", 1)
        return description


class ParamSummary(ModelSummary):
    """Lightning's text model summary without the FLOPs column and ``Total FLOPs`` line when it measured none (it
    measures them only for a module with an ``example_input_array``, so a CausalLMModule shows ``0``)."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
            )
            return
        columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
        widths = [max([len(name), *(len(v) for v in values)]) for name, values in columns]
        rows = [[name for name, _ in columns], *zip(*(values for _, values in columns))]
        table = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
        rule = "-" * max(len(line) for line in table)
        lines = [table[0], rule, *table[1:], rule]
        lines.append(f"{get_human_readable_count(trainable_parameters):<10} Trainable params")
        lines.append(f"{get_human_readable_count(total_parameters - trainable_parameters):<10} Non-trainable params")
        lines.append(f"{model_size:<10.3f} Total estimated model params size (MB)")
        rank_zero_info("\n" + "\n".join(lines))
