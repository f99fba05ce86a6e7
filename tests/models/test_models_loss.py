"""Chunked causal-LM loss: values and gradients vs the naive full-logits loss, and memory bounds.

Tolerances (fp32 on the CPU): against the naive loss, the loss to ``rtol=1e-5`` and gradients to ``1e-5`` of their
largest entry (fp32 cancellation in softmax - one-hot). The two chunk layouts of [Note: target rows] against each
other: the loss to ``rtol=1e-6`` and gradients to ``1e-6`` of their largest entry (seen: <= 1.2e-7 and <= 1.5e-7; the
same per-row math, sums in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_megatrain.models import causal_lm_loss
from lightning_megatrain.models.loss import _nll_and_grad, shift_labels, target_rows

from helpers.dispatch import LargestTensor

V, H = 97, 16


def naive_loss(hidden, weight, labels, softcap=None, ignore_index=-100):
    logits = hidden @ weight.t()  # [B, T, V]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    shift_logits = logits[:, :-1].float().reshape(-1, weight.shape[0])  # [B*(T-1), V]
    shift_labels = labels[:, 1:].reshape(-1)  # [B*(T-1)]
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index)


def make_inputs(batch, seq, *, seed=0, ignore_frac=0.3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, H, generator=gen, dtype=dtype).mul_(2.0)  # [B, T, H]
    weight = torch.randn(V, H, generator=gen, dtype=dtype)  # [V, H]
    labels = torch.randint(0, V, (batch, seq), generator=gen)  # [B, T]
    labels[torch.rand(batch, seq, generator=gen) < ignore_frac] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def grads(loss, hidden, weight):
    return torch.autograd.grad(loss, (hidden, weight))


def assert_grad_close(actual, expected, rel=1e-5):
    """Within ``rel`` of the gradient's largest entry (fp32 cancellation in softmax - onehot)."""
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * expected.abs().max().item())


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(("batch", "seq", "chunk_size"), [(1, 9, 4096), (3, 11, 7), (2, 16, 1)])
def test_matches_naive_loss_and_grads(batch, seq, chunk_size, softcap):
    hidden, weight, labels = make_inputs(batch, seq)
    expected = naive_loss(hidden, weight, labels, softcap=softcap)
    exp_gh, exp_gw = grads(expected, hidden, weight)

    loss = causal_lm_loss(hidden, weight, labels, chunk_size=chunk_size, softcap=softcap)
    gh, gw = grads(loss, hidden, weight)

    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert_grad_close(gh, exp_gh)
    assert_grad_close(gw, exp_gw)


@pytest.mark.parametrize("rows", [None, "all"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gradcheck_fp64(softcap, rows):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64).requires_grad_()  # [B, T, H]
    weight = torch.randn(11, 4, generator=gen, dtype=torch.float64).requires_grad_()  # [V, H]
    labels = torch.randint(0, 11, (2, 5), generator=gen)  # [B, T]
    labels[0, 2] = -100
    assert torch.autograd.gradcheck(
        lambda h, w: causal_lm_loss(h, w, labels, chunk_size=3, softcap=softcap, rows=rows), (hidden, weight)
    )


def test_custom_ignore_index_and_upstream_grad_scale():
    hidden, weight, labels = make_inputs(2, 10)
    labels[labels == -100] = 0
    expected = 3.0 * naive_loss(hidden, weight, labels, ignore_index=0)
    exp_gh, exp_gw = grads(expected, hidden, weight)

    loss = 3.0 * causal_lm_loss(hidden, weight, labels, chunk_size=5, ignore_index=0)
    gh, gw = grads(loss, hidden, weight)

    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert_grad_close(gh, exp_gh)
    assert_grad_close(gw, exp_gw)


@pytest.mark.parametrize("rows", [None, "all"])
def test_all_ignored_batch_gives_zero_loss_and_zero_grads(rows):
    hidden, weight, labels = make_inputs(2, 6)
    labels[:, 1:] = -100  # only the first position (never a target) keeps its label

    loss = causal_lm_loss(hidden, weight, labels, chunk_size=5, softcap=3.0, rows=rows)
    gh, gw = grads(loss, hidden, weight)

    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_no_grad_and_partial_requires_grad():
    hidden, weight, labels = make_inputs(2, 8)
    expected = naive_loss(hidden, weight, labels)
    with torch.no_grad():
        loss = causal_lm_loss(hidden, weight, labels)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)

    frozen_weight = weight.detach()
    loss = causal_lm_loss(hidden, frozen_weight, labels, chunk_size=3)
    (gh,) = torch.autograd.grad(loss, hidden)
    (exp_gh,) = torch.autograd.grad(naive_loss(hidden, frozen_weight, labels), hidden)
    assert_grad_close(gh, exp_gh)


