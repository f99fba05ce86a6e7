"""``packed_sdpa`` (models/packed_attention.py): the mask builder's spans and fallbacks against transformers' dense
masks, the per-document attention against SDPA over the dense mask, the largest tensor a packed forward allocates,
``CausalLMModule``'s ``"auto"`` choice and its refusal of dense masks for long packed rows."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    or_masks,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from lightning_megatrain.models import CausalLMModule
from lightning_megatrain.models import packed_attention as pa

from helpers.dispatch import LargestTensor

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096)

# Two rows of 12 tokens: documents [0, 5), [5, 8), [8, 12) and [0, 2), [2, 12).
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4, [0] * 2 + [1] * 10])  # [B, T] document index
PACKED = packed_sequence_mask_function(DOCUMENTS)


def _dense(mask_function, batch_size: int = 2, length: int = 12, **kwargs) -> torch.Tensor:
    """transformers' dense ``[B, 1, T, T]`` mask, never skipped."""
    return sdpa_mask(batch_size=batch_size, q_length=length, kv_length=length, mask_function=mask_function,
                     allow_is_causal_skip=False, **kwargs)


def _from_spans(spans: pa.DocumentSpans) -> torch.Tensor:
    """The ``[B, 1, T, T]`` mask that ``spans`` stand for: causal within each document."""
    mask = torch.zeros(len(spans.starts), 1, spans.length, spans.length, dtype=torch.bool)
    for row in range(len(spans.starts)):
        for start, end in spans.spans(row):
            mask[row, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return mask


CASES = {  # name: (mask function, document starts of each row, or None where the dense mask is the answer)
    "causal": (causal_mask_function, ((0,), (0,))),
    "packed": (and_masks(causal_mask_function, PACKED), ((0, 5, 8), (0, 2))),
    "window longer than every document": (and_masks(sliding_window_causal_mask_function(10), PACKED),
                                          ((0, 5, 8), (0, 2))),
    "window shorter than a document": (and_masks(sliding_window_causal_mask_function(6), PACKED), None),
    "window shorter than the row": (sliding_window_causal_mask_function(6), None),
    "chunks": (chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)), ((0, 4, 8), (0, 4, 8))),
    "bidirectional": (bidirectional_mask_function, None),
    "bidirectional block": (or_masks(causal_mask_function, lambda b, h, q, kv: (q < 3) & (kv < 3)), None),
    "a key removed inside a document": (and_masks(causal_mask_function, PACKED, lambda b, h, q, kv: kv != 4), None),
}


@pytest.mark.parametrize("case", CASES)
def test_spans_stand_for_transformers_mask_or_the_dense_mask_is_returned(case, monkeypatch):
    mask_function, starts = CASES[case]
    dense = _dense(mask_function)
    if starts is not None:
        monkeypatch.setattr(pa, "sdpa_mask", None)  # a spans result must not build the dense mask
    # allow_is_causal_skip=False as transformers passes it for every mask but the plain causal one
    result = pa.document_spans_mask(batch_size=2, q_length=12, kv_length=12, mask_function=mask_function,
                                    allow_is_causal_skip=False)
    if starts is None:
        assert torch.equal(result, dense)
        return
    assert isinstance(result, pa.DocumentSpans) and result.starts == starts
    assert torch.equal(_from_spans(result), dense)
    flat = [row * 12 + start for row, row_starts in enumerate(starts) for start in row_starts]
    assert result.cu_seqlens.tolist() == [*flat, 24] and result.cu_seqlens.dtype == torch.int32


def test_padding_and_cache_offsets_get_sdpa_mask():
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, 9:] = False
    result = pa.document_spans_mask(batch_size=2, q_length=12, kv_length=12, attention_mask=padding)
    torch.testing.assert_close(result, _dense(causal_mask_function, attention_mask=padding))
    full = pa.document_spans_mask(batch_size=2, q_length=12, kv_length=12, attention_mask=padding[:1].expand(2, -1))
    assert isinstance(full, pa.DocumentSpans) and full.starts == ((0,), (0,))
    decode = pa.document_spans_mask(batch_size=2, q_length=1, kv_length=12, q_offset=11)
    assert not isinstance(decode, pa.DocumentSpans)


