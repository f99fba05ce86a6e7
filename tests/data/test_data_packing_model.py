"""Packed rows through a real transformers model: no attention crosses sequence boundaries.

transformers 5.x isolates packed sequences from ``position_ids`` only when the 2D ``attention_mask`` is None
and no KV cache exists, so the model is called with ``use_cache=False`` (LlamaConfig defaults to
``use_cache=True``, which would build a DynamicCache and silently disable the packed-sequence mask).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_megatrain.data import IGNORE_INDEX, SFTDataModule


@pytest.fixture(scope="module")
def packed_module() -> SFTDataModule:
    module = SFTDataModule("demo_sharegpt", packing=True, cutoff_len=256, micro_batch_size=2)
    module.setup()
    return module


def _model(vocab_size: int, attn_implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logits_equal_each_sequence_alone(packed_module, attn_implementation):
    model = _model(len(packed_module.tokenizer), attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    multi = [row for row in packed_module.train_dataset if len(row) >= 2]  # rows packing several sequences
    rows = [max(multi, key=len), min(multi, key=lambda row: sum(map(len, row)))]  # most sequences, emptiest
    batch = packed_module.collator(rows)
    assert sum(map(len, rows[1])) < batch["input_ids"].shape[1], "the second row must have a padding tail"
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        for row_index, row in enumerate(rows):  # packed: [B, T, V]
            start = 0
            for example in row:
                alone = model(input_ids=torch.tensor([example.input_ids])).logits[0]  # [n, V]
                torch.testing.assert_close(packed[row_index, start : start + len(example)], alone, atol=1e-5, rtol=0)
                start += len(example)


def test_packed_loss_equals_token_weighted_loss_of_sequences(packed_module):
    model = _model(len(packed_module.tokenizer), "sdpa")
    row = packed_module.train_dataset[0]
    batch = packed_module.collator([row])
    with torch.no_grad():
        packed_loss = model(**batch, use_cache=False).loss
        total, count = 0.0, 0
        for example in row:
            labels = torch.tensor([example.labels])  # [1, n]
            targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += model(input_ids=torch.tensor([example.input_ids]), labels=labels).loss * targets
            count += targets
    assert int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) == count
    torch.testing.assert_close(packed_loss, total / count, atol=1e-5, rtol=1e-5)
