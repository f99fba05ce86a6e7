"""Batch collation: dynamic right padding, and packing of several examples into one row.

Padded batch (``packing=False``)::

    input_ids       LongTensor [B, T]  pad_token_id after each sequence
    attention_mask  LongTensor [B, T]  1 on real tokens, 0 on padding
    labels          LongTensor [B, T]  -100 on padding and untrained tokens

Preference batch (``PairCollator``): a padded batch of ``2B`` rows, the ``B`` chosen sequences first and the ``B``
rejected ones after them, plus ``pair_index`` ``LongTensor [B]`` (each pair's ``PairExample.index``).

Packed batch (``packing=True``)::

    input_ids       LongTensor [B, T]  several examples back to back, then padding
    position_ids    LongTensor [B, T]  restart at 0 at every example (and at the padding tail)
    labels          LongTensor [B, T]  first token of every example and all padding set to -100

A packed batch deliberately has no ``attention_mask``: transformers 5.x then derives per-sequence attention
from ``position_ids`` (``masking_utils.find_packed_sequence_indices``, used by ``create_causal_mask`` only when
the 2D attention mask is ``None`` and no KV cache is passed, so call the model with ``use_cache=False``).
The padding tail is its own pseudo-sequence with positions ``0..p-1``, so real tokens never attend to it.
``packed_sdpa`` attends within each sequence without building the mask (see [Note: packed attention] in
``models/packed_attention.py``), with the sequences' starts read from these host ``position_ids`` when the batch moves
to the device ([Note: host document spans] in ``models/document_spans.py``).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import torch

from lightning_megatrain.data.encoding import IGNORE_INDEX, Example, PairExample


def _padded_length(length: int, multiple: int | None) -> int:
    return length if not multiple else -(-length // multiple) * multiple


class PadCollator:
    """Collate examples into a right-padded batch (see the module docstring for the format).

    Args:
        pad_token_id: Id written into padded ``input_ids`` positions (masked out by ``attention_mask``).
        pad_to_multiple_of: Round the padded length ``T`` up to a multiple of this (``None``: longest in batch).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        length = _padded_length(max(len(example) for example in examples), self.pad_to_multiple_of)
        input_ids = torch.full((len(examples), length), self.pad_token_id, dtype=torch.long)  # [B, T]
        labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(examples), length), dtype=torch.long)  # [B, T]
        for row, example in enumerate(examples):
            n = len(example)
            input_ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)  # [n]
            labels[row, :n] = torch.tensor(example.labels, dtype=torch.long)  # [n]
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PairCollator:
    """Collate preference pairs into one right-padded batch of ``2B`` rows: chosen ``0..B-1``, rejected ``B..2B-1``.

    Both responses of a pair then run in one forward. Args as :class:`PadCollator`.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad = PadCollator(pad_token_id, pad_to_multiple_of)

    def __call__(self, pairs: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        batch = self.pad([pair.chosen for pair in pairs] + [pair.rejected for pair in pairs])  # [2B, T] each
        batch["pair_index"] = torch.tensor([pair.index for pair in pairs], dtype=torch.long)  # [B]
        return batch


class PackedCollator:
    """Collate packed rows (each a list of examples) into a batch with restarting ``position_ids``.

    Args:
        pad_token_id: Id written into the padding tail of shorter rows.
        pad_to_multiple_of: Round the padded length ``T`` up to a multiple of this (``None``: longest row).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: Sequence[Sequence[Example]]) -> dict[str, torch.Tensor]:
        lengths = [sum(len(example) for example in row) for row in rows]
        length = _padded_length(max(lengths), self.pad_to_multiple_of)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)  # [B, T]
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)  # [B, T]
        position_ids = torch.zeros((len(rows), length), dtype=torch.long)  # [B, T]
        for row_index, row in enumerate(rows):
            start = 0
            for example in row:
                end = start + len(example)
                input_ids[row_index, start:end] = torch.tensor(example.input_ids, dtype=torch.long)  # [n]
                labels[row_index, start + 1 : end] = torch.tensor(example.labels[1:], dtype=torch.long)  # [n-1]
                position_ids[row_index, start:end] = torch.arange(len(example))  # [n]
                start = end
            position_ids[row_index, start:] = torch.arange(length - start)  # [T - used], padding pseudo-sequence
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def pack_examples(examples: Sequence[Example], capacity: int) -> list[list[Example]]:
    """Pack examples into rows of at most ``capacity`` tokens (best-fit decreasing, deterministic).

    Examples are placed longest first, each into the open row whose free space fits it most tightly, so rows
    come out nearly full. Ties keep input order, so the result depends only on the input order.

    Args:
        examples: Examples no longer than ``capacity`` tokens.
        capacity: Row length in tokens (``cutoff_len``).

    Returns:
        Rows, each a list of examples in placement order.

    Raises:
        ValueError: If an example is longer than ``capacity``.
    """
    order = sorted(range(len(examples)), key=lambda index: -len(examples[index]))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free tokens, row index) of rows that still have room
    for index in order:
        size = len(examples[index])
        if size > capacity:
            raise ValueError(f"example {index} has {size} tokens, more than the packing capacity {capacity}")
        slot = bisect_left(free, (size, -1))
        if slot == len(free):
            rows.append([index])
            remaining, row = capacity - size, len(rows) - 1
        else:
            remaining, row = free.pop(slot)
            rows[row].append(index)
            remaining -= size
        if remaining > 0:
            insort(free, (remaining, row))
    return [[examples[index] for index in row] for row in rows]
