"""The one streamed autograd Function: a decoder layer as a single autograd node with recompute in backward.

[Note: streamed layer]
Forward (training): acquire layer i's weights from its slot, prefetch i+1, run the layer's *own* module code under
``no_grad`` with its parameters bound to the slot's compute views, release the slot, keep only the layer's inputs
(plus RNG and autocast state): inputs on the activation path are stashed by the transfer layer (offloaded to pinned
host memory on CUDA, see [Note: activation offload] in offload.py), masks and rotary tables shared by all layers
are saved as they are. No graph of the layer's internals exists after forward.
Backward: acquire layer i again (usually still in a slot from forward or prefetched by layer i+1's backward),
prefetch i-1 and its stashed input, re-run the layer with grad under the saved RNG/autocast state,
``torch.autograd.grad`` w.r.t. the inputs and one leaf per weight, drain the weight grads to the host and return the
input grads. A layer the recompute policy *keeps* (engine/recompute.py, [Note: keep or recompute]) instead runs with
grad in forward on a private copy of its weights (a device group's weights stay put: no copy) and keeps its graph;
its backward is the ``autograd.grad`` alone. With ``segment_layers > 1`` only a segment's first layer stashes its
input; the others record what a replay needs and get their input in backward from the segment (engine/segments.py,
[Note: recompute segments]). The node's outputs are the layer's own, then the tensors transformers records inside
it while a call records them (MoE router logits, [Note: recorded outputs] in engine/recorded.py), so a router loss's
gradient reaches the recompute too. Plain ``loss.backward()`` therefore walks the layers in reverse and
Lightning's loops, the user's loss and manual optimization stay untouched. Without grad (validation, predict) the
layer simply runs on bound weights.

Compiled layers: [Note: compiled layers] in engine/compiled.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_megatrain.config import memo_layers
from lightning_megatrain.engine.attention_memo import AttentionMemo, memo_mode
from lightning_megatrain.engine.backward_updates import BackwardUpdates
from lightning_megatrain.engine.compiled import compile_layer_forward
from lightning_megatrain.engine.discovery import TensorSlot
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.recompute import RecomputePolicy
from lightning_megatrain.engine.recorded import Recorded, RecordedOutputs, capture
from lightning_megatrain.engine.segments import LayerRecord, Segments, autocast_state, replay_state
from lightning_megatrain.engine.transfer import Transfer

# Marks where a tensor stood among a layer's output leaves (a real output leaf may be None).
_TENSOR = object()

# StreamedLayerFunction.forward's arguments before the layer's input leaves: owner, index, spec, out_box, anchor.
# needs_input_grad and the tuple backward returns count them first, so leaf i sits at _LEADING_ARGS + i.
_LEADING_ARGS = 5

# kwargs through which HF layers receive a KV cache; a recompute would append to it twice, so training drops them
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


@contextlib.contextmanager
def bind(bindings: list[tuple[TensorSlot, Tensor]]) -> Iterator[None]:
    """Temporarily put compute tensors into parameter/buffer slots (the stateless parameter swap)."""
    saved = [(slot, slot.get()) for slot, _ in bindings]
    try:
        for slot, value in bindings:
            slot.set(value)
        yield
    finally:
        for slot, original in saved:
            slot.set(original)


class StreamedLayers:
    """Runs the layers of one stack through the transfer backend; installed as each layer's ``forward``."""

    def __init__(
        self,
        stack: nn.ModuleList,
        groups: list[FlatGroup],
        transfer: Transfer,
        buffers: list[list],
        policy: RecomputePolicy,
        compile_layers: bool = False,
        attention_memo: bool | int = False,
    ) -> None:
        self.stack = stack
        self.groups = groups
        self.transfer = transfer
        self.buffers = buffers  # per layer: [(TensorSlot, device tensor)] for the layer's buffers
        self.policy = policy
        self.device_type = "cpu"
        # Latest stashed inputs per layer, so layer i's backward can prefetch layer i-1's input (a hint only: the
        # authoritative handle lives on each autograd node).
        self.stashed: dict[int, list] = {}
        # Layers of the current micro-batch that kept their graph, so backward does not prefetch their weights or
        # inputs (a hint, like ``stashed``).
        self.kept: set[int] = set()
        # Which recomputed layers save their input and which are replayed from a segment's first ([Note: recompute
        # segments]); configured by the engine (segment_layers, device_checkpoints, sub_segment_layers).
        self.segments = Segments(len(stack))
        # What transformers records inside the layers (MoE router logits), returned by each layer's node ([Note:
        # recorded outputs] in engine/recorded.py); the engine installs the recorders it finds.
        self.recorded = RecordedOutputs()
        # Counts each layer's forwards with grad for the host updates during backward ([Note: updates during
        # backward]); set by the engine when it speculates.
        self.backward_updates: BackwardUpdates | None = None
        # Attention outputs a recomputed layer's forward keeps for its recompute ([Note: attention memo]); None
        # without the memo; the layers from ``memo_from`` on record theirs (set by use_memo)
        self.memo: AttentionMemo | None = None
        self.memo_from = len(stack)
        # The function each layer runs: its class's own ``forward``, or that function compiled once per class (see
        # [Note: compiled layers]), with attention routed to the memo's op or not; both kinds kept once built
        self.forwards: dict[type, Callable[..., Any]] = {}
        self._compiled: dict[tuple[type, bool], Callable[..., Any]] = {}
        self.compile_layers = compile_layers
        self.use_memo(attention_memo)

    def use_memo(self, layers: bool | int) -> None:
        """Run the layers with the attention memo (``True``: every layer's; an int: the last ``layers`` layers',
        config.py ``memo_layers``) or without it from the next micro-batch on (the engine decides
        ``attention_memo="auto"`` at the first training micro-batch: engine/memo_choice.py). Call it between
        micro-batches. The other layers' attention still goes through the memo's op, which computes it without
        recording, as for a kept layer.

        Raises:
            RuntimeError: switching off while a forward's memos still wait for its backward (the recompute replays
                them through the memo's routing).
        """
        count = memo_layers(layers, len(self.stack))
        on = count > 0
        if not on and self.memo is not None and self.memo.pending:
            raise RuntimeError("MegaTrain: the attention memo cannot be switched off while a forward's memos wait for "
                               "its backward")
        self.memo_from = len(self.stack) - count
        if on == (self.memo is not None) and self.forwards:
            return
        self.memo = AttentionMemo() if on else None
        for layer in self.stack:
            kind = type(layer)
            if self.compile_layers:  # compiled with the routing in its checkpointed body, or without
                if (kind, on) not in self._compiled:
                    self._compiled[kind, on] = compile_layer_forward(kind.forward, on)
                self.forwards[kind] = self._compiled[kind, on]
            else:
                self.forwards[kind] = kind.forward

    def install(self, device_type: str) -> None:
        self.device_type = device_type
        for index, layer in enumerate(self.stack):
            layer.forward = _LayerForward(self, index)  # instance attribute shadows the class method
        self.recorded.install()

    def uninstall(self) -> None:
        self.recorded.uninstall()
        for layer in self.stack:
            if isinstance(layer.__dict__.get("forward"), _LayerForward):
                del layer.forward

    def bindings(self, index: int, weights: list[Tensor]) -> list[tuple[TensorSlot, Tensor]]:
        group = self.groups[index]
        return [(slot, weights[k]) for slot, k in group.slot_index] + self.buffers[index]

    def run_layer(self, index: int, weights: list[Tensor], args: tuple, kwargs: dict, eager: bool = False) -> Any:
        """Layer ``index`` on ``weights``: its class's forward as compiled, or, ``eager``, as written (a call that
        records router logits, see [Note: recorded outputs])."""
        layer = self.stack[index]
        forward = type(layer).forward if eager else self.forwards[type(layer)]
        with bind(self.bindings(index, weights)), self.memo_mode():
            return forward(layer, *args, **kwargs)

    def memo_mode(self) -> contextlib.AbstractContextManager:
        """Attention through the memo's op while a layer runs ([Note: attention memo]); nothing without a memo."""
        return memo_mode(self.memo) if self.memo is not None else contextlib.nullcontext()

    def memo_recording(self, index: int) -> contextlib.AbstractContextManager:
        """Records layer ``index``'s attention calls into the list it yields (None without a memo for the layer)."""
        if self.memo is None or index < self.memo_from:
            return contextlib.nullcontext()
        return self.memo.recording(index)

    def memo_replaying(self, index: int, calls: list | None) -> contextlib.AbstractContextManager:
        return self.memo.replaying(index, calls) if calls is not None else contextlib.nullcontext()

    def run_recording(
        self, index: int, weights: list[Tensor], args: tuple, kwargs: dict, keys: frozenset[str]
    ) -> tuple[Any, list[Recorded]]:
        """:meth:`run_layer`, and what its recorders of ``keys`` captured ([Note: recorded outputs])."""
        with capture(keys) as recorded:
            output = self.run_layer(index, weights, args, kwargs, eager=bool(keys))
        return output, recorded

    def run_streamed(self, index: int, args: tuple, kwargs: dict, eager: bool = False) -> Any:
        """Layer ``index`` on its slot's weights, acquired and released around it, with no graph of its own: without
        grad (validation, predict) and a segment's replay in backward (the caller sets grad mode and RNG)."""
        flat = self.transfer.acquire(index)
        self.transfer.prefetch(index + 1)
        try:
            return self.run_layer(index, self.groups[index].views(flat), args, kwargs, eager)
        finally:
            self.transfer.release(index)


