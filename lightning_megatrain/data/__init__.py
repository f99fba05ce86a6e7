"""LLaMA-Factory-compatible SFT / pretraining data: ``SFTDataModule``, a demo dataset and a demo tokenizer."""

from lightning_megatrain.data.collate import PackedCollator, PadCollator, pack_examples
from lightning_megatrain.data.datamodule import SFTDataModule
from lightning_megatrain.data.demo import DEMO_DIR, DEMO_TOKENIZER_DIR
from lightning_megatrain.data.encoding import IGNORE_INDEX, Example, TemplateError
from lightning_megatrain.data.formats import Conversation, DatasetFormatError
from lightning_megatrain.data.tokenizer import build_demo_tokenizer

__all__ = [
    "DEMO_DIR",
    "DEMO_TOKENIZER_DIR",
    "IGNORE_INDEX",
    "Conversation",
    "DatasetFormatError",
    "Example",
    "PackedCollator",
    "PadCollator",
    "SFTDataModule",
    "TemplateError",
    "build_demo_tokenizer",
    "pack_examples",
]
