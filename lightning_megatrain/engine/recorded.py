"""Outputs that transformers records from inside decoder layers (MoE router logits), trained through the streamed
layers: the router auxiliary losses get their gradient.

[Note: recorded outputs]
What: transformers 5.x collects some per-layer tensors not from what a layer returns but with forward hooks on its
submodules: the ``OutputRecorder`` entries of a model class's ``_can_record_outputs``, e.g. Mixtral's
``"router_logits": OutputRecorder(MixtralTopKRouter, index=0)``, recording while the backbone's forward (decorated
with ``capture_outputs``) runs with ``output_router_logits`` on (as an argument, else from the config). The causal LM
then computes the router auxiliary loss from ``outputs.router_logits``, as its family defines it (Mixtral, Qwen3-MoE,
gpt-oss and 19 more: HF's load-balancing loss ``load_balancing_loss_func``, times ``router_aux_loss_coef``, added to
the loss). A streamed layer runs inside one autograd node ([Note: streamed layer] in engine/streamed.py), without grad
in forward: the recorded logits would carry no graph (a kept layer's would lead into its private weight copy), and the
aux loss would change the loss's value but not one gradient. So the recorded tensors become outputs of the node
(only the model classes' ``_can_record_outputs`` and ``OutputRecorder``'s fields are read, the same in transformers
5.17 and 5.24; never transformers' collector of recorded outputs):

1. At setup the engine hooks, in every layer, the submodules the recorders of the innermost ``PreTrainedModel``
   around the stack match (transformers' rules: the recorder's class, or a name suffix, and its ``layer_name``), for
   every key but ``hidden_states`` (the layer's own output, already the node's): the routers' logits, and the
   attention weights an eager attention returns under ``output_attentions``; and every ``PreTrainedModel`` around
   the stack with a pre-hook that reads which keys its call records (``output_<key>`` from the call's kwargs, else
   from its config, as ``capture_outputs`` decides) and a post-hook.
2. While a layer's forward runs in a call that records (the node's forward, kept or recomputed, or a forward without
   grad), the hooks append what the recorder records to a *capture frame*; the node returns those tensors after the
   layer's own outputs (detached aliases; a kept layer keeps its graph's own for backward).
3. Each post-hook replaces, in its module's output, every tensor transformers recorded by the node's output for it
   (by identity), so ``outputs.router_logits`` and the loss computed from it lead into the layers' nodes. Where a
   forward with grad still returns router logits without a graph (a transformers release that records them in a way
   this does not find), it raises rather than train a loss that moves nothing.
4. In backward autograd runs a layer's node once the gradients of all its outputs are in: the hidden states' from the
   next layer and the aux loss's for its recorded outputs. The recompute captures the same tensors again (the same
   code on the same weights, inputs and RNG state) and ``autograd.grad`` differentiates them with the aux loss's
   gradients beside the hidden states': the router weights get the aux loss's gradient, and through them the layer's
   input and every layer below. An output nothing differentiates gets no gradient and costs no backward work (the
   node does not materialize zeros for it).

Sequence tiles ([Note: sequence tiles] in engine/tiling.py) call the router once per tile: each tile captures into a
frame of its own and the tiles' captures are merged in the untiled (b, t) order, one per recorder call of the layer,
as the untiled layer records; the post-hook replaces the layer's run of per-tile tensors in transformers' list by the
one merged tensor (without, the list would hold one entry per tile, which the load-balancing loss cannot broadcast
against an attention mask). A segment's replay in backward ([Note: recompute segments] in engine/segments.py)
captures nothing: it only regenerates inputs.

Under ``compile_layers`` ([Note: compiled layers] in engine/compiled.py) a call that records runs its layers' own
forward, not the compiled one, in forward, recompute and segment replay alike (so the replays regenerate the
forward's inputs bitwise): transformers' recording hook reads a ``ContextVar``, which dynamo cannot trace, and the
graph break would run the layer's selective checkpoint eagerly, which refuses an in-place op on a saved matmul output
(gpt-oss adds its experts' biases in place: "Tensor cached during selective activation checkpoint has been
mutated"). A call that does not record stays compiled (the engine's hooks trace without a graph break).

Cost: the recorded outputs stay on the device from the forward to the backward (the output holds them and the aux
loss's graph saves their softmax): about 4 bytes per token, expert and MoE layer under bf16-mixed, 67 MB for
Mixtral-8x7B's 32 layers of 8 experts at 64K tokens per micro-batch, 1.5 GiB for Qwen3-30B-A3B's 48 layers of 128
(by the shapes, not measured). ``keep_layers="auto"`` sees them in the peak it calibrates on; ``megatrain plan`` does
not count them. Each node has one more output per router call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

# A key whose recorder targets the decoder layer itself: the layer's own output, already the node's.
_LAYER_OUTPUT_KEYS = frozenset({"hidden_states"})


class Recorded(NamedTuple):
    """One tensor a recorder captured in a layer: ``value`` (what the layer's node outputs for it) and ``sources``,
    the tensors transformers recorded for it (``(value,)``; the per-tile tensors where tiles were merged)."""

    value: Tensor
    sources: tuple[Tensor, ...]


@dataclass
class _Frame:
    keys: frozenset[str]
    items: list[Recorded] = field(default_factory=list)


# The capture frames of this thread, innermost last: a layer's run pushes one, a sequence tile one inside it.
_frames = threading.local()


def current_frame() -> _Frame | None:
    """The innermost capture frame of this thread, or None where nothing captures."""
    stack = getattr(_frames, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def capture(keys: frozenset[str]) -> Iterator[list[Recorded]]:
    """Capture what the hooked recorders of ``keys`` record in this thread while the block runs (nothing, with no
    keys); yields the list they append to."""
    if not keys:
        yield []
        return
    frame = _Frame(keys)
    stack = _frames.__dict__.setdefault("stack", [])
    stack.append(frame)
    try:
        yield frame.items
    finally:
        stack.pop()


def merge_tiles(per_tile: list[list[Recorded]], merge: Callable[[list[Tensor]], Tensor]) -> list[Recorded]:
    """The captures of each tile of a block, merged into what the untiled block captures: the ``k``-th of every tile,
    joined by ``merge`` (engine/tiling.py puts rows back in the untiled order).

    Raises:
        RuntimeError: the tiles captured different numbers of tensors (a block whose routers depend on the data).
    """
    counts = {len(items) for items in per_tile}
    if len(counts) != 1:
        raise RuntimeError(
            f"MegaTrainStrategy(seq_tile=...): the tiles of one block recorded {sorted(counts)} outputs (router "
            "logits) each; the untiled block records one set. HINT: use seq_tile=None for this model."
        )
    merged = []
    for k in range(counts.pop()):
        parts = [items[k] for items in per_tile]
        merged.append(Recorded(merge([p.value for p in parts]), tuple(s for p in parts for s in p.sources)))
    return merged


@dataclass(frozen=True)
class _Recorder:
    key: str
    index: int  # which element of a tuple output transformers records


# Stands for a per-tile tensor that the merged tensor of its layer replaces in transformers' list.
_DROP = object()


class RecordedOutputs:
    """The recorders inside a layer stack and the ``PreTrainedModel`` s around it, hooked by :meth:`install` (see
    [Note: recorded outputs]); :func:`find_recorded` builds it. Without recorders (a model that records nothing inside
    its layers, or whose recorders this does not find) no call records, and the ancestors' post-hooks refuse router
    logits without a graph; without ancestors (no transformers model) it hooks nothing."""

    def __init__(
        self, recorders: list[tuple[nn.Module, _Recorder]] = (), ancestors: list[nn.Module] = ()
    ) -> None:
        self.recorders = list(recorders)  # (module inside a layer, what transformers records from it)
        self.ancestors = list(ancestors)  # the PreTrainedModels around the stack, outermost first
        self.keys = frozenset(r.key for _, r in self.recorders)
        self._calls: list[frozenset[str]] = []  # the keys each call of an ancestor in progress records
        # id of a tensor transformers recorded -> (that tensor, kept alive so its id stays its own; what replaces it)
        self._replace: dict[int, tuple[Tensor, Any]] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        """Hook the recorders and the ancestors."""
        for module, recorder in self.recorders:
            self._handles.append(module.register_forward_hook(_RecordHook(recorder)))
        for model in self.ancestors:
            self._handles.append(model.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._exit, always_call=True))

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._calls, self._replace = [], {}

    def requested(self) -> frozenset[str]:
        """The keys the calls in progress record: what a layer running now captures (empty: nothing)."""
        return frozenset().union(*self._calls) if self._calls else frozenset()

    def replace(self, recorded: list[Recorded], outputs: tuple[Tensor, ...] | None = None) -> None:
        """The post-hooks replace each of ``recorded`` 's sources by its node output in ``outputs`` (by default its
        merged value; the first source only, the others are dropped)."""
        for item, value in zip(recorded, outputs if outputs is not None else [r.value for r in recorded]):
            first, *rest = item.sources
            if first is not value:
                self._replace[id(first)] = (first, value)
            for source in rest:
                self._replace[id(source)] = (source, _DROP)

    def _enter(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        config = getattr(model, "config", None)
        keys = set()
        for key in self.keys:
            flag = f"output_{key}"
            if kwargs[flag] if flag in kwargs else getattr(config, flag, False):
                keys.add(key)
        self._calls.append(frozenset(keys))

    def _exit(self, model: nn.Module, args: tuple, output: Any) -> Any:
        if self._calls:
            self._calls.pop()
        replaced = _replace(output, self._replace) if self._replace and output is not None else output
        if not self._calls:
            self._replace = {}  # the outermost call returned: nothing recorded in it is looked up again
        if torch.is_grad_enabled() and isinstance(replaced, dict):
            _check_router_logits(model, replaced.get("router_logits"))
        return None if replaced is output else replaced


class _RecordHook:
    """Forward hook on a recorder's module: appends what transformers records to the thread's capture frame."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        frame = current_frame()
        if frame is None or self.recorder.key not in frame.keys:
            return
        value = output[self.recorder.index] if isinstance(output, tuple) else output
        if isinstance(value, Tensor):
            frame.items.append(Recorded(value, (value,)))


