"""Add MegaTrain to an existing Lightning project: one import and one Trainer argument.

The LightningModule below is ordinary user code, written without MegaTrain in mind: it wraps a HuggingFace causal
LM built in ``__init__``, computes ``model(...).loss`` in ``training_step`` and returns plain AdamW from
``configure_optimizers``. Switching it to MegaTrain changes two lines (marked ``# MegaTrain``):

    import lightning_megatrain                            # registers strategy="megatrain"
    trainer = L.Trainer(strategy="megatrain", ...)        # was: L.Trainer(...)

The strategy finds the decoder layers (here ``model.model.layers``), keeps fp32 weights, gradients and AdamW states
in host RAM, streams the layers through the device and replaces AdamW with a host (CPU) AdamW.

    python examples/existing_project.py                   # 40 steps, GPU if there is one
    python examples/existing_project.py --max-steps 3 --accelerator cpu
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, LlamaConfig

import lightning_megatrain  # noqa: F401  # MegaTrain: registers strategy="megatrain"

VOCAB = 256
SEQ = 64


class CountingSequences(Dataset):
    """Sequences ``s, s+k, s+2k, ... (mod VOCAB)``: easy to learn, so the loss falls within a few dozen steps."""

    def __init__(self, n: int = 512, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)  # [n, 1]
        step = torch.randint(1, 8, (n, 1), generator=gen)  # [n, 1]
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB  # [n, SEQ]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index]}


class MyCausalLM(L.LightningModule):
    """A user's module: any ``AutoModelForCausalLM`` and the HF loss."""

    def __init__(self, learning_rate: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            use_cache=False,
        )
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--root-dir", default="out/existing_project", help="logs and checkpoints go here")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="megatrain",  # MegaTrain: the only change to the Trainer call
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.max_steps,
        log_every_n_steps=5,
        default_root_dir=args.root_dir,
    )
    trainer.fit(MyCausalLM(), DataLoader(CountingSequences(), batch_size=8, shuffle=True))
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    print(f"done: global_step={trainer.global_step} train_loss={metrics['train_loss']:.3f}")
    return metrics


if __name__ == "__main__":
    main()
