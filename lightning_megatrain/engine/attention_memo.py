"""Attention outputs kept from a recomputed layer's forward for its recompute, which then skips the attention kernel.

[Note: attention memo]
What: a recomputed layer runs its forward twice, once without grad in the forward pass and again with grad before
its backward ([Note: streamed layer] in engine/streamed.py). At long context attention is most of that forward (the
Llama-2-7B layer at 131,072 tokens: 73% of its FLOPs, docs/planner.md), so the second run repeats the step's most
expensive kernel. With ``attention_memo`` each attention call of a recomputed layer's first forward keeps its output
and log-sum-exp (``B x heads x T x head_dim`` in the compute dtype and ``B x heads x T`` in fp32: 1.0 GiB and 16 MiB
for that layer in bf16) until the layer's recompute, which takes them instead of running the kernel, and the backward
kernel runs on them as on its own forward's. The forward kernel is deterministic on the same inputs (the recompute
replays the forward's RNG and autocast state), so for eager layers the gradients are those without the memo,
bitwise (CPU, fp32; compiled layers and CUDA below).

How:
- :func:`memo_mode` (:class:`RouteAttention`, a ``TorchFunctionMode``, with the memo made the active one) is
  entered around every decoder layer's call and the backward's ``autograd.grad`` (streamed.py):
  ``F.scaled_dot_product_attention`` without a mask and without dropout goes to the custom op
  ``megatrain::memo_attention``; every other call passes through unchanged. A compiled layer's checkpointed forward
  enters the routing again inside its body (:func:`routed`): dynamo traces that body without the modes active around
  the compiled call. Compiled, the recorded output comes from the no-grad graph and the recompute's q, k, v from the
  graph with grad, whose fused kernels round differently: the gradients agree to fp32 rounding, not bitwise.
  A custom op is opaque to dynamo and inductor, so compiled layers ([Note: compiled layers]) call it without a graph
  break, and its Python body reads the memo's state when it runs, not when it is traced: one graph per grad mode
  whether the call computes, records or replays. Compiled layers list it among the ops whose outputs they save
  (compiled.py ``_SAVED_OPS``), so their backward graph never calls it again.
- :meth:`AttentionMemo.recording` (the forward of a recomputed layer) and :meth:`AttentionMemo.replaying` (its
  recompute) set that state for one layer. A kept layer, validation and a segment's replay in backward
  ([Note: recompute segments]) run with neither: the op computes with the kernel SDPA would pick (cuDNN on CUDA:
  calls SDPA could not run there pass through, ``_cudnn_serves``; the inputs in autocast's dtype, as SDPA casts
  them). Recorded outputs are copies: inductor reuses the buffers of a graph's intermediates.
- Kernels: on the CPU the one SDPA runs there without a mask (``_scaled_dot_product_flash_attention_for_cpu``), on
  CUDA cuDNN's (SDPA's own choice on the H200, docs/planner.md), each with its own backward. Grouped key/value heads
  (``enable_gqa``) go to the CPU kernel as they are (it takes them, as SDPA does: bitwise); on CUDA they are repeated
  to the query heads first and the repeat's backward sums their gradients (SDPA's kernel sums them in its own order).
- Checks: a replayed call whose query shape, dtype or device differs from the recorded one, and a recompute that
  leaves recorded calls unused, raise (the layer took another path on the same inputs).

Cost: the memos of the recomputed layers stay on the device from their forward to their backward; the planner counts
them (planner/memory.py ``attention_memo_bytes``) and the recompute's attention forward leaves the step's time
(planner/timing.py). Not used with dropout in attention, an attention mask (packed documents go through their own
kernels) or a non-SDPA attention (eager attention: gpt-oss). ``attention_memo="auto"``, the default, weighs the two
with the planner at the first training micro-batch (engine/memo_choice.py ``choose_attention_memo``) and switches the
layers over (streamed.py ``StreamedLayers.use_memo``). ``attention_memo=N`` keeps the last ``N`` layers' memos only
(config.py ``memo_layers``): the other layers' calls go through the op too and compute, as a kept layer's do.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPAParams
from torch.overrides import TorchFunctionMode

_aten = torch.ops.aten


class _Calls(list):
    """One recorded forward's attention calls, in call order: a list that can be weakly referenced and is one
    member of a weak set by identity."""

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


class AttentionMemo:
    """Which layer's attention calls the op records or replays now (see [Note: attention memo]). The recorded calls
    live with the layer's autograd node (streamed.py keeps the list :meth:`recording` yields on its ctx), so a second
    forward before backward records its own and the memos go when the graph goes."""

    def __init__(self) -> None:
        self.state: tuple[str, list, int] | None = None  # ("record" | "replay", the calls, layer index)
        # the calls of every recording whose node is alive (weak: they go with the graph)
        self._recorded: weakref.WeakSet[_Calls] = weakref.WeakSet()

    @property
    def pending(self) -> bool:
        """Whether a recorded forward's calls still wait for its recompute (its graph alive, its backward not run)."""
        return any(len(calls) for calls in self._recorded)

    @contextlib.contextmanager
    def recording(self, index: int) -> Iterator[list]:
        calls = _Calls()
        self._recorded.add(calls)
        self.state = ("record", calls, index)
        try:
            yield calls
        finally:
            self.state = None

    @contextlib.contextmanager
    def replaying(self, index: int, calls: list) -> Iterator[None]:
        self.state = ("replay", calls, index)
        try:
            yield
        finally:
            self.state = None
        if calls:
            raise RuntimeError(
                f"MegaTrain: layer {index}'s recompute made {len(calls)} fewer attention calls than its forward: the "
                "layer took another path on the same inputs. HINT: MegaTrainStrategy(attention_memo=False)."
            )

    def _record(self, key: tuple, outputs: tuple[Tensor, ...]) -> None:
        _, calls, _ = self.state
        calls.append((key, tuple(t.clone() for t in outputs)))  # inductor reuses its intermediates' buffers

    def _replay(self, key: tuple) -> tuple[Tensor, ...]:
        _, calls, index = self.state
        if not calls:
            raise RuntimeError(f"MegaTrain: layer {index}'s recompute made more attention calls than its forward. "
                               "HINT: MegaTrainStrategy(attention_memo=False).")
        recorded, outputs = calls.pop(0)
        if recorded != key:
            raise RuntimeError(f"MegaTrain: layer {index}'s recompute called attention as {key}, its forward as "
                               f"{recorded}. HINT: MegaTrainStrategy(attention_memo=False).")
        return outputs