class _LayerForward:
    """Callable that replaces ``layer.forward``; routes through :class:`StreamedLayerFunction` when grad is on."""

    def __init__(self, owner: StreamedLayers, index: int) -> None:
        self.owner = owner
        self.index = index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner, index = self.owner, self.index
        if not torch.is_grad_enabled():
            if index == 0:
                owner.segments.reset()  # validation or a reference forward: the hints of a training one go
            keys = owner.recorded.requested()
            with capture(keys) as recorded:
                output = owner.run_streamed(index, args, kwargs, eager=bool(keys))
            owner.recorded.replace(recorded)  # tiles' captures merged ([Note: recorded outputs])
            return output
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        leaves, spec = pytree.tree_flatten((args, kwargs))
        out_box: list = []
        # A leaf that requires grad makes sure this node exists even when no input requires grad (frozen embeddings).
        anchor = torch.empty(0, requires_grad=True)
        outputs = StreamedLayerFunction.apply(owner, index, spec, out_box, anchor, *leaves)
        out_spec, out_leaves, recorded = out_box
        if recorded:  # the node's last outputs: what the layer's recorders captured ([Note: recorded outputs])
            owner.recorded.replace(recorded, outputs[len(outputs) - len(recorded) :])
        owner.segments.produced(index, outputs)  # the next layer may chain on its first output
        tensors = iter(outputs)
        return pytree.tree_unflatten([next(tensors) if x is _TENSOR else x for x in out_leaves], out_spec)


