"""Chunked causal-LM cross-entropy that never materialises the full ``[B, T, V]`` logits.

The loss and both input gradients are computed together in the forward pass, one chunk of
target tokens at a time, so at most ``[chunk_size, V]`` logits exist at once. The backward
pass only rescales the saved gradients by the incoming ``grad_output``. ``reduction="none"``
(evaluation only, no gradients) returns the per-token losses instead of their mean.

For one token with logits ``z`` (after optional soft-capping) and target ``y``:

    loss    = logsumexp(z) - z[y]
    dL/dz   = softmax(z) - onehot(y)                       (cross-entropy gradient)

With Gemma-style soft-capping ``c(x) = s * tanh(x / s)`` applied to the raw logits ``x``:

    dc/dx   = 1 - tanh(x / s) ** 2                          (chain rule through the cap)

and with ``x = h @ W^T``: ``dL/dh = dL/dx @ W`` and ``dL/dW = dL/dx^T @ h``.

[Note: target rows]
The chunk loop needs its number of chunks on the host. :func:`causal_lm_loss` lays the chunks out one of two ways:

- *Target rows* (``rows`` a tensor, or ``None`` on the CPU): the ``N`` positions of the flattened ``[B * T]`` batch
  whose target is not ``ignore_index`` (:func:`target_rows`, a ``nonzero``), ``chunk_size`` of them a chunk, gathered
  with ``index_select``. The head projects only the ``N`` targets. Their number is data: on a GPU counting them is a
  device sync (the host waits for all queued work before it can queue the loss), unless they were computed on the
  host before the batch moved (``CausalLMModule.on_before_batch_transfer`` does).
- *All positions* (``rows="all"``, or ``None`` off the CPU): ``chunk_size`` consecutive positions of all ``B * T`` a
  chunk, sliced without a copy. An ignored position gathers target 0 (any valid index), its NLL is zeroed, and its
  ``dL/dz`` row by the per-row scale ``[C, 1]`` = ``valid / max(N, 1)`` (where the target-rows path scales by the
  scalar ``1 / N``), with ``N`` counted on the device; the loss is ``loss_sum / max(N, 1)``, a device tensor. The
  chunk count comes from the shape: no sync anywhere, forward or backward. The cost is head FLOPs, ``6 * V * H`` per
  position (logits and both gradients), on all ``B * T`` positions instead of the ``N`` targets: ``B * T / N`` times
  the head's work (1.43x with 30% of the labels ignored, as prompt-masked SFT batches or padding may have). HF's own
  loss projects all ``B * T`` positions too.

Both give the same loss and gradients to rounding (chunks group different positions, so sums run in another order;
tests/models/test_models_loss.py states the tolerances), and 0 with zero gradients when no position has a target.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

IGNORE_INDEX = -100


def _nll_and_grad(
    logits: Tensor,  # [C, V] compute dtype
    target: Tensor,  # [C] valid indices
    scale: Tensor,  # [] 1 / N for the mean, or [C, 1] per row (0 for an ignored row); acc dtype
    softcap: float | None,
    acc_dtype: torch.dtype,
    need_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """One chunk's token NLLs ``[C]`` (acc dtype) and, with ``need_grad``, ``dL/dz`` ``[C, V]`` in the logits' dtype.

    The math is in ``acc_dtype`` (fp32). Eager (the CPU) holds two ``[C, V]`` acc buffers (the logits, the one-hot);
    on CUDA it runs compiled (:func:`_nll_and_grad_fused`): inductor reads the logits once for the logsumexp and
    once more for the gradient, which it writes in the logits' dtype, where eager ran about ten elementwise kernels
    over fp32 ``[C, V]`` buffers. On the H200 at 3B, 64K tokens a step (vocabulary 128K), that took the step's
    non-matmul, non-attention kernels from 0.46 to 0.34 s (benchmarks/HISTORY.md).

    ``scale`` multiplies ``dL/dz`` by broadcasting: a ``[C, 1]`` scale (the all-positions path of [Note: target rows])
    masks rows at no extra kernel. The NLLs are not scaled.
    """
    z = logits.to(acc_dtype, copy=True)  # [C, V] a private buffer: the in-place ops below never write ``logits``
    if softcap is not None:
        tanh = z.div_(softcap).tanh_()  # [C, V] tanh(x / s)
        z = tanh * softcap  # [C, V] capped logits
    lse = torch.logsumexp(z, dim=-1)  # [C]
    nll = lse - z.gather(1, target.unsqueeze(1)).squeeze(1)  # [C]
    if not need_grad:
        return nll, None
    # dL/dz = softmax(z) - onehot(y), scaled by 1/N for the mean (per row: [C, 1]); the one-hot as a comparison, so it
    # fuses
    onehot = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == target.unsqueeze(1)  # [C, V]
    grad = z.sub_(lse.unsqueeze(1)).exp_().sub_(onehot.to(acc_dtype)).mul_(scale)  # [C, V]
    if softcap is not None:
        grad.mul_(tanh.square_().neg_().add_(1.0))  # [C, V] * (1 - tanh^2)
    return nll, grad.to(logits.dtype)


@functools.cache
def _nll_and_grad_fused() -> Callable[..., tuple[Tensor, Tensor | None]]:
    """:func:`_nll_and_grad` compiled (on first use: importing dynamo costs seconds); one graph per (softcap, dtypes,
    need_grad), with symbolic shapes (the last chunk is shorter)."""
    return torch.compile(_nll_and_grad, dynamic=True)


def _nll_and_grad_for(device: torch.device) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """:func:`_nll_and_grad` compiled on CUDA (:func:`_nll_and_grad_fused`), eager elsewhere."""
    return _nll_and_grad_fused() if device.type == "cuda" else _nll_and_grad


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The LM head's matmul dtype: autocast's inside an enabled autocast region of ``hidden``'s device, else the
    inputs' promoted dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _check_head_args(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, softcap: float | None) -> None:
    """The argument checks of a chunked LM head (:func:`causal_lm_loss`, ``models.sequence_logps``).

    Raises:
        ValueError: ``hidden`` not ``[B, T, H]``, ``labels`` not ``[B, T]``, ``weight`` not ``[V, H]``,
            ``chunk_size`` < 1 or ``softcap`` <= 0.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    if labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"labels must be [B, T] = {tuple(hidden.shape[:2])} to match hidden, "
            f"got {tuple(labels.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be [V, {hidden.shape[2]}] to match hidden, got {tuple(weight.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")