def _check_router_logits(model: nn.Module, router_logits: Any) -> None:
    """Refuse router logits without a graph in a forward with grad: a streamed layer recorded them where the engine
    found no recorder (a transformers release that records them otherwise), and their loss would train nothing.

    Raises:
        RuntimeError: naming the model class; HINT: turn ``output_router_logits`` off.
    """
    if isinstance(router_logits, (tuple, list)) and any(
        isinstance(t, Tensor) and t.is_floating_point() and not t.requires_grad for t in router_logits
    ):
        raise RuntimeError(
            f"MegaTrainStrategy: {type(model).__name__} returned router logits without a gradient path: the streamed "
            "layers ran without grad and the engine found no recorder of them in the model's _can_record_outputs "
            "(see [Note: recorded outputs] in lightning_megatrain/engine/recorded.py), so a router auxiliary loss "
            "would train nothing. HINT: set output_router_logits=False (argument or config), or use a transformers "
            "release whose models declare their router recorders in _can_record_outputs."
        )


def find_recorded(root: nn.Module, path: str, stack: nn.Module) -> RecordedOutputs:
    """The recorders inside ``stack`` (at dotted ``path`` in ``root``): those of the innermost ``PreTrainedModel`` on
    the path, which transformers applies below it, for every key but the layers' own outputs."""
    parts = path.split(".")
    ancestors, governing_depth, module = [], 0, root
    for depth in range(len(parts)):  # root, then each module on the path above the stack
        module = getattr(module, parts[depth - 1]) if depth else root
        if isinstance(module, PreTrainedModel):
            ancestors.append(module)
            governing_depth = depth
    if not ancestors:
        return RecordedOutputs()
    # names as transformers' hooks see them: relative to the innermost model, with a leading dot
    base = "." + ".".join(parts[governing_depth:])
    recorders = []
    for name, sub in stack.named_modules(prefix=base):
        if name.count(".") > base.count(".") + 1:  # inside a layer (not the stack, not a layer itself)
            recorders.extend((sub, recorder) for recorder in _recorders(ancestors[-1], name, sub))
    return RecordedOutputs(recorders, ancestors)