def _capture_rng(device_type: str) -> tuple[Tensor, Tensor | None]:
    cpu = torch.get_rng_state()
    device = torch.cuda.get_rng_state() if device_type == "cuda" else None
    return cpu, device


class StreamedLayerFunction(torch.autograd.Function):
    """See [Note: streamed layer]."""

    @staticmethod
    def forward(ctx, owner: StreamedLayers, index: int, spec, out_box: list, anchor: Tensor, *leaves: Any):
        ctx.owner, ctx.index, ctx.spec = owner, index, spec
        # an output nothing differentiates (a recorded one without an aux loss) gets None, not zeros: no backward work
        ctx.set_materialize_grads(False)
        ctx.recorded_keys = owner.recorded.requested()  # what the layer's recorders capture ([Note: recorded outputs])
        # Inputs on the activation path (they require grad) are the ones backward differentiates: stashed
        # (offloaded on CUDA, see [Note: activation offload]) for a recompute, or kept in the graph. The rest (masks,
        # rotary tables) are shared by all layers and saved as they are.
        tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        ctx.stashed_positions = [i for i in tensor_positions if leaves[i].requires_grad]
        ctx.saved_positions = [i for i in tensor_positions if not leaves[i].requires_grad]
        input_bytes = sum(leaves[i].numel() * leaves[i].element_size() for i in ctx.stashed_positions)
        if index == 0:
            owner.policy.start_forward()
            owner.kept.clear()
            owner.segments.reset()
        ctx.kept = None
        ctx.stashed = []
        ctx.segment = None
        if owner.policy.keep(input_bytes):
            output, recorded = _forward_kept(ctx, owner, index, leaves)
        else:
            output, recorded = _forward_recomputable(ctx, owner, index, leaves)
        owner.stashed[index] = ctx.stashed
        if owner.backward_updates is not None:
            owner.backward_updates.forwarded(index)
        ctx.n_recorded = len(recorded)

        out_leaves, out_spec = pytree.tree_flatten(output)
        out_box.extend([out_spec, [_TENSOR if isinstance(x, Tensor) else x for x in out_leaves], recorded])
        # kept: detached aliases, the graph's own outputs stay in ctx.kept for backward
        tensors = [x for x in out_leaves if isinstance(x, Tensor)] + [r.value for r in recorded]
        return tuple(x.detach() for x in tensors)

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor):
        owner, index = ctx.owner, ctx.index
        kept = ctx.kept is not None
        if kept:
            outs, inputs, weights = ctx.kept
            ctx.kept = None
            inputs_needing_grad = [(pos, x) for pos, x in inputs if ctx.needs_input_grad[_LEADING_ARGS + pos]]
        else:
            outs, inputs_needing_grad, weights = _recompute(ctx, owner, index)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        wrt = [x for _, x in inputs_needing_grad] + [w for w in weights if w.requires_grad]
        # Bound as in forward: where dynamo could not trace a compiled layer whole (MoE routing), its selective
        # checkpoint runs eagerly and re-runs the layer's own code here, inside backward.
        with bind(owner.bindings(index, weights)), owner.memo_mode():
            grads = torch.autograd.grad(
                [o for o, _ in pairs], wrt, grad_outputs=[g for _, g in pairs], allow_unused=True
            ) if pairs else (None,) * len(wrt)
        input_grads = grads[: len(inputs_needing_grad)]
        weight_grads = iter(grads[len(inputs_needing_grad) :])
        owner.transfer.drain(index, [next(weight_grads) if w.requires_grad else None for w in weights])
        if not kept:  # a kept layer released its slot in forward
            owner.transfer.release(index)
        if index == 0:
            owner.segments.reset()  # the micro-batch's backward is done: let go of its segments
        if index == 0 and owner.policy.end_backward():
            owner.transfer.trim_stash_cache()  # the calibrating micro-batch's offloaded inputs are all restored

        result: list[Tensor | None] = [None] * (_LEADING_ARGS + len(ctx.other_leaves))
        for (pos, _), g in zip(inputs_needing_grad, input_grads):
            result[_LEADING_ARGS + pos] = g
        return tuple(result)