_ACTIVE: AttentionMemo | None = None  # the engine's memo while its layers run (one engine trains at a time)


def _kernel(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, philox_seed, philox_offset) of the forward kernel SDPA runs for these inputs without a mask. On CUDA
    ``out`` and ``lse`` stay as cuDNN made them, so its backward gets its forward's tensors; the philox seed and offset
    are zeros on q's device (the calls routed here have no dropout, so the backward does not read them, and fake and
    real kernels agree on their device). On fake tensors it is the op's fake kernel too: the aten kernels' meta
    functions give the shapes and strides."""
    if q.device.type == "cuda":
        out, lse = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale)[:2]
    else:  # out and lse as [B, T, heads, ...] in memory: made contiguous, as the fake kernel says
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        out, lse = out.contiguous(), lse.contiguous()
    # a fresh int64 scalar each (a custom op's outputs may not alias)
    return out, lse, q.new_zeros((), dtype=torch.int64), q.new_zeros((), dtype=torch.int64)


@torch.library.custom_op("megatrain::memo_attention", mutates_args=())
def memo_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Causal or full attention of ``[B, heads, T, D]`` q, k, v without mask or dropout: computed, recorded for the
    layer's recompute, or replayed from its forward, as the active memo says ([Note: attention memo])."""
    memo = _ACTIVE
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, is_causal, scale)
    if memo is not None and memo.state is not None and memo.state[0] == "replay":
        return memo._replay(key)
    outputs = _kernel(q, k, v, is_causal, scale)
    if memo is not None and memo.state is not None:
        memo._record(key, outputs)
    return outputs


@memo_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _kernel(q, k, v, is_causal, scale)


def _backward_kernel(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                     offset: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv by the backward kernel of :func:`_kernel`'s (on fake tensors: its meta function)."""
    if q.device.type == "cuda":
        T, S = q.shape[2], k.shape[2]  # noqa: N806
        return tuple(_aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, None, None, T, S, 0.0, is_causal, scale=scale))
    return tuple(_aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, is_causal, scale=scale))


