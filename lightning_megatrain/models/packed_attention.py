"""``packed_sdpa``: scaled-dot-product attention run per packed document, without a ``[B, 1, T, T]`` mask.

[Note: packed attention]
A packed batch (``data/collate.py``) has ``position_ids`` restarting at 0 for every document and no
``attention_mask``. transformers' ``masking_utils.create_causal_mask`` then finds the documents
(``find_packed_sequence_indices``), composes ``mask_function`` = causal AND same document, and hands it to the mask
builder registered for the attention implementation: ``sdpa_mask`` broadcasts it into a dense boolean
``[B, 1, T, T]`` tensor (256 GiB for one row of 512K tokens), ``eager_mask`` into a float one, and
``flex_attention_mask`` compiles it into a ``BlockMask`` (no dense mask, but flex attention has no backward on the
CPU and needs ``torch.compile`` to build the mask without materialising it).

``packed_sdpa`` registers a mask builder and an attention function under one name (transformers'
``AttentionMaskInterface`` and ``AttentionInterface``; the name contains "sdpa", so transformers accepts it only for
models that support SDPA):

- ``document_spans_mask`` evaluates ``mask_function`` on O(B*T) (query, key) pairs instead of B*T*T: each token
  against itself, the next token, the previous token, the first token of its document and the token before that. A
  token that cannot see the previous one starts a document. When every token sees itself and the first token of its
  document, none sees the next token nor the token before its document, the mask is causal within whole documents and
  blocks everything else, and the builder returns ``DocumentSpans`` (each row's document starts). Every composition
  transformers makes for causal LMs out of index functions (causal, packed documents, sliding windows, chunks) lets a
  query see an interval of keys ending at itself whose start never moves back, so these pairs decide it exactly: a
  sliding window longer than every document passes, a shorter one fails; chunk borders become document starts.
  Otherwise (a 2D ``attention_mask`` with padding, a window shorter than a document, bidirectional overlays, custom
  ``or``/``and`` mask functions, KV-cache offsets) it returns ``sdpa_mask``'s result, exactly what ``sdpa`` gets, and
  warns when that dense mask takes ``DENSE_MASK_LIMIT`` bytes or more. Where the transfer of the batch bound the
  spans read from its host ``position_ids`` ([Note: host document spans] in ``document_spans.py``), the builder
  returns those and checks the probes against them on the device, reading nothing back; without bound spans
  (position_ids made on the device, a module with its own transfer hook) it reads the probes and the starts to the
  host, once per forward.
- ``packed_sdpa_attention_forward`` attends causally within each document, without a mask: rows of one document go
  to transformers' ``sdpa_attention_forward`` whole; packed rows on a GPU in fp16/bf16 go to torch's flash varlen
  kernel (``torch.nn.attention.varlen.varlen_attn``), all documents of the batch in one call; elsewhere (the CPU,
  fp32, attention dropout) ``sdpa_attention_forward`` runs on each document alone with ``is_causal=True`` and the
  outputs are concatenated. Memory is linear in the document length either way. Given a tensor mask or ``None`` it
  is ``sdpa_attention_forward`` itself.

The spans reach the decoder layers as their ``attention_mask`` argument: a Python object, so the streamed engine
keeps it as a non-tensor input of each layer for the recompute (``engine/streamed.py``), and compiled layers
(``compile_layers``) break their graph around the attention of packed rows instead of recompiling for every batch
layout.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from lightning_megatrain.models import document_spans
from lightning_megatrain.models.document_spans import DocumentSpans, take_bound_spans

try:  # torch's flash varlen attention (CUDA, fp16/bf16), the GPU path for packed rows
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # older torch: sdpa per document on the GPU as well
    _varlen_attn = None
# Whether varlen_attn takes grouped key/value heads (torch 2.13 does, 2.11 does not: keys and values are repeated then)
_VARLEN_GQA = _varlen_attn is not None and "enable_gqa" in inspect.signature(_varlen_attn).parameters

log = logging.getLogger(__name__)

PACKED_SDPA = "packed_sdpa"  # the attn_implementation name registered by register()
AUTO = "auto"  # CausalLMModule's default: transformers' own choice, with "sdpa" upgraded to PACKED_SDPA

# A dense [B, 1, T, T] boolean mask of this many bytes or more (one row of 32K tokens) is refused for packed rows
# under "sdpa"/"eager" (packed_batch_problem) and warned about when packed_sdpa must fall back to it.
DENSE_MASK_LIMIT = 1 << 30

# Implementations whose transformers mask builder materialises the mask densely: sdpa (bool) and eager (float).
_DENSE_MASK_IMPLEMENTATIONS = ("sdpa", "eager")


def _dense_fallback(reason: str, batch_size: int, q_length: int, kv_length: int, **kwargs: Any) -> Tensor | None:
    """``sdpa_mask``'s result, as ``sdpa`` gets it; warns when it is dense and takes ``DENSE_MASK_LIMIT`` or more."""
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, **kwargs)
    if mask is not None and mask.numel() >= DENSE_MASK_LIMIT:
        log.warning("%s: %s, so the attention mask is the dense [%d, 1, %d, %d] boolean one sdpa uses (%.1f GiB).",
                    PACKED_SDPA, reason, batch_size, q_length, kv_length, mask.numel() / 2**30)
    return mask