def _weight_leaves(group: FlatGroup, flat: Tensor) -> list[Tensor]:
    """Per-parameter leaves over a 1D compute-dtype weight buffer; frozen parameters stay frozen."""
    return [w.detach().requires_grad_(p.requires_grad) for w, p in zip(group.views(flat), group.params)]


def _forward_kept(ctx, owner: StreamedLayers, index: int, leaves: tuple) -> tuple[Any, list[Recorded]]:
    """Run layer ``index`` with grad and keep its graph for backward (see [Note: keep or recompute]): its output and
    what its recorders captured ([Note: recorded outputs])."""
    transfer = owner.transfer
    flat = transfer.acquire(index)
    transfer.prefetch(index + 1)
    if not transfer.persistent(index):
        flat = flat.clone()  # private copy: the slot is refilled after release
    weights = _weight_leaves(owner.groups[index], flat)
    transfer.release(index)
    leaves = list(leaves)
    inputs = []
    for pos in ctx.stashed_positions:
        leaves[pos] = leaves[pos].detach().requires_grad_(True)
        inputs.append((pos, leaves[pos]))
    ctx.other_leaves = leaves  # only its length is used in backward
    with torch.profiler.record_function(f"megatrain::forward_layer_{index}_kept"), torch.enable_grad():
        args, kwargs = pytree.tree_unflatten(leaves, ctx.spec)
        output, recorded = owner.run_recording(index, weights, args, kwargs, ctx.recorded_keys)
    outs = [x for x in pytree.tree_leaves(output) if isinstance(x, Tensor)] + [r.value for r in recorded]
    ctx.kept = (outs, inputs, weights)
    owner.kept.add(index)
    owner.segments.close()
    return output, recorded