@torch.library.custom_op("megatrain::memo_attention_backward", mutates_args=())
def memo_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                            offset: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`memo_attention` by the backward kernel of the forward's."""
    return _backward_kernel(grad, q, k, v, out, lse, seed, offset, is_causal, scale)


memo_attention_backward.register_fake(_backward_kernel)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, is_causal, scale = inputs
    out, lse, seed, offset = output
    ctx.save_for_backward(q, k, v, out, lse, seed, offset)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx: Any, grad: Tensor, *unused: Tensor) -> tuple:
    q, k, v, out, lse, seed, offset = ctx.saved_tensors
    dq, dk, dv = memo_attention_backward(grad.contiguous(), q, k, v, out, lse, seed, offset, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


memo_attention.register_autograd(_backward, setup_context=_setup_context)


def _cudnn_serves(q: Tensor, k: Tensor, named: dict) -> bool:
    """Whether SDPA could run this call, its inputs already in the dtype it computes in, on cuDNN's kernel (fp16 or
    bf16, head dims and the GPU cuDNN takes): only then does the memo's op, which calls it directly, route it.
    Decided once per static property (:func:`_cudnn_takes`), so a compiled layer's graph holds the answer: the check
    itself (``SDPAParams``, a pybind object) is opaque to dynamo, and calling it in the traced body broke the graph
    at attention, which ran the whole layer's selective checkpoint eagerly."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _cudnn_takes(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], bool(named.get("is_causal", False)),
                        bool(named.get("enable_gqa")))


@torch.compiler.assume_constant_result
def _cudnn_takes(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, is_causal: bool,
                 enable_gqa: bool) -> bool:
    """SDPA's own cuDNN check (``can_use_cudnn_attention``) on a probe of 256 positions with these static properties,
    cached; a constant to dynamo. The sequence length is not among them: a batch and sequence dim are dynamic in a
    compiled layer, and cuDNN's kernel would fail loudly, not silently, on a length its checks refused."""
    return _cudnn_probe(device, dtype, heads, kv_heads, head_dim, is_causal, enable_gqa)


@functools.cache
def _cudnn_probe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, is_causal: bool,
                 enable_gqa: bool) -> bool:
    q = torch.empty(1, heads, 256, head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, kv_heads, 256, head_dim, device=device, dtype=dtype)
    return torch.backends.cuda.can_use_cudnn_attention(SDPAParams(q, kv, kv, None, 0.0, is_causal, enable_gqa))


class RouteAttention(TorchFunctionMode):
    """Routes mask-free, dropout-free ``F.scaled_dot_product_attention`` calls through :func:`memo_attention`; the
    other calls pass through (see [Note: attention memo])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, *rest = args
        named = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), rest), **kwargs)
        if named.get("attn_mask") is not None or named.get("dropout_p", 0.0) != 0.0 or q.dim() != 4:
            return func(*args, **kwargs)
        if torch.is_autocast_enabled(q.device.type):  # SDPA runs in autocast's dtype; a custom op is not cast
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if q.device.type == "cuda" and not _cudnn_serves(q, k, named):
            return func(*args, **kwargs)  # SDPA picks another kernel: the memo's op calls cuDNN's
        if named.get("enable_gqa") and k.shape[1] != q.shape[1] and q.device.type == "cuda":
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scale = named.get("scale")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return memo_attention(q, k, v, bool(named.get("is_causal", False)), float(scale))[0]


@contextlib.contextmanager
def memo_mode(memo: AttentionMemo) -> Iterator[None]:
    """``memo`` the one :func:`memo_attention` reads, and attention routed to it, while a layer runs."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, memo
    try:
        with RouteAttention():
            yield
    finally:
        _ACTIVE = previous


MEMO_OP = torch.ops.megatrain.memo_attention.default  # compiled layers save its outputs (compiled.py)


def routed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` with attention routed through the memo's op: the body of a compiled layer's
    checkpoint, which dynamo traces without the modes active around the compiled call (compiled.py)."""
    with RouteAttention():
        return forward(*args, **kwargs)