class _ChunkedCausalLMLoss(torch.autograd.Function):
    """Mean token NLL of ``hidden @ weight^T`` against pre-shifted targets, gradients in forward.

    With ``per_token`` it returns the ``[B, T]`` NLLs (0 where ignored) instead of their mean;
    the caller then requests no gradients. ``rows=None`` chunks all positions, masked (see [Note: target rows]).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: Tensor,  # [B, T, H]
        weight: Tensor,  # [V, H]
        shifted_labels: Tensor,  # [B, T] target of position t is the label of t + 1
        rows: Tensor | None,  # [N] flat positions (into B*T) with a target; None: all B*T, masked
        chunk_size: int,
        softcap: float | None,
        ignore_index: int,
        compute_dtype: torch.dtype,
        grad_hidden_needed: bool,
        grad_weight_needed: bool,
        per_token: bool,
    ) -> Tensor:
        batch, seq, dim = hidden.shape
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hidden_flat = hidden.reshape(batch * seq, dim)  # [B*T, H]
            targets_flat = shifted_labels.reshape(batch * seq)  # [B*T]
            w = weight.to(compute_dtype)  # [V, H]
            acc_dtype = torch.promote_types(compute_dtype, torch.float32)  # fp32 unless fp64 inputs

            loss_sum = torch.zeros((), dtype=acc_dtype, device=hidden.device)  # []
            token_nll = (
                torch.zeros(batch * seq, dtype=acc_dtype, device=hidden.device)
                if per_token
                else None
            )  # [B*T]
            grad_hidden_flat = (
                (torch.zeros_like if rows is not None else torch.empty_like)(hidden_flat)  # all rows written
                if grad_hidden_needed
                else None
            )  # [B*T, H]
            grad_weight = (
                torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
                if grad_weight_needed
                else None
            )  # [V, H] accumulator

            need_grad = grad_hidden_flat is not None or grad_weight is not None
            nll_and_grad = _nll_and_grad_for(hidden.device)
            if rows is None:  # all positions, masked: see [Note: target rows]
                n_rows = batch * seq  # from the shape: no device sync
                valid_flat = targets_flat != ignore_index  # [B*T]
                divisor = valid_flat.sum().clamp_(min=1).to(acc_dtype)  # [] max(N, 1), on the device
                scale_flat = valid_flat.to(acc_dtype).div_(divisor).unsqueeze(1)  # [B*T, 1] valid / max(N, 1)
                safe_targets = targets_flat.masked_fill(~valid_flat, 0)  # [B*T] a valid index to gather
            else:
                n_rows = rows.numel()  # from the shape: no device sync
                divisor = max(n_rows, 1)
                scale = torch.full((), 1.0 / divisor, dtype=acc_dtype, device=hidden.device)  # [] a kernel argument
            for start in range(0, n_rows, chunk_size):
                if rows is None:
                    chunk = slice(start, start + chunk_size)
                    target = safe_targets[chunk]  # [C]
                    scale = scale_flat[chunk]  # [C, 1]
                    h = hidden_flat[chunk].to(compute_dtype)  # [C, H] a view unless cast
                else:
                    idx = rows[start : start + chunk_size]  # [C]
                    target = targets_flat.index_select(0, idx)  # [C]
                    h = hidden_flat.index_select(0, idx).to(compute_dtype)  # [C, H]
                logits = h @ w.t()  # [C, V] compute dtype
                nll, grad_logits = nll_and_grad(logits, target, scale, softcap, acc_dtype, need_grad)  # [C], [C, V]
                if rows is None:
                    nll = torch.where(valid_flat[chunk], nll, 0.0)  # [C] 0 where ignored
                loss_sum += nll.sum()  # []
                if token_nll is not None:
                    if rows is None:
                        token_nll[chunk] = nll  # [B*T]
                    else:
                        token_nll.index_copy_(0, idx, nll)  # [B*T]
                if grad_logits is None:
                    continue
                if grad_hidden_flat is not None:
                    grad_h = (grad_logits @ w).to(hidden.dtype)  # [C, H] (0 in ignored rows)
                    if rows is None:
                        grad_hidden_flat[chunk] = grad_h  # [B*T, H]
                    else:
                        grad_hidden_flat.index_copy_(0, idx, grad_h)  # [B*T, H]
                if grad_weight is not None:
                    if compute_dtype == acc_dtype:
                        grad_weight.addmm_(grad_logits.t(), h)  # [V, H]
                    else:
                        grad_weight.add_(grad_logits.t() @ h)  # [V, H] += low-precision product

        grad_hidden = (
            grad_hidden_flat.view(batch, seq, dim) if grad_hidden_flat is not None else None
        )  # [B, T, H]
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None  # [V, H]
        ctx.save_for_backward(grad_hidden, grad_weight)
        if token_nll is not None:
            return token_nll.view(batch, seq)  # [B, T]
        return loss_sum / divisor  # [] mean over the targets

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_output: Tensor  # grad_output: []
    ) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # [B, T, H], [V, H]
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)  # [B, T, H]
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output.to(grad_weight.dtype)  # [V, H]
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[B, T]`` targets per position: column ``t`` holds ``labels[:, t + 1]``, the last column ``ignore_index``."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1).long()


def target_rows(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[N]`` positions of the flattened ``[B * T]`` batch that have a target (see :func:`causal_lm_loss`).

    Their number sets the loss's chunk loop, so on a GPU it costs a device sync (``nonzero``); computed on the host
    from the batch before it moves to the device (``CausalLMModule.on_before_batch_transfer``), it costs none. See
    [Note: target rows].
    """
    return _rows_with_target(shift_labels(labels, ignore_index), ignore_index)


