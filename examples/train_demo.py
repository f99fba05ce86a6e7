"""Train a tiny Llama on the bundled demo chat data with ``Trainer(strategy="megatrain")``: the library as plain Python.

This is ``megatrain fit --config configs/demo.yaml`` without the CLI: build the LightningModule and the DataModule,
pass ``strategy="megatrain"`` to the Trainer. Runs on a CPU in well under a minute; on a CUDA machine it uses the GPU.

    python examples/train_demo.py                      # 60 steps
    python examples/train_demo.py --max-steps 5 --accelerator cpu --root-dir /tmp/demo

Afterwards ``megatrain export <root-dir>/checkpoints/last.ckpt out/demo-hf`` turns the checkpoint into a
HuggingFace model folder.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_megatrain  # noqa: F401  (registers strategy="megatrain")
from lightning_megatrain.callbacks import ThroughputLogger
from lightning_megatrain.data import DEMO_TOKENIZER_DIR, SFTDataModule
from lightning_megatrain.models import CausalLMModule

# A 4-layer Llama sized for the demo tokenizer (1024 tokens; ids 0/1/2 = pad/bos/eos).
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--accelerator", default="auto", help='"auto" (GPU if any, else CPU), "cuda" or "cpu"')
    parser.add_argument("--root-dir", default="out/train_demo", help="logs and checkpoints (default out/train_demo)")
    args = parser.parse_args(argv)

    L.seed_everything(42)
    # One tokenizer for model and data: the data is encoded with it and it is saved with exported checkpoints.
    tokenizer = str(DEMO_TOKENIZER_DIR)
    model = CausalLMModule(config=TINY_LLAMA, tokenizer=tokenizer, learning_rate=3e-3, warmup_steps=5)
    data = SFTDataModule(
        dataset="demo_alpaca,demo_sharegpt,demo_messages",
        tokenizer=tokenizer,
        cutoff_len=256,
        micro_batch_size=8,
    )
    on_gpu = args.accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available()
    trainer = L.Trainer(
        strategy="megatrain",  # <- the whole integration: weights, grads and Adam in host RAM, layers streamed
        accelerator=args.accelerator,
        devices=1,
        precision="bf16-mixed" if on_gpu else "32-true",
        max_steps=args.max_steps,
        log_every_n_steps=5,
        default_root_dir=args.root_dir,
        logger=CSVLogger(args.root_dir, name="logs"),
        callbacks=[
            ModelCheckpoint(dirpath=f"{args.root_dir}/checkpoints", save_last=True),
            ThroughputLogger(window=5),
        ],
    )
    trainer.fit(model, data)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    print(f"done: global_step={trainer.global_step} train_loss={metrics['train_loss']:.3f} "
          f"tokens/s={metrics.get('tokens_per_s', float('nan')):.0f} checkpoint={args.root_dir}/checkpoints/last.ckpt")
    return metrics


if __name__ == "__main__":
    main()
