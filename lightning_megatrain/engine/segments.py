"""Recompute segments: fewer layer-input checkpoints, the layers between them replayed in backward.

[Note: recompute segments]
A recomputed layer saves its input (B x T x H in the residual stream's dtype, fp32 under bf16-mixed) for its
recompute: one checkpoint per layer. At long context those no longer fit anywhere: the Llama-2-7B shape at 524,288
tokens has 8 GiB per layer input, 256 GiB for 32 layers, beside a 141 GiB GPU and a 128 GiB host that already holds
the model's state. With ``segment_layers = k > 1`` the recomputed layers of a micro-batch form segments of ``k``
consecutive layers and only a segment's first layer saves its input (stashed as before: offloaded to pinned host
memory, or kept on the GPU for the last ``device_checkpoints`` checkpoints). Its other layers record only what a
replay needs (:class:`LayerRecord`: the non-activation inputs such as rotary tables and masks, the RNG and autocast
state), never their input.

In backward, the first layer of a segment to need its input (the segment's last, as backward runs in reverse)
restores the checkpoint and replays the segment's forward up to itself without grad (:meth:`Segment.input`),
under each layer's saved RNG and autocast state, keeping the regenerated inputs on the device; each layer then pops
its own input, recomputes with grad as before and frees it. Cost: ``k - 1`` more layer forwards per segment (without
grad), and at most ``k`` layer inputs on the device at once during the segment's backward, against ``L`` checkpoints
held from forward to backward without segments. The regenerated inputs are bitwise the forward's: the same layer
code (the same compiled graph under ``compile_layers``) on the same weights, inputs and RNG state.

Nested: where even one checkpoint per segment and a segment's ``k - 1`` regenerated inputs do not fit (the
Llama-2-7B shape at 524,288 tokens: at best 11 inputs of 8 GiB alive, with room for 9), ``sub_segment_layers = m``
makes a replay keep only every ``m``-th regenerated input (a sub-checkpoint) and those of the sub-segment its
target lies in (:func:`kept_in_replay`); each lower sub-segment is replayed again from its sub-checkpoint when
backward reaches it. A segment then holds at most ``(k - 1) // m + m - 1`` regenerated inputs instead of ``k - 1``
(``k = 8, m = 3``: 3 instead of 7, the bound 4) for ``m - 1`` more layer forwards per lower sub-segment
(:func:`replay_schedule` counts both exactly; the planner reads it). ``m = 1`` (or ``m >= k``) keeps them all: flat.

A layer joins the open segment only when its one activation input *is* the previous layer's first output (the
tensor object itself, as ``hidden_states = layer(hidden_states, ...)`` passes it); anything else (a model that
changes the residual stream between layers, a layer with two activation inputs) starts a new segment, saving its
input, so the replay never assumes a data flow the model does not have. ``segment_layers=1`` leaves all of this off.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

RngState = tuple[Tensor, Tensor | None]  # CPU generator state, CUDA generator state (None off CUDA)
AutocastState = tuple[bool, torch.dtype, bool]  # enabled, dtype, cache enabled


def autocast_state(device_type: str) -> AutocastState:
    """The autocast state a layer's forward runs under, for its replay and recompute (:func:`replay_state`).

    The cast cache's flag is part of it: dynamo guards a compiled layer on it with the grad mode. Lightning's
    precision plugins enter autocast with the cache off, and the recompute runs in the backward's thread, where it
    is on; a recompute that left it as it found it got a graph of its own, and the first kept layer's forward (grad
    on, cache off) a third one, compiled in the second step (on the H200, the Llama-3.2-3B shape at 32,768 tokens:
    7.2 s against 2.9 s for the later steps, 2.9 s once the flag was replayed)."""
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def replay_state(device_type: str, rng: RngState, autocast: AutocastState) -> Iterator[None]:
    """Run under a forward's saved RNG and autocast state (:func:`autocast_state`), restoring the caller's RNG after
    (dropout masks replay)."""
    cpu_rng, device_rng = rng
    enabled, dtype, cache = autocast
    with (
        torch.random.fork_rng(devices=[torch.cuda.current_device()] if device_rng is not None else []),
        torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache),
    ):
        torch.set_rng_state(cpu_rng)
        if device_rng is not None:
            torch.cuda.set_rng_state(device_rng)
        yield


@dataclass
class LayerRecord:
    """What replaying one layer's forward needs, its activation input aside."""

    index: int
    spec: Any  # pytree spec of the layer's (args, kwargs)
    leaves: list  # the layer's input leaves, the activation input replaced by None
    position: int  # where the activation input sits among ``leaves``
    rng: RngState
    autocast: AutocastState


# Runs layer ``index`` without grad on (args, kwargs) with its weights acquired: StreamedLayers.run_streamed.
ReplayLayer = Callable[[int, tuple, dict], Any]


def kept_in_replay(j: int, target: int, sub: int) -> bool:
    """Whether a replay toward the input of position ``target`` keeps the regenerated input of position ``j``
    (positions count from the segment's first layer, ``j <= target``): a sub-checkpoint (every ``sub``-th), or in
    the target's sub-segment. ``sub = 1`` keeps every one (see the module note)."""
    return j % sub == 0 or j >= target // sub * sub