def _rows_with_target(shifted_labels: Tensor, ignore_index: int) -> Tensor:
    return (shifted_labels.reshape(-1) != ignore_index).nonzero().squeeze(1)  # [N]


def _counting_rows_syncs(device: torch.device) -> bool:
    """Whether counting target rows (a ``nonzero``) on ``device`` waits for the device: everywhere but the CPU.

    ``rows=None`` chunks all positions where it does (see [Note: target rows]); tests patch this to run that path on
    the CPU.
    """
    return device.type != "cpu"


def causal_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk_size: int = 4096,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: Literal["mean", "none"] = "mean",
    rows: Tensor | Literal["all"] | None = None,
) -> Tensor:
    """Mean next-token cross-entropy of an LM head without materialising ``[B, T, V]`` logits.

    Follows the HuggingFace convention: ``labels`` is aligned with ``input_ids`` and position
    ``t`` predicts ``labels[:, t + 1]``; targets equal to ``ignore_index`` are skipped and the
    result is the mean over the remaining targets (0, with zero gradients, when there are none).

    ``reduction="none"`` returns the per-token losses ``[B, T]`` aligned with ``labels``:
    entry ``[b, t]`` is the NLL of ``labels[b, t]`` predicted at position ``t - 1``, and 0 where
    ``labels`` is ``ignore_index`` and in column 0 (never a target). Per-sequence mean NLL is
    ``loss.sum(1) / (labels[:, 1:] != ignore_index).sum(1)``. It is for evaluation: it computes
    no gradients, so call it under ``torch.no_grad()`` (or with inputs that need none).

    The matmul runs in the inputs' dtype, or in the autocast dtype when called inside an enabled
    ``torch.autocast`` region of the inputs' device; log-softmax, the loss and the
    weight-gradient accumulation are fp32 (fp64 for fp64 inputs). Returned gradients have the
    dtypes of ``hidden`` and ``weight``.

    Args:
        hidden: Last hidden states ``[B, T, H]`` (after the final norm).
        weight: LM head weight ``[V, H]``.
        labels: Token ids ``[B, T]`` aligned with the inputs.
        chunk_size: Number of rows per chunk (target tokens, or positions with ``rows="all"``);
            peak extra memory is a few ``[chunk, V]`` fp32 buffers.
        softcap: Gemma-style final-logit soft-capping ``softcap * tanh(logits / softcap)``;
            ``None`` disables it.
        ignore_index: Label value that contributes no loss.
        reduction: ``"mean"`` (differentiable 0-dim mean) or ``"none"`` (per-token ``[B, T]``,
            no gradients).
        rows: How the chunks are laid out (see [Note: target rows]). A tensor: :func:`target_rows`
            of ``labels``, computed ahead (on the host, so that the loss needs no device sync);
            chunks of target tokens only. ``"all"``: chunks of all ``B * T`` positions with the
            ignored ones masked; no device sync, the head's FLOPs on every position. ``None``
            (default): ``"all"`` off the CPU (counting targets there is a device sync), the
            target rows computed here on the CPU.

    Returns:
        A 0-dim fp32 tensor (fp64 for fp64 inputs); ``[B, T]`` with ``reduction="none"``.

    Raises:
        ValueError: a shape, ``chunk_size``, ``softcap``, ``reduction`` or ``rows`` out of range,
            or ``reduction="none"`` with inputs that need gradients.
    """
    _check_head_args(hidden, weight, labels, chunk_size, softcap)
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if not (rows is None or isinstance(rows, Tensor) or (isinstance(rows, str) and rows == "all")):
        raise ValueError(f"rows must be a tensor of target_rows(labels), 'all' or None, got {rows!r}")
    grad_enabled = torch.is_grad_enabled()
    per_token = reduction == "none"
    if per_token and grad_enabled and (hidden.requires_grad or weight.requires_grad):
        raise ValueError(
            "reduction='none' computes no gradients (it is for evaluation); call it under "
            "torch.no_grad() or use reduction='mean' to train"
        )

    compute_dtype = _compute_dtype(hidden, weight)
    shifted_labels = shift_labels(labels, ignore_index)  # [B, T]
    if rows is None:  # see [Note: target rows]
        rows = "all" if _counting_rows_syncs(hidden.device) else _rows_with_target(shifted_labels, ignore_index)
    loss = _ChunkedCausalLMLoss.apply(
        hidden,
        weight,
        shifted_labels,
        None if isinstance(rows, str) else rows.to(hidden.device, non_blocking=True),  # [N] or None: all B*T
        chunk_size,
        softcap,
        ignore_index,
        compute_dtype,
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        per_token,
    )  # [] or, per token, [B, T] with column t the target of t + 1
    if per_token:
        loss = torch.cat([loss.new_zeros(loss.shape[0], 1), loss[:, :-1]], dim=1)  # [B, T] like labels
    return loss