def test_dense_fallback_warns_from_the_limit(monkeypatch, caplog):
    monkeypatch.setattr(pa, "DENSE_MASK_LIMIT", 2 * 12 * 12)
    # the package logs to its own handler when the application configured none (lightning_megatrain/__init__.py)
    monkeypatch.setattr(logging.getLogger("lightning_megatrain"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="lightning_megatrain"):
        pa.document_spans_mask(batch_size=2, q_length=12, kv_length=12, mask_function=bidirectional_mask_function,
                               allow_is_causal_skip=False)
    assert "dense [2, 1, 12, 12] boolean one sdpa uses" in caplog.text


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_per_document_equals_sdpa_over_the_dense_mask(kv_heads):
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4 // kv_heads, True
    query = torch.randn(2, 4, 12, 8, requires_grad=True)  # [B, H, T, D]
    key, value = (torch.randn(2, kv_heads, 12, 8, requires_grad=True) for _ in range(2))  # [B, H_kv, T, D]
    spans = pa.document_spans_mask(batch_size=2, q_length=12, kv_length=12, mask_function=CASES["packed"][0])
    out, _ = pa.packed_sdpa_attention_forward(module, query, key, value, spans, scaling=0.5)  # [B, T, H, D]
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    expected, _ = sdpa_attention_forward(module, query, key, value, _dense(CASES["packed"][0]), scaling=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for grad, want in zip(grads, torch.autograd.grad(expected.square().sum(), (query, key, value))):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn, dense", [(pa.PACKED_SDPA, False), ("sdpa", True)])
def test_a_packed_row_allocates_no_t_by_t_tensor(attn, dense):
    """Forward and backward of one row of 4096 tokens in 16 documents; sdpa is the control that allocates T x T."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA), attn_implementation=attn)
    length = 4096
    position_ids = torch.arange(length)[None] % 256  # [1, T], a document every 256 tokens
    input_ids = torch.randint(0, 128, (1, length))
    with LargestTensor() as largest:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.sum().backward()
    assert (largest.max_numel >= length * length) == dense, f"largest tensor: {largest.max_numel:,} elements"


def _build(**kwargs) -> CausalLMModule:
    module = CausalLMModule(**kwargs)
    module.configure_model()
    return module


@pytest.mark.parametrize("requested, model_type, resolved", [
    ("auto", "llama", pa.PACKED_SDPA),  # transformers picks sdpa, upgraded
    ("auto", "gpt_oss", "eager"),  # no sdpa in transformers: its own fallback stays
    ("sdpa", "llama", "sdpa"),  # an explicit choice is kept
])
def test_auto_upgrades_sdpa_to_packed_sdpa(requested, model_type, resolved):
    config = {**LLAMA, "model_type": model_type}
    if model_type == "gpt_oss":
        config.update(num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"] * 2)
    assert _build(config=config, attn_implementation=requested).model.config._attn_implementation == resolved


def _packed_batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    position_ids = (torch.arange(length) % 100).expand(rows, -1)  # [B, T], a document every 100 tokens
    return {"input_ids": torch.zeros(rows, length, dtype=torch.long), "position_ids": position_ids}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_long_packed_rows_with_a_dense_mask_are_refused(attn):
    module = _build(config=LLAMA, attn_implementation=attn)
    module.on_before_batch_transfer(_packed_batch(1, 32767), 0)  # 1 GiB less 64K: allowed
    with pytest.raises(ValueError, match=r"builds a dense \[B, 1, T, T\].*2 x 32768 tokens needs 2,147,483,648"):
        module.on_before_batch_transfer(_packed_batch(2, 32768), 0)
    unpacked = {"input_ids": torch.zeros(2, 32768, dtype=torch.long), "position_ids": torch.arange(32768)[None]}
    module.on_before_batch_transfer(unpacked, 0)  # one document per row: no packed mask


def test_long_packed_rows_pass_with_auto():
    _build(config=LLAMA).on_before_batch_transfer(_packed_batch(2, 32768), 0)


def test_flash_attention_with_several_packed_rows_is_refused():
    assert "separates packed documents only in a batch of one row" in pa.packed_batch_problem("flash_attention_2", 2, 8)
    assert pa.packed_batch_problem("flash_attention_2", 1, 1 << 20) is None
    assert pa.packed_batch_problem(pa.PACKED_SDPA, 8, 1 << 20) is None
