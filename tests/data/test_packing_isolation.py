"""Packed documents stay isolated through ``Trainer(strategy=MegaTrainStrategy())`` with ``packed_sdpa``.

One document ``X`` is packed between others; its per-token losses (predict) and the gradient of the loss on its
tokens alone (one training step, read in ``on_before_optimizer_step``) must not change when the other documents of its
row are permuted or replaced, and must equal those of ``X`` run alone. The forward runs through the streamed layers,
the gradient through their recompute in backward. ``CausalLMModule``'s default ``attn_implementation="auto"`` picks
``packed_sdpa`` ([Note: packed attention] in ``models/packed_attention.py``), and a spy on the attention checks that
packed rows reach it as ``DocumentSpans``, never as a tensor mask.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AttentionInterface

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data.encoding import IGNORE_INDEX
from lightning_megatrain.models import packed_attention as pa

from helpers.packing import COLLATE, CONFIGS, document, isolation, probe
from helpers.trainers import cpu_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*DeepSpeedCPUAdam is unavailable.*",
)


@pytest.fixture
def mask_spy(monkeypatch):
    """Every ``attention_mask`` the registered ``packed_sdpa`` attention receives."""
    seen: list = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return pa.packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, pa.PACKED_SDPA, spy)
    return seen


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_document_loss_and_gradient_ignore_the_rest_of_its_row(arch, mask_spy):
    module = probe(arch)
    result = isolation(module, accelerator="cpu")
    assert module.model.config._attn_implementation == pa.PACKED_SDPA
    assert {type(mask) for mask in mask_spy} == {pa.DocumentSpans}, "rows must reach the attention as spans"
    assert result.losses["alone"][1:].gt(0).all()  # the first token has no target (shifted labels)
    assert result.worst_loss_error() <= 1e-5
    # norm-wise, as tests/helpers/parity.py: the other documents add exact zeros, so only the summation order of X's
    # own contributions differs
    assert result.worst_grad_error() <= 1e-5


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_packed_loss_equals_each_document_alone(arch, mask_spy, transformers_finds):
    """Every document of a packed row (not only X) scores as it does alone, and the packed row's mean loss is the
    token-weighted mean of theirs. Control: the same row without restarting positions scores differently. Every
    batch's documents come bound from the transfer ([Note: host document spans]), none is read from the device."""
    row = [document(length, seed=10 + length) for length in (7, 12, 3, 9)]
    packed = COLLATE([row])
    alone = [COLLATE([[example]]) for example in row]
    unpacked = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1])[None]}
    module = probe(arch)
    losses = cpu_trainer(strategy=MegaTrainStrategy()).predict(
        module, DataLoader([packed, *alone, unpacked], batch_size=None)
    )
    # one mask per layer (2): the packed row's documents and padding tail, each document and its padding; the
    # control row, where transformers finds nothing packed, gets sdpa's own mask (None: plain causal attention)
    expected = [((0, 7, 19, 22, 31),), *[((0, len(example)),) for example in row], None]
    assert [getattr(mask, "starts", mask) for mask in mask_spy[::2]] == expected
    assert transformers_finds == []
    start, total, count = 0, 0.0, 0
    for example, loss in zip(row, losses[1:]):
        n = len(example)
        torch.testing.assert_close(losses[0][0, start : start + n], loss[0, :n], rtol=1e-5, atol=1e-6)
        total, count, start = total + float(loss.sum()), count + n - 1, start + n
    assert not torch.allclose(losses[-1][0, len(row[0]) : start], losses[0][0, len(row[0]) : start], atol=1e-3)
    packed_mean = float(losses[0].sum()) / int((packed["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert packed_mean == pytest.approx(total / count, rel=1e-5)
