"""Compact host state runs (``host_state="compact"`` / ``"compact_kahan"``) and their plain PyTorch reference.

:func:`bf16_loop` is the reference: the same HF model (``ParityLM("qwen3")``) with every *parameter* rounded to bf16
(buffers such as the rotary frequencies stay fp32, as the engine leaves them) and held as bf16 masters on the host;
each step uploads them into the model on ``device``, runs the micro-batches there under bf16 autocast with
``(loss / accumulate).backward()`` (autograd sums the bf16 ``.grad`` across micro-batches, one rounding per add),
takes clipping's factor from the fp32 sum of the grads' squares, and applies the compact kernel (``adamw_update``)
to each master on the host with that factor as ``grad_scale`` and the stochastic-rounding seed ``mix_seed(0, step,
position of the parameter in the optimizer)``, as ``CompactAdamW.step`` derives it; the LR follows ParityLM's
StepLR (``1e-2 * 0.5**step``).
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.optim.compact_adam import adamw_update, new_state
from lightning_megatrain.optim.rounding import mix_seed

from helpers.parity import MICRO_BATCH, ParityLM, make_data
from helpers.trainers import cpu_trainer

WEIGHTS = {"compact": "bf16_sr", "compact_kahan": "bf16_kahan"}
LR, WD, GAMMA = 1e-2, 0.1, 0.5  # ParityLM's AdamW and its StepLR (scheduler=True)


class Losses(L.Callback):
    """Each micro-batch's loss (undivided by the accumulation)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)


def fit_engine(host_state: str, *, accumulate: int, clip: float | None, overlap: bool, steps: int = 3,
               accelerator: str = "cpu", callbacks=(), **options):
    """``steps`` steps of ``ParityLM("qwen3", scheduler=True)`` under ``MegaTrainStrategy(host_state=...)`` with
    bf16-mixed: the HF model, the optimizer and each micro-batch's loss."""
    L.seed_everything(0, verbose=False)
    module, record = ParityLM("qwen3", scheduler=True), Losses()
    strategy = MegaTrainStrategy(host_state=host_state, overlap_optimizer=overlap, **options)
    trainer = cpu_trainer(strategy=strategy, accelerator=accelerator, max_steps=steps,
                          accumulate_grad_batches=accumulate, gradient_clip_val=clip, precision="bf16-mixed",
                          callbacks=[record, *callbacks])
    trainer.fit(module)
    return module.model, trainer.optimizers[0], record.losses


def bf16_loop(host_state: str, *, accumulate: int, clip: float | None, steps: int = 3, device: str = "cpu"):
    """The reference of the module docstring: the bf16 masters (CPU), each micro-batch's loss, each step's factor."""
    L.seed_everything(0, verbose=False)
    model = ParityLM("qwen3").model
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.to(device)
    params = list(model.parameters())  # configure_optimizers' order: the seeds' positions
    masters = [p.detach().cpu().clone() for p in params]
    states = [new_state(w, WEIGHTS[host_state], "int8") for w in masters]
    data, losses, coefs, micro = make_data(), [], [], 0
    for step in range(steps):
        for p, w in zip(params, masters):
            p.data.copy_(w)
            p.grad = None
        for _ in range(accumulate):
            batch = data[micro * MICRO_BATCH : (micro + 1) * MICRO_BATCH].to(device)
            micro += 1
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, cache_enabled=False):
                loss = model(input_ids=batch, labels=batch).loss
            (loss / accumulate).backward()
            losses.append(float(loss.detach()))
        grads = [None if p.grad is None else p.grad.cpu() for p in params]
        coef = 1.0
        if clip is not None:
            norm = torch.stack([g.float().square().sum() for g in grads if g is not None]).sum().sqrt()
            coef = float(torch.clamp(clip / (norm + 1e-6), max=1.0))
        coefs.append(coef)
        with torch.no_grad():
            for k, (w, g, state) in enumerate(zip(masters, grads, states)):
                if g is not None:
                    adamw_update(w.view(-1), g.reshape(-1), state, lr=LR * GAMMA**step, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=WD, decoupled=True, weights=WEIGHTS[host_state], moments="int8",
                                 seed=mix_seed(0, step + 1, k), grad_scale=coef, compile=True)
    return masters, losses, coefs


def max_relative_error(model: torch.nn.Module, masters: list[torch.Tensor]) -> tuple[float, str]:
    """The largest per-tensor ``||a - b|| / ||b||`` between ``model``'s parameters and ``masters``, and its name."""
    errors = [(float((p.detach().cpu().float() - w.float()).norm() / w.float().norm()), name)
              for (name, p), w in zip(model.named_parameters(), masters)]
    return max(errors)
