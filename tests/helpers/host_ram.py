"""Peak host RAM of a checkpoint save or load, measured through Linux's ``/proc/self`` (tests/test_checkpoint_io.py,
tests/test_sharded_checkpoints.py)."""

from __future__ import annotations

import gc
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

MEASURABLE = os.access("/proc/self/clear_refs", os.W_OK)  # resetting the peak needs Linux's /proc/self/clear_refs


def exact_rss() -> None:
    """Make every allocation of 1 MiB or more its own mapping, returned to the system when freed (glibc's
    ``M_MMAP_THRESHOLD``; otherwise the threshold grows after frees and a freed block is reused unseen by the RSS).
    For this process for good: call it in a child process."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ``RssAnon``) in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def reset_peak() -> int:
    """Set the peak RSS (``VmHWM``) to the RSS now and return it."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    return status_bytes("VmRSS")


class Wide(L.LightningModule):
    """6.8M parameters, 6.3M of them in 6 streamed layers: a 78 MiB checkpoint (fp32 masters and both Adam moments)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 1024)
        self.blocks = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(6))
        self.head = nn.Linear(1024, 256)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch)  # [B, T, 1024]
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch.flatten())

    def train_dataloader(self):
        return DataLoader(torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SaveAndMeasure(L.Callback):
    """Saves at the last step and measures the process's peak RSS above its RSS before the save (``extra``)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step < trainer.max_steps:
            return
        trainer.strategy.wait_for_optimizer()
        before = reset_peak()
        trainer.save_checkpoint(self.path)
        self.extra = status_bytes("VmHWM") - before


class LoadAndMeasure(L.Callback):
    """Measures a resume: the peak RSS from ``on_fit_start`` (after the strategy's setup, before Lightning restores
    the checkpoint) to ``on_train_start`` (restored, the loaded checkpoint released) above the RSS before
    (``extra``), and the anonymous memory it left (``kept``: the optimizer states it loaded)."""

    def on_fit_start(self, trainer, pl_module):
        gc.collect()  # earlier runs' garbage, which would lower the RSS during the measurement
        self.anon = status_bytes("RssAnon")
        self.before = reset_peak()

    def on_train_start(self, trainer, pl_module):
        self.extra = status_bytes("VmHWM") - self.before
        self.kept = status_bytes("RssAnon") - self.anon
