"""CUDA: ``packed_sdpa``'s flash varlen path against SDPA per document and over transformers' dense mask, and packed
documents kept apart through the streamed engine by ``packed_sdpa`` (fp32: SDPA per document; bf16: flash varlen)
and by ``flex_attention`` (its ``BlockMask`` crosses the layers' forward and their recompute in backward).

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    sdpa_mask,
)

from lightning_megatrain.models import packed_attention as pa

from helpers.gpu import gpu_strategy
from helpers.packing import CONFIGS, isolation, probe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_equals_sdpa_per_document_and_over_the_dense_mask(kv_heads, monkeypatch):
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 8 // kv_heads, True
    lengths = [[100, 37, 300, 75], [512]]  # two rows of 512 tokens
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).cuda()  # [B, T]
    mask_function = and_masks(causal_mask_function,
                              packed_sequence_mask_function(find_packed_sequence_indices(position_ids)))
    spans = pa.document_spans_mask(batch_size=2, q_length=512, kv_length=512, mask_function=mask_function,
                                   device="cuda")
    assert spans.starts == ((0, 100, 137, 437), (0,)) and spans.cu_seqlens.tolist() == [0, 100, 137, 437, 512, 1024]
    query = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # [B, H, T, D]
    key, value = (torch.randn(2, kv_heads, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))  # [B, H_kv, T, D]
    grad_out = torch.randn(2, 512, 8, 64, device="cuda", dtype=torch.bfloat16)  # [B, T, H, D]

    def run(attention, mask):
        out, _ = attention(module, query, key, value, mask, scaling=0.125)
        return [out, *torch.autograd.grad(out, (query, key, value), grad_out)]

    calls = []
    varlen = pa._varlen_attn
    monkeypatch.setattr(pa, "_varlen_attn", lambda *args, **kwargs: calls.append(1) or varlen(*args, **kwargs))
    got = run(pa.packed_sdpa_attention_forward, spans)
    assert calls, "bf16 on CUDA must take the varlen path"
    monkeypatch.setattr(pa, "_varlen_attn", None)
    per_document = run(pa.packed_sdpa_attention_forward, spans)
    dense = run(sdpa_attention_forward, sdpa_mask(batch_size=2, q_length=512, kv_length=512, device="cuda",
                                                  mask_function=mask_function, allow_is_causal_skip=False))
    for reference in (per_document, dense):  # output, d query, d key, d value
        errors = [_relative(a, b) for a, b in zip(got, reference)]
        assert max(errors) < 1e-2, errors  # bf16 rounding: ~3e-3; a document seeing another: ~0.3


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("attn, precision, tolerance", [
    (pa.PACKED_SDPA, "32-true", 1e-4),  # SDPA per document
    (pa.PACKED_SDPA, "bf16-mixed", 2e-2),  # one flash varlen call per layer
    ("flex_attention", "32-true", 1e-4),  # transformers' BlockMask
])
def test_packed_documents_stay_apart_through_the_engine(arch, attn, precision, tolerance, monkeypatch):
    masks, varlen_calls = [], []
    attention = AttentionInterface._global_mapping[attn]

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(type(attention_mask).__name__)
        return attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, attn, spy)
    varlen = pa._varlen_attn
    monkeypatch.setattr(pa, "_varlen_attn", lambda *args, **kwargs: varlen_calls.append(1) or varlen(*args, **kwargs))
    module = probe(arch, attn_implementation=attn, config={"head_dim": 16})  # flex attention needs 16 or more
    result = isolation(module, gpu_strategy, accelerator="cuda", precision=precision)
    assert set(masks) == {"DocumentSpans" if attn == pa.PACKED_SDPA else "BlockMask"}
    assert bool(varlen_calls) == (precision == "bf16-mixed")
    assert result.worst_loss_error() <= tolerance * 10  # token losses are about 5
    assert result.worst_grad_error() <= tolerance