@pytest.mark.parametrize("rows", [None, "all"])
def test_autocast_bf16_keeps_input_grad_dtypes(rows):
    hidden, weight, labels = make_inputs(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = causal_lm_loss(hidden, weight, labels, chunk_size=5, rows=rows)
        expected = naive_loss(hidden, weight, labels)  # bf16 logits, fp32 log-softmax
    gh, gw = grads(loss, hidden, weight)
    exp_gh, exp_gw = grads(expected, hidden, weight)

    assert loss.dtype == torch.float32
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0)
    torch.testing.assert_close(gh, exp_gh, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw, exp_gw, rtol=2e-2, atol=2e-3)


def test_bf16_inputs_give_bf16_grads():
    hidden, weight, labels = make_inputs(2, 12, dtype=torch.bfloat16)
    loss = causal_lm_loss(hidden, weight, labels, chunk_size=4)
    gh, gw = grads(loss, hidden, weight)
    assert loss.dtype == torch.float32
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [None, "all"])
def test_never_materialises_or_saves_full_logits(rows):
    batch, seq, chunk = 4, 64, 16  # N = 4 * 63 = 252 targets, V = 97
    hidden, weight, labels = make_inputs(batch, seq, ignore_frac=0.0)
    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LargestTensor() as mode:
        loss = causal_lm_loss(hidden, weight, labels, chunk_size=chunk, rows=rows)
        loss.backward()

    assert sorted(saved_shapes) == sorted([(batch, seq, H), (V, H)])
    assert mode.max_numel <= max(chunk * V, batch * seq * H, V * H)
    assert mode.max_numel < batch * (seq - 1) * V // 4


@pytest.mark.parametrize("rows", [None, "all"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_reduction_none_gives_per_token_losses(softcap, rows):
    hidden, weight, labels = make_inputs(3, 11)
    labels[2, 1:] = -100  # a row without targets
    logits = hidden @ weight.t()  # [B, T, V]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = torch.zeros(labels.shape)  # [B, T], NLL of labels[:, t] predicted at t - 1
    expected[:, 1:] = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")

    with torch.no_grad():
        loss = causal_lm_loss(hidden, weight, labels, chunk_size=7, softcap=softcap, reduction="none", rows=rows)
        mean = causal_lm_loss(hidden, weight, labels, chunk_size=7, softcap=softcap, rows=rows)

    assert loss.shape == labels.shape and loss.dtype == torch.float32 and loss.grad_fn is None
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert torch.all(loss[labels == -100] == 0) and torch.all(loss[:, 0] == 0)
    torch.testing.assert_close(loss.sum() / (labels[:, 1:] != -100).sum(), mean, rtol=1e-5, atol=0)


def test_reduction_none_refuses_gradients():
    hidden, weight, labels = make_inputs(1, 4)
    with pytest.raises(ValueError, match=r"reduction='none' computes no gradients.*torch.no_grad\(\)"):
        causal_lm_loss(hidden, weight, labels, reduction="none")
    loss = causal_lm_loss(hidden.detach(), weight.detach(), labels, reduction="none")  # nothing to differentiate
    assert loss.shape == (1, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 0}, "chunk_size must be a positive integer, got 0"),
        ({"softcap": -1.0}, "softcap must be positive or None, got -1.0"),
        ({"reduction": "sum"}, "reduction must be 'mean' or 'none', got 'sum'"),
        ({"rows": "targets"}, r"rows must be a tensor of target_rows\(labels\), 'all' or None, got 'targets'"),
        ({"rows": [1, 2]}, r"rows must be a tensor of target_rows\(labels\), 'all' or None, got \[1, 2\]"),
    ],
)
def test_invalid_arguments(kwargs, match):
    hidden, weight, labels = make_inputs(1, 4)
    with pytest.raises(ValueError, match=match):
        causal_lm_loss(hidden, weight, labels, **kwargs)


