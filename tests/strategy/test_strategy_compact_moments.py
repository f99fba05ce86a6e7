"""CompactAdamW with fp32 weights and 8-bit moments under MegaTrainStrategy, as a user's own optimizer: it runs as
given on the host fp32 masters (10 host bytes of state per parameter instead of 16), tracks AdamW, and its
checkpoints resume bit for bit."""

from __future__ import annotations

import lightning as L
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.optim import CompactAdamW

from helpers.parity import ParityLM
from helpers.trainers import cpu_trainer


class Int8MomentsLM(ParityLM):
    def configure_optimizers(self):
        return CompactAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, weights="fp32", moments="int8",
                            compile=False)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(module_cls, root, steps, ckpt_path=None, checkpoint=False):
    L.seed_everything(0)
    module, losses = module_cls("qwen3"), Losses()
    callbacks = [losses] + ([L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)] if checkpoint else [])
    # one batch per epoch: every step sees the same batch, so a resumed run sees what the uninterrupted one does
    # whichever batch Lightning resumes from (the data loader is not resumable)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(), max_steps=steps, default_root_dir=root, limit_train_batches=1,
                          enable_checkpointing=checkpoint, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer.optimizers[0], losses.losses


def test_int8_moments_train_through_the_strategy_and_resume_exactly(tmp_path):
    """6 steps with 8-bit moments: the loss stays within 0.5% of AdamW's at every step (lr 1e-2, the loss falls);
    2 steps, a checkpoint, and 4 more from it end on the same masters and 8-bit states, bit for bit."""
    module, opt, losses = _fit(Int8MomentsLM, tmp_path / "full", 6)
    _, _, reference = _fit(ParityLM, tmp_path / "adamw", 6)
    assert reference[-1] < reference[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=5e-3, atol=0)
    state = opt.state[next(module.parameters())]
    assert state["exp_avg"].dtype == torch.int8 and state["exp_avg_sq"].dtype == torch.uint8

    _fit(Int8MomentsLM, tmp_path / "resumed", 2, checkpoint=True)
    resumed, opt2, _ = _fit(Int8MomentsLM, tmp_path / "resumed", 6, ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    for (name, a), b in zip(module.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(module.parameters(), resumed.parameters()):
        for key, value in opt.state[a].items():
            assert torch.equal(value, opt2.state[b][key]), key
