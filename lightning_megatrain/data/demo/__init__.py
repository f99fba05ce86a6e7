"""The bundled demo, in this folder: three small datasets in the formats ``SFTDataModule`` reads (registered in
``dataset_info.json``) and a byte-level BPE tokenizer trained on them. ``python -m
lightning_megatrain.data.demo.make_demo`` regenerates all of it."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent  # dataset_info.json and the datasets
DEMO_TOKENIZER_DIR = DEMO_DIR / "tokenizer"  # tokenizer.json and tokenizer_config.json
DEMO_DATA_FILES = ("demo_alpaca.json", "demo_sharegpt.json", "demo_messages.jsonl")  # alpaca, sharegpt, OpenAI messages
