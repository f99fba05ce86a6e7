"""Packed rows around one document ``X`` through ``Trainer(strategy=MegaTrainStrategy())``: the per-token losses
(predict) and, per row layout, the gradient of the loss on ``X``'s tokens alone (one training step at lr 0, read in
``on_before_optimizer_step``). ``tests/data/test_packing_isolation.py`` runs it on the CPU,
``tests/models/test_gpu_packed_attention.py`` on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data.collate import PackedCollator
from lightning_megatrain.data.encoding import IGNORE_INDEX, Example
from lightning_megatrain.models import CausalLMModule

VOCAB = 128
_TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
CONFIGS = {"llama": {"model_type": "llama", **_TINY}, "qwen3": {"model_type": "qwen3", **_TINY}}


def document(length: int, seed: int, trained: bool = True) -> Example:
    """``length`` random tokens, all trained or none."""
    ids = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Example(ids, ids if trained else [IGNORE_INDEX] * length)


X = document(9, seed=0)  # the document whose losses and gradient are compared
_A, _B, _C = document(6, 1, trained=False), document(11, 2, trained=False), document(4, 3, trained=False)
_D, _E = document(13, 4, trained=False), document(5, 5, trained=False)
ROWS = {  # row layouts with X; only X is trained, so the loss and its gradient are X's alone
    "packed": [_A, X, _B, _C],
    "permuted": [_C, _B, X, _A],  # the same other documents in another order (X moves too)
    "replaced": [_D, _E, X],  # other documents, of other lengths and tokens
    "alone": [X],
}
COLLATE = PackedCollator(pad_token_id=0, pad_to_multiple_of=32)  # a padding tail: one more pseudo-document


def x_span(row: list[Example]) -> slice:
    """Where ``X`` sits in ``row``."""
    start = sum(len(example) for example in row[: row.index(X)])
    return slice(start, start + len(X))


class Probe(CausalLMModule):
    """``CausalLMModule`` whose ``predict_step`` returns the per-token losses ``[B, T]``."""

    def predict_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self._loss(batch, reduction="none")[0]


class Grads(Callback):
    """Every parameter's ``.grad`` at each optimizer step, in fp32 on the CPU."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({n: p.grad.detach().float().cpu() for n, p in pl_module.named_parameters()
                           if p.grad is not None})


def probe(arch: str, **kwargs) -> Probe:
    """A ``Probe`` of ``arch`` at lr 0, so the weights of every step are the same."""
    torch.manual_seed(0)
    return Probe(config={**CONFIGS[arch], **kwargs.pop("config", {})}, learning_rate=0.0, weight_decay=0.0, **kwargs)


@dataclass
class Isolation:
    """Per row layout of ``ROWS``: ``X``'s per-token losses ``[n]`` and the gradient of its loss."""

    losses: dict[str, torch.Tensor]
    grads: dict[str, dict[str, torch.Tensor]]

    def worst_loss_error(self) -> float:
        """Largest absolute difference of ``X``'s token losses from ``X`` alone."""
        return max(float((loss - self.losses["alone"]).abs().max()) for loss in self.losses.values())

    def worst_grad_error(self) -> float:
        """Largest norm-wise relative difference of a parameter's gradient from ``X`` alone's."""
        reference = self.grads["alone"]
        return max(float((grad[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-30))
                   for grad in self.grads.values() for n in reference)


def isolation(module: Probe, strategy: Callable[[], MegaTrainStrategy] = MegaTrainStrategy,
              **trainer_kwargs) -> Isolation:
    """Train one step per row layout (lr 0) and predict each, under ``strategy()``."""
    batches = {name: COLLATE([row]) for name, row in ROWS.items()}
    kwargs = dict(devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, **trainer_kwargs)
    grads = Grads()
    Trainer(strategy=strategy(), max_steps=len(batches), callbacks=[grads], **kwargs).fit(
        module, train_dataloaders=DataLoader(list(batches.values()), batch_size=None)
    )
    assert len(grads.steps) == len(batches)
    predicted = Trainer(strategy=strategy(), **kwargs).predict(
        module, DataLoader(list(batches.values()), batch_size=None)
    )  # per row layout: [1, T]
    losses = {name: loss[0, x_span(ROWS[name])].float().cpu() for name, loss in zip(batches, predicted)}
    return Isolation(losses, dict(zip(batches, grads.steps)))
