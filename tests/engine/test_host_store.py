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


def test_pinned_block_rounding_and_host_check(monkeypatch):
    from lightning_megatrain.engine import host_store

    assert host_store.pinned_block_bytes(402_653_184) == 536_870_912  # the H200 measurement
    assert host_store.pinned_block_bytes(1 << 20) == 1 << 20
    gib = 1024**3
    # 1.5 GiB of fp32 per group: 2 groups x (master + grad) = 6 GiB pageable, 8 GiB once rounded to 2 GiB blocks
    numels = [(3 * gib // 2) // 4] * 2
    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 4 * gib)
    host_store.check_host_memory(numels, fitting=False, pinned=False)  # needs 6 - 3 = 3 GiB
    with pytest.raises(RuntimeError, match=r"needs about 5.0 GiB more host RAM(.|\n)*pinned"):
        host_store.check_host_memory(numels, fitting=False, pinned=True)
