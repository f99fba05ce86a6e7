"""Compiled layers mark the batch and sequence dims dynamic from the first call (engine/compiled.py, [Note: compiled
layers]): one graph per grad mode serves every shape, whatever shapes came before, so a resumed run or a second run
in the process gets the kernels of the uninterrupted one."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaModel

from lightning_megatrain.engine.compiled import compile_layer_forward

# (B, T): B == T first (duck sizing must not tie them), others, the first again, B of 1 (specialized: a graph of its
# own, the same one whatever came before)
SHAPES = [(6, 6), (3, 40), (2, 24), (6, 6), (1, 24)]


def _model() -> LlamaModel:
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=2, vocab_size=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaModel(config)
    forward = compile_layer_forward(type(model.layers[0]).forward)
    for layer in model.layers:
        layer.forward = functools.partial(forward, layer)
    return model


def _run(model: LlamaModel, shape: tuple[int, int], grad: bool) -> list[torch.Tensor]:
    b, t = shape
    generator = torch.Generator().manual_seed(b * 1000 + t)
    ids = torch.randint(256, (b, t), generator=generator)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 0] = 0  # a padded token: the layers get a [B, 1, T, T] mask
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    if not grad:
        return [out]
    out.backward(torch.randn(out.shape, generator=generator))
    return [out.detach()] + [p.grad for p in model.layers.parameters()]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_one_graph_serves_every_shape_whatever_came_before(grad):
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    results = [_run(model, shape, grad) for shape in SHAPES]
    # one graph for B >= 2 from the first call on (not a static one, then a dynamic one), one for B == 1
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"]
    # the first shape again: the same kernels, the same numbers
    for a, b in zip(results[0], results[3]):
        assert torch.equal(a, b)
    # a shape after others as a fresh process computes it
    torch._dynamo.reset()
    for a, b in zip(results[2], _run(_model(), SHAPES[2], grad)):
        assert torch.equal(a, b)