def test_shape_mismatch_names_argument():
    hidden, weight, labels = make_inputs(1, 4)
    with pytest.raises(ValueError, match="labels must be"):
        causal_lm_loss(hidden, weight, labels[:, :3])
    with pytest.raises(ValueError, match="weight must be"):
        causal_lm_loss(hidden, weight[:, :3], labels)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_compiled_chunk_math_equals_eager(softcap, per_row):
    # CUDA runs the chunk's NLL and dL/dz compiled (one read of the logits for logsumexp, one for the gradient); the
    # same function compiled by inductor on the CPU, with a shorter last chunk, must give eager's values, with the
    # scalar scale of the target-rows path and the masking [C, 1] scale of the all-positions path
    fused = torch.compile(_nll_and_grad, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for rows in (37, 13):
        logits = torch.randn(rows, V, generator=gen).mul_(4).to(torch.bfloat16)  # [C, V]
        target = torch.randint(0, V, (rows,), generator=gen)  # [C]
        valid = torch.arange(rows) % 3 != 1  # [C] a third of the rows masked
        scale = torch.where(valid, 1 / 50, 0.0).unsqueeze(1) if per_row else torch.full((), 1 / 50)  # [C, 1] or []
        nll, grad = _nll_and_grad(logits, target, scale, softcap, torch.float32, True)
        expected = F.cross_entropy(
            (softcap * torch.tanh(logits.float() / softcap) if softcap else logits.float()), target, reduction="none"
        )
        torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)
        assert grad.dtype == torch.bfloat16 and grad.shape == (rows, V)
        fused_nll, fused_grad = fused(logits, target, scale, softcap, torch.float32, True)
        torch.testing.assert_close(fused_nll, nll, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_grad, grad, rtol=1e-2, atol=1e-6)  # bf16 rounding of equal fp32 values
        if per_row:
            assert torch.count_nonzero(fused_grad[~valid]) == 0 and torch.count_nonzero(grad[~valid]) == 0
        assert fused(logits, target, scale, softcap, torch.float32, False)[1] is None


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_per_row_scale_equals_the_scalar_one_and_masks_rows(softcap):
    # the all-positions path scales dL/dz by [C, 1] = valid / max(N, 1): per element the same multiply as the scalar
    # 1 / N, so valid rows are bitwise the scalar path's, masked rows zero, the NLLs unscaled
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(13, V, generator=gen).mul_(4)  # [C, V]
    target = torch.randint(0, V, (13,), generator=gen)  # [C]
    valid = torch.rand(13, generator=gen) < 0.6  # [C]
    valid[:2] = torch.tensor([True, False])
    scalar = torch.full((), 1 / 50)  # []
    nll, grad = _nll_and_grad(logits, target, scalar, softcap, torch.float32, True)  # [C], [C, V]

    same_nll, same_grad = _nll_and_grad(logits, target, scalar.expand(13, 1), softcap, torch.float32, True)
    assert torch.equal(same_nll, nll) and torch.equal(same_grad, grad)
    row_nll, row_grad = _nll_and_grad(
        logits, target, torch.where(valid, scalar, 0.0).unsqueeze(1), softcap, torch.float32, True
    )  # [C], [C, V]
    assert torch.equal(row_nll, nll)
    assert torch.equal(row_grad[valid], grad[valid])
    assert torch.count_nonzero(row_grad[~valid]) == 0 and torch.count_nonzero(grad[~valid]) > 0