def document_spans_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: Tensor | None = None,
    allow_is_causal_skip: bool = False,  # transformers passes it: True where it found nothing packed
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> DocumentSpans | Tensor | None:
    """``packed_sdpa``'s mask builder (the ``sdpa_mask`` signature): ``DocumentSpans`` where the mask is causal
    within whole documents, else ``sdpa_mask``'s result. See [Note: packed attention]."""
    bound = take_bound_spans()  # host spans of the position_ids this mask is built from ([Note: host document spans])
    dense = dict(q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                 allow_is_causal_skip=allow_is_causal_skip, use_vmap=use_vmap, device=device, **kwargs)
    if allow_is_causal_skip:  # transformers found no packed documents: exactly sdpa's mask (None for plain causal
        # rows), without the probes below and their reads to the host on every forward
        return _dense_fallback("no packed documents", batch_size, q_length, kv_length, **dense)
    if q_length != kv_length or not (isinstance(q_offset, int) and isinstance(kv_offset, int)) or q_offset or kv_offset:
        return _dense_fallback("queries and keys are offset (KV cache)", batch_size, q_length, kv_length, **dense)
    if use_vmap:  # custom or/and mask functions: not guaranteed to broadcast over index tensors
        return _dense_fallback("the model adds its own mask functions", batch_size, q_length, kv_length, **dense)
    if attention_mask is not None and not bool(attention_mask[:, -kv_length:].all()):  # reads the device
        return _dense_fallback("the batch has padding", batch_size, q_length, kv_length, **dense)

    starts, causal_documents = _probe(mask_function, batch_size, q_length, device)
    if attention_mask is None and _bound_spans_apply(bound, batch_size, q_length, kwargs.get("config")):
        return _checked_on_device(bound, starts, causal_documents)
    if not bool(causal_documents):
        return _dense_fallback("the mask is not causal within whole documents (a sliding window or chunk shorter than "
                               "a document, or bidirectional attention)", batch_size, q_length, kv_length, **dense)
    row_index, position = starts.nonzero(as_tuple=True)  # [N] each, row-major
    flat_starts = row_index * q_length + position  # [N] offsets into the B * T flattened tokens
    cu_seqlens = torch.cat([flat_starts, flat_starts.new_full((1,), batch_size * q_length)]).to(torch.int32)
    per_row: list[list[int]] = [[] for _ in range(batch_size)]
    for row, start in zip(row_index.tolist(), position.tolist()):  # row-major, so starts come out sorted
        per_row[row].append(start)
    return DocumentSpans(tuple(tuple(starts) for starts in per_row), q_length, cu_seqlens)


