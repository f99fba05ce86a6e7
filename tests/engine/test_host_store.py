"""Host store: flat packing, gradient accumulation semantics and the clipping helpers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.host_store import pack_group


def _group(*shapes):
    module = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in shapes)
    values = [p.detach().clone() for p in module]
    return pack_group(tensor_slots(module), pin_memory=False), values


def test_pack_keeps_values_and_makes_views():
    group, values = _group((3, 4), (5,), (2, 2))
    for p, v in zip(group.params, values):
        assert torch.equal(p, v)
        assert p.untyped_storage().data_ptr() == group.master.untyped_storage().data_ptr()


def test_accumulate_copy_then_add_and_none_untouched():
    group, _ = _group((3, 4), (5,))
    a, b = torch.ones(3, 4), torch.full((5,), 2.0)
    group.accumulate([a, None])
    assert torch.equal(group.params[0].grad, a) and group.params[1].grad is None
    group.accumulate([a, b])
    assert torch.equal(group.params[0].grad, 2 * a) and torch.equal(group.params[1].grad, b)
    assert group.grads_are_views()


@pytest.mark.parametrize("shapes", [[(3, 4), (5,)], [(40, 40), (1000,)]])  # below and above the 1024-row split
def test_norm_and_scale_match_torch(shapes):
    group, _ = _group(*shapes)
    grads = [torch.randn(s) for s in shapes]
    group.accumulate([g.clone() for g in grads])
    expected = torch.stack([g.norm() for g in grads]).norm()
    torch.testing.assert_close(group.grad_norm_sq().sqrt(), expected, rtol=1e-6, atol=0)
    group.scale_grads(torch.tensor(0.5))
    for p, g in zip(group.params, grads):
        torch.testing.assert_close(p.grad, 0.5 * g)


def test_norm_skips_parameters_without_grad():
    group, _ = _group((3, 4), (5,))
    g = torch.randn(3, 4)
    group.accumulate([g, None])
    torch.testing.assert_close(group.grad_norm_sq(), g.square().sum())