def padded_inputs(batch, seq, seed=0):
    """:func:`make_inputs` with left padding in row 0 and right padding in row 1 (labels -100 there)."""
    hidden, weight, labels = make_inputs(batch, seq, seed=seed)
    if batch > 1:
        labels[0, :4] = -100
        labels[1, -5:] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(
    ("batch", "seq", "chunk_size"),
    [(1, 9, 4096), (3, 11, 7), (2, 16, 1), (4, 33, 10)],  # one short chunk; last chunks of 5 and 2 rows; chunks of 1
)
def test_all_positions_equal_target_rows(batch, seq, chunk_size, softcap):
    hidden, weight, labels = padded_inputs(batch, seq)
    rows = target_rows(labels)  # [N]
    assert 0 < rows.numel() < batch * seq  # ignored positions to mask
    expected = causal_lm_loss(hidden, weight, labels, chunk_size=chunk_size, softcap=softcap, rows=rows)
    exp_gh, exp_gw = grads(expected, hidden, weight)

    loss = causal_lm_loss(hidden, weight, labels, chunk_size=chunk_size, softcap=softcap, rows="all")
    gh, gw = grads(loss, hidden, weight)

    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert_grad_close(gh, exp_gh, rel=1e-6)
    assert_grad_close(gw, exp_gw, rel=1e-6)
    assert torch.count_nonzero(gh[shift_labels(labels) == -100]) == 0  # positions without a target: no gradient


def test_default_off_the_cpu_is_all_positions_without_device_syncs(as_on_a_gpu):
    # as_on_a_gpu makes rows=None take its GPU path on the CPU and fails on any op that would sync a GPU
    hidden, weight, labels = padded_inputs(3, 11)
    expected = causal_lm_loss(hidden, weight, labels, chunk_size=4, softcap=5.0, rows="all")
    exp_gh, exp_gw = grads(expected, hidden, weight)
    with as_on_a_gpu():
        loss = causal_lm_loss(hidden, weight, labels, chunk_size=4, softcap=5.0)  # forward and backward
        gh, gw = grads(loss, hidden, weight)
        with torch.no_grad():
            per_token = causal_lm_loss(hidden, weight, labels, chunk_size=4, softcap=5.0, reduction="none")
    assert torch.equal(loss, expected) and torch.equal(gh, exp_gh) and torch.equal(gw, exp_gw)
    torch.testing.assert_close(per_token.sum() / (labels[:, 1:] != -100).sum(), loss, rtol=1e-6, atol=0)

    with pytest.raises(AssertionError, match=r"aten.nonzero.default would sync a GPU"), as_on_a_gpu():
        target_rows(labels)  # what the all-positions path avoids
    with pytest.raises(AssertionError, match=r"aten._local_scalar_dense.default would sync a GPU"), as_on_a_gpu():
        loss.item()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_cuda_autocast_bf16_matches_naive():
    hidden, weight, labels = (t.detach().cuda() for t in make_inputs(4, 64))
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = causal_lm_loss(hidden, weight, labels, chunk_size=37)
        expected = naive_loss(hidden, weight, labels)
    gh, gw = grads(loss, hidden, weight)
    exp_gh, exp_gw = grads(expected, hidden, weight)

    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0)
    assert_grad_close(gh, exp_gh, rel=2e-2)
    assert_grad_close(gw, exp_gw, rel=2e-2)


@pytest.mark.gpu
@cuda
def test_cuda_peak_memory_is_bounded_by_chunk():
    batch, seq, dim, vocab, chunk = 4, 2048, 512, 65536, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(batch, seq, dim, device="cuda", generator=gen).requires_grad_()
    weight = torch.randn(vocab, dim, device="cuda", generator=gen).div_(16).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    loss = causal_lm_loss(hidden, weight, labels, chunk_size=chunk)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base

    fp32 = 4
    full_logits = batch * (seq - 1) * vocab * fp32  # 2 GiB
    bound = 4 * chunk * vocab * fp32 + 3 * vocab * dim * fp32 + 3 * hidden.numel() * fp32
    assert peak < bound < full_logits / 2
    assert torch.isfinite(loss)


@pytest.mark.gpu
@cuda
def test_cuda_default_is_all_positions_without_syncs():
    # CUDA's own sync check raises on a synchronizing call; the first call compiles the chunk math and is not checked
    hidden, weight, labels = (t.detach().cuda() for t in padded_inputs(4, 64))
    hidden.requires_grad_(), weight.requires_grad_()
    expected = causal_lm_loss(hidden, weight, labels, chunk_size=37, rows=target_rows(labels.cpu()))
    exp_gh, exp_gw = grads(expected, hidden, weight)
    causal_lm_loss(hidden, weight, labels, chunk_size=37).backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = causal_lm_loss(hidden, weight, labels, chunk_size=37)
        gh, gw = grads(loss, hidden, weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert_grad_close(gh, exp_gh)
    assert_grad_close(gw, exp_gw)