@functools.cache
def replay_schedule(k: int, sub: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """For a segment of ``k`` layers with sub-segments of ``sub``, as :meth:`Segment.input` runs it: the most
    regenerated inputs alive at once (the checkpoint not counted), and per position the positions whose forward is
    replayed just before that layer's backward. Cached: the planner asks for many ``(k, sub)`` at every length."""
    alive: set[int] = set()
    peak, replays = 0, [()] * k
    for target in range(k - 1, 0, -1):  # backward: the segment's last layer first; position 0 is the checkpoint
        if target not in alive:
            first = max((j for j in alive if j < target), default=0)
            replays[target] = tuple(range(first, target))
            alive.update(j for j in range(first + 1, target + 1) if kept_in_replay(j, target, sub))
        peak = max(peak, len(alive))
        alive.discard(target)
    return peak, tuple(replays)


@dataclass
class Segment:
    """Consecutive recomputed layers whose inputs all derive from the first one's checkpoint (see the module note)."""

    start: int
    checkpoint: Any  # the transfer's stash handle of layer ``start``'s input; None once restored
    sub: int = 1  # sub_segment_layers: a replay keeps every ``sub``-th input and its target's sub-segment
    records: list[LayerRecord] = field(default_factory=list)  # layers start, start + 1, ... in order
    inputs: dict[int, Tensor] = field(default_factory=dict)  # regenerated inputs on the device, popped by each layer

    def replay_from(self, index: int) -> int:
        """The layer a replay toward layer ``index``'s input starts at: the nearest input below it still held (the
        checkpoint, or a sub-checkpoint)."""
        return max((j for j in self.inputs if j < index), default=self.start)

    def input(self, index: int, transfer: Any, replay_layer: ReplayLayer) -> Tensor:
        """Layer ``index``'s input on the device: restored, or regenerated by replaying the segment up to it."""
        if index not in self.inputs:
            if self.start not in self.inputs:
                self.inputs[self.start] = transfer.unstash(self.checkpoint)
                self.checkpoint = None
            # backward runs in reverse: the layers after ``index`` have taken their inputs, the ones before have not
            first = self.replay_from(index)
            x = self.inputs[first]
            for record in self.records[first - self.start : index - self.start]:
                leaves = list(record.leaves)
                leaves[record.position] = x
                with torch.profiler.record_function(f"megatrain::replay_layer_{record.index}"):
                    with replay_state(transfer.device.type, record.rng, record.autocast), torch.no_grad():
                        args, kwargs = pytree.tree_unflatten(leaves, record.spec)
                        output = replay_layer(record.index, args, kwargs)
                x = next(t for t in pytree.tree_leaves(output) if isinstance(t, Tensor))
                j = record.index + 1
                if kept_in_replay(j - self.start, index - self.start, self.sub):
                    self.inputs[j] = x
        del self.records[index - self.start :]  # later replays run only the layers below this one
        return self.inputs.pop(index)

    def needs_replay(self, index: int) -> bool:
        """Whether layer ``index``'s input must still be regenerated (its backward starts with a replay)."""
        return index != self.start and index not in self.inputs


class Segments:
    """Groups a micro-batch's recomputed layers into segments as their forwards run (see the module note)."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.layers = 1  # segment_layers
        self.sub = 1  # sub_segment_layers
        self.device_checkpoints = 0
        self.by_layer: dict[int, Segment] = {}  # hint for backward's prefetch; the authority is each node's segment
        self._open: Segment | None = None
        self._last: tuple[int, weakref.ref] | None = None  # (index, the first output) of the last recomputed layer
        self._on_device = 0  # checkpoints kept on the device in this micro-batch's forward

    def configure(self, segment_layers: int, device_checkpoints: int, sub_segment_layers: int = 1) -> None:
        self.layers, self.device_checkpoints, self.sub = segment_layers, device_checkpoints, sub_segment_layers

    def reset(self) -> None:
        """A training micro-batch's forward begins, or the last one's backward ended (or it has none: a forward
        without grad): no segment is open and the hints let go of the segments, which their nodes own."""
        self._open = self._last = None
        self._on_device = 0
        self.by_layer.clear()

    def on_device(self, index: int) -> bool:
        """Whether a checkpoint saved at layer ``index`` stays on the device: among the last ``device_checkpoints``
        of the stack (the ones backward restores first), and never more than ``device_checkpoints`` in a micro-batch
        (where the chain breaks, layers in that range save their own inputs too)."""
        keep = (math.ceil((self.n_layers - index) / self.layers) <= self.device_checkpoints
                and self._on_device < self.device_checkpoints)
        self._on_device += keep
        return keep

    def join(self, index: int, leaves: list, positions: list[int]) -> Segment | None:
        """The open segment layer ``index`` joins, its input then replayed in backward; None: it saves a checkpoint
        (and opens a segment with :meth:`open` when segments are on)."""
        seg, last = self._open, self._last
        if seg is None or last is None or len(positions) != 1 or len(seg.records) >= self.layers:
            return None
        last_index, last_output = last
        if last_index != index - 1 or leaves[positions[0]] is not last_output():
            return None
        self.by_layer[index] = seg
        return seg

    def open(self, index: int, checkpoint: Any) -> Segment:
        """Layer ``index`` saved ``checkpoint`` and starts a segment."""
        self._open = self.by_layer[index] = Segment(index, checkpoint, self.sub)
        return self._open

    def close(self) -> None:
        """The next layer starts afresh (a layer that keeps its graph ran)."""
        self._open = self._last = None

    def produced(self, index: int, output: Any) -> None:
        """Recomputed layer ``index`` returned ``output``: its first tensor is what the next layer may chain on."""
        first = next((t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)), None)
        self._last = (index, weakref.ref(first)) if first is not None else None

    def weights_to_prefetch(self, index: int) -> int:
        """The layer whose weights backward needs first when layer ``index`` is next: where its replay starts (the
        segment's start, or a sub-checkpoint's layer) when its backward begins with one."""
        seg = self.by_layer.get(index)
        return seg.replay_from(index) if seg is not None and seg.needs_replay(index) else index