def _forward_recomputable(ctx, owner: StreamedLayers, index: int, leaves: tuple) -> tuple[Any, list[Recorded]]:
    """Run layer ``index`` without a graph; keep only what a recompute needs (see [Note: streamed layer]): its output
    and what its recorders captured ([Note: recorded outputs])."""
    transfer = owner.transfer
    ctx.rng = _capture_rng(owner.device_type)
    ctx.autocast = autocast_state(owner.device_type)
    ctx.other_leaves = [None if isinstance(x, Tensor) else x for x in leaves]
    ctx.save_for_backward(*(leaves[i] for i in ctx.saved_positions))
    segments = owner.segments
    ctx.segment = segments.join(index, leaves, ctx.stashed_positions) if segments.layers > 1 else None
    if ctx.segment is None:  # saves its input: offloaded, or on the device for the last checkpoints
        on_device = segments.on_device(index)
        ctx.stashed = [transfer.stash(leaves[i].detach(), on_device) for i in ctx.stashed_positions]
        if segments.layers > 1 and len(ctx.stashed) == 1:
            ctx.segment = segments.open(index, ctx.stashed.pop())
    if ctx.segment is not None:  # what a replay of this layer needs ([Note: recompute segments])
        (position,) = ctx.stashed_positions
        replay_leaves = [None if i == position else x for i, x in enumerate(leaves)]
        ctx.segment.records.append(LayerRecord(index, ctx.spec, replay_leaves, position, ctx.rng, ctx.autocast))
    flat = transfer.acquire(index)
    transfer.prefetch(index + 1)
    with torch.profiler.record_function(f"megatrain::forward_layer_{index}"), owner.memo_recording(index) as memo:
        ctx.memo = memo  # this forward's attention calls ([Note: attention memo]), for this node's recompute
        args, kwargs = pytree.tree_unflatten(list(leaves), ctx.spec)
        output, recorded = owner.run_recording(
            index, owner.groups[index].views(flat), args, kwargs, ctx.recorded_keys
        )
    transfer.release(index)
    return output, recorded


def _recompute(ctx, owner: StreamedLayers, index: int) -> tuple[list[Tensor], list[tuple[int, Tensor]], list[Tensor]]:
    """Re-run layer ``index`` with grad under its forward's RNG and autocast state: (outputs, inputs, weights).

    The caller owns the layer's slot until it releases it after the gradients are computed.
    """
    transfer = owner.transfer
    leaves = list(ctx.other_leaves)
    for pos, saved in zip(ctx.saved_positions, ctx.saved_tensors):
        leaves[pos] = saved
    inputs_needing_grad: list[tuple[int, Tensor]] = []
    if ctx.segment is not None:  # restored or replayed from the segment's checkpoint ([Note: recompute segments])
        # replayed as the forward ran: eagerly where it recorded ([Note: recorded outputs])
        replay = functools.partial(owner.run_streamed, eager=bool(ctx.recorded_keys))
        restored = [ctx.segment.input(index, transfer, replay)]
    else:
        restored = [transfer.unstash(stashed) for stashed in ctx.stashed]
    for pos, x in zip(ctx.stashed_positions, restored):
        if ctx.needs_input_grad[_LEADING_ARGS + pos]:
            x.requires_grad_(True)
            inputs_needing_grad.append((pos, x))
        leaves[pos] = x
    ctx.stashed = ctx.segment = None
    if owner.stashed.get(index) is not None:
        del owner.stashed[index]

    flat = transfer.acquire(index)
    previous = index - 1
    if previous not in owner.kept:  # a kept layer needs neither weights nor input in backward
        transfer.prefetch(owner.segments.weights_to_prefetch(previous))  # a segment's start when it replays
        segment = owner.segments.by_layer.get(previous)
        for stashed in [segment.checkpoint] if segment is not None else owner.stashed.get(previous, ()):
            transfer.prefetch_stash(stashed)
    weights = _weight_leaves(owner.groups[index], flat)
    policy = owner.policy
    input_bytes = sum(leaves[pos].numel() * leaves[pos].element_size() for pos in ctx.stashed_positions)
    before = torch.cuda.memory_allocated(transfer.device) if policy.calibrating else 0
    with (
        torch.profiler.record_function(f"megatrain::recompute_layer_{index}"),
        replay_state(owner.device_type, ctx.rng, ctx.autocast),
        torch.enable_grad(),
        owner.memo_replaying(index, ctx.memo),
    ):
        args, kwargs = pytree.tree_unflatten(leaves, ctx.spec)
        output, recorded = owner.run_recording(index, weights, args, kwargs, ctx.recorded_keys)
    if policy.calibrating:
        policy.measure_recompute(torch.cuda.memory_allocated(transfer.device) - before, input_bytes)
    if len(recorded) != ctx.n_recorded:
        raise RuntimeError(
            f"MegaTrain: layer {index}'s recompute recorded {len(recorded)} outputs (router logits), its forward "
            f"{ctx.n_recorded}: the layer's code took another path on the same inputs and RNG state. HINT: keep the "
            "layer's graph instead (keep_layers), or turn output_router_logits off."
        )
    outs = [x for x in pytree.tree_leaves(output) if isinstance(x, Tensor)] + [r.value for r in recorded]
    return outs, inputs_needing_grad, weights
