"""Per-sequence log-probabilities of an LM head's targets, chunked: no ``[B, T, V]`` logits.

Preference losses (``models/preference_loss.py``) are functions of each sequence's summed target log-probability,
so their gradient with respect to a token's logits is ``g[b] * (onehot - softmax)``, with ``g[b]`` the loss's
derivative by the sum of sequence ``b``, known only once every sequence's sum is. Unlike the chunked cross-entropy
(``models/loss.py``, gradients computed during its forward), this Function therefore computes the sums in its forward
without keeping anything per chunk and recomputes each chunk's logits in backward, where ``g`` scales them: the LM
head's ``[C, H] x [H, V]`` matmul runs once more per step than in SFT, and memory stays at a few ``[chunk, V]`` fp32
buffers. It saves the hidden states, as autograd would for any head.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from lightning_megatrain.models.loss import (
    IGNORE_INDEX,
    _check_head_args,
    _compute_dtype,
    _nll_and_grad_for,
    shift_labels,
    target_rows,
)


class _SequenceLogps(torch.autograd.Function):
    """Sum over each sequence's target positions of ``log softmax(hidden @ weight^T)[target]``: ``[B]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: Tensor,  # [B, T, H]
        weight: Tensor,  # [V, H]
        shifted_labels: Tensor,  # [B, T] target of position t is the label of t + 1
        rows: Tensor,  # [N] flat positions (into B*T) with a target
        chunk_size: int,
        softcap: float | None,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        batch, seq, dim = hidden.shape
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hidden_flat = hidden.reshape(batch * seq, dim)  # [B*T, H]
            targets_flat = shifted_labels.reshape(batch * seq)  # [B*T]
            w = weight.to(compute_dtype)  # [V, H]
            sums = torch.zeros(batch, dtype=acc_dtype, device=hidden.device)  # [B]
            unit = torch.ones((), dtype=acc_dtype, device=hidden.device)  # [] unused without gradients
            nll_and_grad = _nll_and_grad_for(hidden.device)
            for start in range(0, rows.numel(), chunk_size):
                idx = rows[start : start + chunk_size]  # [C]
                logits = hidden_flat.index_select(0, idx).to(compute_dtype) @ w.t()  # [C, V]
                nll, _ = nll_and_grad(logits, targets_flat.index_select(0, idx), unit, softcap, acc_dtype, False)  # [C]
                sums.index_add_(0, torch.div(idx, seq, rounding_mode="floor"), nll, alpha=-1)  # [B] -= nll
        ctx.save_for_backward(hidden, weight, shifted_labels, rows)
        ctx.chunk_size, ctx.softcap, ctx.compute_dtype = chunk_size, softcap, compute_dtype
        return sums

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_sums: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, shifted_labels, rows = ctx.saved_tensors  # [B, T, H], [V, H], [B, T], [N]
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        batch, seq, dim = hidden.shape
        compute_dtype = ctx.compute_dtype
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hidden_flat = hidden.reshape(batch * seq, dim)  # [B*T, H]
            targets_flat = shifted_labels.reshape(batch * seq)  # [B*T]
            w = weight.to(compute_dtype)  # [V, H]
            # d(logp)/dz = onehot - softmax = -(d nll/dz): each token's scale is minus its sequence's g
            scale_rows = grad_sums.to(acc_dtype).neg()  # [B]
            grad_hidden_flat = torch.zeros_like(hidden_flat) if need_hidden else None  # [B*T, H]
            grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
            nll_and_grad = _nll_and_grad_for(hidden.device)
            for start in range(0, rows.numel(), ctx.chunk_size):
                idx = rows[start : start + ctx.chunk_size]  # [C]
                h = hidden_flat.index_select(0, idx).to(compute_dtype)  # [C, H]
                scale = scale_rows.index_select(0, torch.div(idx, seq, rounding_mode="floor")).unsqueeze(1)  # [C, 1]
                _, grad_logits = nll_and_grad(h @ w.t(), targets_flat.index_select(0, idx), scale, ctx.softcap,
                                              acc_dtype, True)  # [C, V] in the compute dtype
                if grad_hidden_flat is not None:
                    grad_hidden_flat.index_copy_(0, idx, (grad_logits @ w).to(hidden.dtype))  # [B*T, H]
                if grad_weight is not None:
                    if compute_dtype == acc_dtype:
                        grad_weight.addmm_(grad_logits.t(), h)  # [V, H]
                    else:
                        grad_weight.add_(grad_logits.t() @ h)  # [V, H] += low-precision product
        grad_hidden = grad_hidden_flat.view(batch, seq, dim) if grad_hidden_flat is not None else None
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def sequence_logps(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    rows: Tensor | None = None,
    chunk_size: int = 4096,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """Summed target log-probabilities of each sequence and their counts, without ``[B, T, V]`` logits.

    As :func:`models.loss.causal_lm_loss`: position ``t`` predicts ``labels[:, t + 1]``, targets equal to
    ``ignore_index`` are skipped, the matmul runs in the autocast dtype (or the inputs'), the log-softmax in fp32.
    Differentiable with respect to ``hidden`` and ``weight`` (see the module docstring for the cost).

    Args:
        hidden: Last hidden states ``[B, T, H]`` (after the final norm).
        weight: LM head weight ``[V, H]``.
        labels: Token ids ``[B, T]`` aligned with the inputs.
        rows: :func:`models.loss.target_rows` of ``labels``, computed ahead on the host so that a GPU needs no sync
            (``None``: computed here, which waits for the device when ``labels`` is on one).
        chunk_size: Target tokens per chunk; the extra memory is a few ``[chunk_size, V]`` fp32 buffers.
        softcap: Gemma-style final-logit soft-capping; ``None`` disables it.
        ignore_index: Label value that is not a target.

    Returns:
        ``(logps, tokens)``: ``[B]`` fp32 sums of log-probabilities (0 for a sequence without targets) and ``[B]``
        target counts (int64).

    Raises:
        ValueError: A shape, ``chunk_size`` or ``softcap`` out of range.
    """
    _check_head_args(hidden, weight, labels, chunk_size, softcap)
    compute_dtype = _compute_dtype(hidden, weight)
    if rows is None:
        rows = target_rows(labels, ignore_index)
    shifted = shift_labels(labels, ignore_index)  # [B, T]
    logps = _SequenceLogps.apply(hidden, weight, shifted, rows.to(hidden.device, non_blocking=True), chunk_size,
                                 softcap, compute_dtype)  # [B]
    tokens = (shifted != ignore_index).sum(1)  # [B]
    return logps, tokens
