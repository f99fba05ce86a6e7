"""LLaMA-Factory-compatible data: ``SFTDataModule`` (SFT / pretraining), ``PreferenceDataModule`` (pairs for DPO),
demo datasets and a demo tokenizer."""

from lightning_megatrain.data.collate import PackedCollator, PadCollator, PairCollator, pack_examples
from lightning_megatrain.data.datamodule import SFTDataModule
from lightning_megatrain.data.demo import DEMO_DIR, DEMO_TOKENIZER_DIR
from lightning_megatrain.data.encoding import IGNORE_INDEX, Example, PairExample, TemplateError
from lightning_megatrain.data.formats import Conversation, DatasetFormatError, PreferencePair
from lightning_megatrain.data.preference import PreferenceDataModule
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
    "PairCollator",
    "PairExample",
    "PreferenceDataModule",
    "PreferencePair",
    "SFTDataModule",
    "TemplateError",
    "build_demo_tokenizer",
    "pack_examples",
]