def _probe(mask_function: Callable, batch_size: int, length: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``mask_function`` on the O(B*T) probe pairs of [Note: packed attention], on ``device``, read nowhere: the
    document starts it implies ``[B, T]`` (bool) and whether it is causal within whole documents ``[]`` (bool)."""

    def allowed(q: Tensor, kv: Tensor) -> Tensor:  # [B, T] bool: may query q see key kv
        return mask_function(rows, head, q, kv).expand(batch_size, length)

    rows = torch.arange(batch_size, device=device)[:, None]  # [B, 1]
    head = torch.zeros((1, 1), dtype=torch.long, device=device)
    q = torch.arange(length, device=device)[None, :]  # [1, T]
    prev = (q - 1).clamp(min=0)  # [1, T]
    starts = ~allowed(q, prev) | (q == 0)  # [B, T]: cannot see the previous token, or the first (no Python value
    # written into a device tensor)
    first = torch.where(starts, q, 0).cummax(dim=1).values  # [B, T] first position of each token's document
    before = first - 1  # [B, T] the last token of the previous document, -1 in the first one
    nxt = (q + 1).clamp(max=length - 1)  # [1, T]
    not_last = q < length - 1  # [1, T]
    causal_documents = (
        allowed(q, q).all()
        & allowed(q, first).all()
        & ~(allowed(q, nxt) & not_last).any()
        & ~(allowed(q, before.clamp(min=0)) & (before >= 0)).any()
    )  # []
    return starts, causal_documents


def _bound_spans_apply(spans: DocumentSpans | None, batch_size: int, length: int, config: Any) -> bool:
    """Whether there are bound ``spans`` and the host alone can tell that the mask is causal within their documents:
    they cover the batch, and neither bidirectional attention nor a window or chunk of the ``config`` cuts a document
    (the probes would find that: a sliding window shorter than a document gets the dense mask). See [Note: host
    document spans]."""
    if spans is None or config is None or not getattr(config, "is_causal", True):
        return False
    if len(spans.starts) != batch_size or spans.length != length:
        return False
    limits = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size")]
    return all(not isinstance(limit, int) or limit >= spans.max_length for limit in limits)


# torch's CUDA kernel of ``_assert_async`` copies its message into a 256-byte argument and raises on the host, before
# launching, for a message of 255 bytes or more ("Message length must be smaller than 255",
# aten/src/ATen/native/cuda/TensorCompare.cu, ``Msg::MAX_MSG_LENGTH``); the CPU kernel takes any length.
DEVICE_ASSERT_MESSAGE_LIMIT = 255

# What a failed check on the device means; on a GPU it surfaces as a device-side assert at the next sync. Shorter than
# DEVICE_ASSERT_MESSAGE_LIMIT bytes.
_SPANS_DISAGREE = (
    f"{PACKED_SDPA}: transformers' mask is not causal within the documents read from the host position_ids "
    "([Note: host document spans], lightning_megatrain/models/document_spans.py). "
    "HINT: use attn_implementation='sdpa'."
)


def _checked_on_device(spans: DocumentSpans, starts: Tensor, causal_documents: Tensor) -> DocumentSpans:
    """``spans``, with the probes' ``starts`` ``[B, T]`` and ``causal_documents`` ``[]`` checked against them on the
    device without a read to the host (``torch._assert_async``)."""
    batch_size, length = starts.shape
    cu_seqlens = spans.cu_seqlens.to(starts.device)
    expected = torch.zeros(batch_size * length, dtype=torch.bool, device=starts.device)  # [B*T]
    expected.index_fill_(0, cu_seqlens[:-1].long(), True)
    agree = causal_documents & (starts == expected.view(batch_size, length)).all()  # []
    torch._assert_async(agree, _SPANS_DISAGREE)
    return spans


def _compute_dtype(query: Tensor) -> torch.dtype:
    """The dtype SDPA computes ``query`` in: autocast's where it is on (SDPA casts to it), else the query's."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def _varlen_applies(query: Tensor, key: Tensor, value: Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether torch's flash varlen kernel computes what ``sdpa_attention_forward`` would per document (the same
    flash algorithm, up to rounding)."""
    return (
        _varlen_attn is not None
        and query.is_cuda
        and _compute_dtype(query) in (torch.float16, torch.bfloat16)
        and key.shape[-1] == value.shape[-1] == query.shape[-1] <= 256
        and query.shape[1] % key.shape[1] == 0
        and not kwargs.get("dropout")  # varlen_attn has no dropout
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
    )


def _attention_varlen(query: Tensor, key: Tensor, value: Tensor, spans: DocumentSpans, scaling: float | None) -> Tensor:
    """``[B, T, H, D]``: every document of the batch in one causal flash varlen call (in autocast's dtype, as SDPA;
    the custom op does not autocast by itself)."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    dtype = _compute_dtype(query)
    gqa = {}
    if heads != kv_heads and _VARLEN_GQA:
        gqa["enable_gqa"] = True
    elif heads != kv_heads:
        key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)  # [B, H, T, D]
        kv_heads = heads
    out = _varlen_attn(
        query.transpose(1, 2).reshape(batch * length, heads, dim).to(dtype),  # [B*T, H, D]
        key.transpose(1, 2).reshape(batch * length, kv_heads, dim).to(dtype),  # [B*T, H_kv, D]
        value.transpose(1, 2).reshape(batch * length, kv_heads, dim).to(dtype),  # [B*T, H_kv, D]
        spans.cu_seqlens,
        spans.cu_seqlens,
        spans.max_length,
        spans.max_length,
        scale=scaling,
        window_size=(-1, 0),  # causal
        **gqa,
    )  # [B*T, H, D]
    return out.view(batch, length, heads, dim)


