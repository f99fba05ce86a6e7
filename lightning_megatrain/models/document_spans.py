"""The documents of packed rows, read from ``position_ids`` on the host before the batch moves to the device.

[Note: host document spans]
``packed_sdpa`` needs each packed row's document starts as Python ints (to slice documents, and for the flash varlen
kernel's ``max_seqlen``) and as ``cu_seqlens`` on the device. Derived from the device ``position_ids`` inside the
forward they cost reads back to the host (transformers' ``find_packed_sequence_indices`` tests whether anything is
packed, the mask builder reads its probes and the starts), each one a sync that stalls the CUDA stream until the work
queued before it is done. The batch holds the same facts on the host before it is moved, so they are read there:

- Binding: where the batch is moved to the device (``transfer_binding_spans``, called by
  ``CausalLMModule.transfer_batch_to_device`` and by ``MegaTrainStrategy.batch_to_device`` for modules that keep
  Lightning's transfer), the starts are read from the host ``position_ids`` (``host_document_starts``: the rule
  transformers applies, a position whose id is not its predecessor's + 1 starts a document), ``cu_seqlens`` is copied
  to the device without blocking, and the resulting ``DocumentSpans`` are bound to the moved ``position_ids`` tensor:
  its identity and version counter. Only the tensor that this very transfer produced is bound, so spans cannot go
  stale: a batch whose ``position_ids`` are replaced later gets no spans (today's path), and one modified in place
  fails the version check.
- Lookup: ``install`` replaces transformers' ``masking_utils.find_packed_sequence_indices``, which every mask builder
  of transformers calls with the model's ``position_ids``. For a bound tensor it returns the same value without the
  test on the device (``None`` where the host saw one document per row) and leaves the spans for the mask builder
  that follows in the same ``create_*_mask`` call (``take_bound_spans``); for any other tensor it is transformers'
  own function. The spans are found by the identity of the tensor the model was given, so they travel from the batch
  to the attention inside the HF forward without the user's module passing anything, under any strategy.
- The mask builder (``packed_attention.document_spans_mask``) returns the bound spans where it can decide on the host
  that transformers' mask is causal within whole documents (no padding, no KV-cache offsets, no custom mask
  functions, ``config.is_causal``, every document within the config's ``sliding_window`` and
  ``attention_chunk_size``), and checks its probes against them on the device without reading them back
  (``torch._assert_async``: on the CPU it raises at once, on a GPU a mismatch is a device-side assert; CUDA takes a
  message only under 255 bytes, ``packed_attention.DEVICE_ASSERT_MESSAGE_LIMIT``, and raises on the host for a longer
  one). Every op between the transfer and the attention is one that queues on the device without waiting for it (no
  ``bool``/``item``/``nonzero``, no Python value written into a device tensor). Anything else takes the path without
  bound spans, which reads the probes to the host.
- Right padding: a batch whose ``attention_mask`` only marks padding after each row's tokens (``right_padded``) runs
  without it where its module says so (``CAUSAL_ONLY``, set on the host by ``CausalLMModule`` and ``DPOModule``):
  causal attention already keeps each real token from the padding after it and no target is predicted from padding
  (labels a batch brings that train such targets keep the mask), so real tokens' outputs and the loss are the same,
  transformers builds no dense ``[B, 1, T, T]`` mask (and does not read the mask back to test it), and the batch's
  host ``position_ids`` (made there when it has none) are bound like a packed batch's.
- Recompute in backward, segments and sequence tiles reuse the ``DocumentSpans`` object the layers received in the
  forward (a non-tensor input of each layer, [Note: packed attention]); nothing is bound again for them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import masking_utils

from lightning_megatrain.models.loss import IGNORE_INDEX

POSITION_IDS = "position_ids"  # the batch key whose host tensor the spans are read from
CAUSAL_ONLY = "causal_only"  # batch flag, set on the host: the model runs without the batch's attention_mask


@dataclass(frozen=True)
class DocumentSpans:
    """The documents of each row of a batch, passed to the decoder layers in place of an attention mask.

    ``starts[b]`` holds the first position of each document of row ``b`` (beginning with 0); a document runs to the
    next start, the last one to ``length``. Attention is causal within a document and never crosses one.
    ``cu_seqlens`` (int32 ``[N + 1]``, on the model's device) are the same documents as offsets into the ``B * T``
    flattened tokens, for varlen kernels.
    """

    starts: tuple[tuple[int, ...], ...]
    length: int
    cu_seqlens: Tensor = field(compare=False, repr=False)

    def spans(self, row: int) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of each document of ``row``."""
        starts = self.starts[row]
        yield from zip(starts, (*starts[1:], self.length))

    @property
    def whole_rows(self) -> bool:
        """Every row is one document (plain causal attention)."""
        return all(len(starts) == 1 for starts in self.starts)

    @property
    def max_length(self) -> int:
        """Tokens in the longest document."""
        return max(end - start for row in range(len(self.starts)) for start, end in self.spans(row))

    @classmethod
    def on_device(cls, starts: tuple[tuple[int, ...], ...], length: int, device: torch.device) -> DocumentSpans:
        """Spans of rows of ``length`` tokens with host ``starts``; ``cu_seqlens`` is copied to ``device`` without
        blocking the host (through pinned memory, which the caching host allocator keeps until the copy is done)."""
        flat = [row * length + start for row, row_starts in enumerate(starts) for start in row_starts]
        cu_seqlens = torch.tensor([*flat, len(starts) * length], dtype=torch.int32)  # [N + 1]
        if device.type == "cuda":
            cu_seqlens = cu_seqlens.pin_memory().to(device, non_blocking=True)
        return cls(starts, length, cu_seqlens.to(device))


def host_document_starts(position_ids: Tensor) -> tuple[tuple[int, ...], ...]:
    """Each row's document starts, from host ``position_ids`` ``[B, T]``: position 0 and every position whose id is not
    its predecessor's + 1 (the rule of transformers' ``find_packed_sequence_indices``)."""
    breaks = position_ids[:, 1:] != position_ids[:, :-1] + 1  # [B, T-1]
    rows, positions = breaks.nonzero(as_tuple=True)  # [N - B] each, row-major
    starts: list[list[int]] = [[0] for _ in range(position_ids.shape[0])]
    for row, position in zip(rows.tolist(), positions.tolist()):
        starts[row].append(position + 1)
    return tuple(tuple(row) for row in starts)


@dataclass(frozen=True)
class _Binding:
    tensor: weakref.ref  # the moved position_ids; the entry goes when the tensor does
    version: int | None  # its version counter at binding (None for inference tensors, which have none)
    spans: DocumentSpans


_bindings: dict[int, _Binding] = {}  # id(position_ids) -> binding
# Spans that find_packed_sequence_indices found for the mask builder called next in the same create_*_mask call
_pending: ContextVar[DocumentSpans | None] = ContextVar("megatrain_pending_spans", default=None)


def _version(tensor: Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def bind(position_ids: Tensor, starts: tuple[tuple[int, ...], ...]) -> DocumentSpans:
    """Bind the spans of host ``starts`` to ``position_ids`` (``[B, T]``, the tensor the model will be given)."""
    spans = DocumentSpans.on_device(starts, position_ids.shape[1], position_ids.device)
    key = id(position_ids)

    def forget(ref: weakref.ref) -> None:
        if (entry := _bindings.get(key)) is not None and entry.tensor is ref:
            del _bindings[key]

    _bindings[key] = _Binding(weakref.ref(position_ids, forget), _version(position_ids), spans)
    return spans


def bound_spans(position_ids: Any) -> DocumentSpans | None:
    """The spans bound to this very ``position_ids`` tensor, unmodified since, or None."""
    if not isinstance(position_ids, Tensor) or torch.compiler.is_compiling():
        return None
    entry = _bindings.get(id(position_ids))
    if entry is None or entry.tensor() is not position_ids or _version(position_ids) != entry.version:
        return None
    return entry.spans


def transfer_binding_spans(batch: Any, transfer: Callable[[Any], Any]) -> Any:
    """``transfer(batch)``, with the spans of ``batch``'s host ``position_ids`` bound to the moved tensor where the
    batch is packed-eligible: a mapping with 2D integer ``position_ids`` on the CPU and no ``attention_mask``, or one
    the model does not read (``CAUSAL_ONLY``; with a mask transformers finds no packed documents). See [Note: host
    document spans]."""
    position_ids = batch.get(POSITION_IDS) if isinstance(batch, Mapping) else None
    eligible = (
        isinstance(position_ids, Tensor)
        and (batch.get("attention_mask") is None or bool(batch.get(CAUSAL_ONLY)))
        and position_ids.device.type == "cpu"
        and position_ids.dim() == 2
        and position_ids.numel() > 0
        and not position_ids.is_floating_point()
    )
    starts = host_document_starts(position_ids) if eligible else None
    moved = transfer(batch)
    moved_ids = moved.get(POSITION_IDS) if isinstance(moved, Mapping) else None
    if starts is not None and isinstance(moved_ids, Tensor) and moved_ids.shape == position_ids.shape:
        bind(moved_ids, starts)
    return moved


def right_padded(mask: Any) -> bool:
    """Whether ``mask`` ``[R, T]`` (on the host) is each row's real tokens then padding, as the collators pad."""
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.device.type != "cpu":
        return False
    positions = torch.arange(mask.shape[1])  # [T]
    return bool((mask.bool() == (positions < mask.sum(1, keepdim=True))).all())


def without_padding_mask(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` flagged ``CAUSAL_ONLY`` where its mask is right padding, it has no ``position_ids`` and no target is
    predicted from a padding position (``labels`` other than ``IGNORE_INDEX`` after padding: a padding query attends
    to other padding without the mask), with host ``position_ids`` ``[B, T]`` (0..T-1 in every row) for the transfer
    to bind; else ``batch``."""
    mask = batch.get("attention_mask")
    if POSITION_IDS in batch or batch.get(CAUSAL_ONLY) or not right_padded(mask):
        return batch
    labels = batch.get("labels")
    if isinstance(labels, Tensor) and bool(((labels[:, 1:] != IGNORE_INDEX) & (mask[:, :-1] == 0)).any()):
        return batch
    rows, length = mask.shape
    return {**batch, CAUSAL_ONLY: True, POSITION_IDS: torch.arange(length).expand(rows, length)}


def model_attention_mask(batch: Mapping[str, Any]) -> Tensor | None:
    """The ``attention_mask`` to call the model with: the batch's, or None for a ``CAUSAL_ONLY`` batch."""
    return None if batch.get(CAUSAL_ONLY) else batch.get("attention_mask")


def take_bound_spans() -> DocumentSpans | None:
    """The spans ``find_packed_sequence_indices`` found for the mask being built now, once."""
    spans = _pending.get()
    _pending.set(None)
    return spans


# transformers' own function (also where this module is imported again after install)
_transformers_find = getattr(masking_utils.find_packed_sequence_indices, "transformers_original",
                             masking_utils.find_packed_sequence_indices)


def find_packed_sequence_indices(position_ids: Tensor) -> Tensor | None:
    """transformers' ``find_packed_sequence_indices``, without reading the device for bound ``position_ids``: the
    same ``[B, T]`` document index, or None where the host saw one document per row."""
    spans = bound_spans(position_ids)
    _pending.set(spans)
    if spans is None:
        return _transformers_find(position_ids)
    if spans.whole_rows:
        return None
    breaks = torch.zeros_like(position_ids)  # [B, T]
    breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return breaks.cumsum(-1)  # [B, T] document index within each row


find_packed_sequence_indices.transformers_original = _transformers_find


def install() -> None:
    """Route transformers' mask builders through :func:`find_packed_sequence_indices` (idempotent)."""
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