def _recorders(model: PreTrainedModel, name: str, module: nn.Module) -> list[_Recorder]:
    """What ``model`` 's ``_can_record_outputs`` records from ``module`` named ``name`` (transformers' matching in
    ``recursively_install_hooks``: by class or name suffix, then ``layer_name``)."""
    found = []
    for key, specs in (getattr(type(model), "_can_record_outputs", None) or {}).items():
        if key in _LAYER_OUTPUT_KEYS:
            continue
        for spec in specs if isinstance(specs, list) else [specs]:
            # shorthands: a class, or a class-name suffix, recording the second element of a tuple output
            if isinstance(spec, type):
                target, suffix, layer_name, index = spec, None, None, 1
            elif isinstance(spec, str):
                target, suffix, layer_name, index = None, spec, None, 1
            else:
                target = getattr(spec, "target_class", None)
                suffix = getattr(spec, "class_name", None)
                layer_name = getattr(spec, "layer_name", None)
                index = getattr(spec, "index", 0)
            matches = (target is not None and isinstance(module, target)) or (
                suffix is not None and name.endswith(suffix)
            )
            if matches and (layer_name is None or f".{layer_name.strip('.')}." in name + "."):
                found.append(_Recorder(key, index))
    return found


def _replace(value: Any, table: dict[int, tuple[Tensor, Any]]) -> Any:
    """``value`` with every tensor in ``table`` replaced (dropped where it maps to ``_DROP``); ``value`` itself where
    nothing changed. Model outputs (dicts) are updated in place: their type and other fields stay."""
    if isinstance(value, Tensor):
        entry = table.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else value
    if isinstance(value, (tuple, list)):
        items = [_replace(x, table) for x in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        items = [x for x in items if x is not _DROP]
        return type(value)(items) if type(value) in (tuple, list) else type(value)(*items)
    if isinstance(value, dict):
        for key, item in list(value.items()):
            new = _replace(item, table)
            if new is not item:
                value[key] = new
        return value
    return value