@torch.compiler.disable  # the spans are Python ints: a compiled layer would recompile for every batch layout
def _attention_within_documents(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, spans: DocumentSpans, **kwargs: Any
) -> Tensor:
    """``[B, T, H, D]``: causal attention within each document of each row, without a mask: one flash varlen call
    on a GPU where it applies, else ``sdpa_attention_forward`` per document (one call per row of one document)."""
    kwargs["is_causal"] = True  # the builder checked it; decoders say so anyway
    if spans.whole_rows:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)[0]
    if _varlen_applies(query, key, value, kwargs):
        return _attention_varlen(query, key, value, spans, kwargs.get("scaling"))
    position_bias = kwargs.pop("position_bias", None)  # [B, H, T, T] where a model adds one
    rows = []
    for row in range(query.shape[0]):
        outputs = []
        for start, end in spans.spans(row):
            bias = None if position_bias is None else position_bias[row : row + 1, :, start:end, start:end]
            out, _ = sdpa_attention_forward(
                module,
                query[row : row + 1, :, start:end],  # [1, H, n, D]
                key[row : row + 1, :, start:end],  # [1, H_kv, n, D]
                value[row : row + 1, :, start:end],  # [1, H_kv, n, D]
                None,
                position_bias=bias,
                **kwargs,
            )  # [1, n, H, D]
            outputs.append(out)
        rows.append(torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0])  # [1, T, H, D]
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]  # [B, T, H, D]


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: DocumentSpans | Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``packed_sdpa``'s attention (the ``sdpa_attention_forward`` signature; ``query`` ``[B, H, T, D]``, ``key``
    and ``value`` ``[B, H_kv, T, D]``): per document for ``DocumentSpans``, else ``sdpa_attention_forward``.
    Returns ``([B, T, H, D], None)``. See [Note: packed attention]."""
    if not isinstance(attention_mask, DocumentSpans):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _attention_within_documents(module, query, key, value, attention_mask, **kwargs), None


def register() -> None:
    """Register ``packed_sdpa`` with transformers (idempotent); importing ``lightning_megatrain`` calls it."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
    AttentionMaskInterface.register(PACKED_SDPA, document_spans_mask)
    document_spans.install()


def hf_attn_implementation(requested: str) -> str | None:
    """The ``attn_implementation`` to build a model with: transformers' default (``None``) for ``"auto"``."""
    return None if requested == AUTO else requested


def apply_auto(model: Any, requested: str) -> None:
    """For ``"auto"``, switch a model transformers built with ``"sdpa"`` to ``packed_sdpa``."""
    if requested == AUTO and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(PACKED_SDPA)


def is_packed(position_ids: Tensor) -> bool:
    """Whether ``position_ids`` ``[B, T]`` restart inside a row (several documents packed into it)."""
    return bool((position_ids[:, 1:] != position_ids[:, :-1] + 1).any())


def packed_batch_problem(attn_implementation: str, batch_size: int, length: int) -> str | None:
    """What is wrong with feeding packed rows (``batch_size`` x ``length``, no ``attention_mask``) to a model with
    ``attn_implementation``, or ``None``.

    ``"sdpa"`` and ``"eager"`` build a dense ``[B, 1, T, T]`` mask (refused from ``DENSE_MASK_LIMIT`` bytes at one
    byte per entry, sdpa's bool; eager's float mask is larger); transformers' flash-attention paths find packed
    documents from ``position_ids`` only in a batch of one row, so larger batches would mix documents.
    """
    if attn_implementation in _DENSE_MASK_IMPLEMENTATIONS:
        entries = batch_size * length * length
        if entries >= DENSE_MASK_LIMIT:
            return (
                f"attn_implementation={attn_implementation!r} builds a dense [B, 1, T, T] attention mask for packed "
                f"rows: {batch_size} x {length} tokens needs {entries:,} entries ({entries / 2**30:.1f} GiB as "
                f"booleans, more as eager's floats). Use attn_implementation='{AUTO}' or '{PACKED_SDPA}', which runs "
                "SDPA per document without a mask, or shorter rows (data cutoff_len)."
            )
    elif attn_implementation.startswith("flash_attention") and batch_size > 1:
        return (
            f"attn_implementation={attn_implementation!r} separates packed documents only in a batch of one row "
            f"(transformers reads them from position_ids only then), got {batch_size} rows, whose documents would "
            f"attend to each other. Use micro_batch_size=1, or attn_implementation='{AUTO}' or '{PACKED_SDPA}'."
        )
    return None
