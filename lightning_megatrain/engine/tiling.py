"""Sequence tiles: the position-wise block of each decoder layer (its MLP or MoE block), and where allowed the norms
folded into tiles (engine/folded_norms.py), run a tile of positions at a time, in forward and in the recompute.

[Note: sequence tiles]
What: the block a decoder layer applies to each position alone (``mlp``, ``block_sparse_moe``, ``feed_forward`` or
``ffn``, see ``BLOCK_NAMES``) gets a ``forward`` that splits its input [B, T, H] along T into tiles of ``t =
tile_length(seq_tile, T)`` positions, runs the block's own forward on each and concatenates the outputs; a block that
also returns rows flattened to [B * t, E] (MoE router logits or scores) gets them back in the untiled (b, t) order, and
router logits transformers records inside the block are merged the same way ([Note: recorded outputs] in
engine/recorded.py). Attention is untouched: it is not position-wise, and a block that mixes positions (an MoE router
with a capacity over all tokens) would compute something else tiled: ``seq_tile=None`` for such a model. The dropless
routers of the HF families route each token alone. Without grad the tiles just run one after the other. With grad each
tile runs under a non-reentrant ``torch.utils.checkpoint``, which saves only the tile's input (a view of the block's
input) and re-runs the tile inside backward, so one tile's intermediates are alive at a time, in the engine's recompute
and its backward alike (engine/streamed.py, [Note: streamed layer]).

The norm before the block, and the norm before attention in the tiles of the attention's input projections, are
folded into tiles where the family allows it: which, how, what that saves and costs, and what a folded norm's hooks
then see are in [Note: folded norms] (engine/folded_norms.py). Other families keep their norms untiled.

Memory: an eager Llama MLP with grad holds 4 tensors of [B, T, I] until backward (gate and up projections, SiLU of
gate, their product) and about 3 more at once in backward (their grads): at the 7B shape (H 4096, I 11008), B = 1
and T = 512K in bf16 each is T * I * 2 bytes = 10.8 GiB, 43 GiB held. Tiled, the same counts apply to [B, t, I]:
about 7 * B * t * I * bytes at the peak, 2.3 GiB for t = 16,384 (344 MiB per tensor), whatever T. What stays
[B, T, H]: the block's input (kept alive by the tiles' views of it), its output, and while ``torch.cat`` runs a
second copy of the output (the tiles' outputs), 4 GiB each at 512K (with the norm before it folded, the block's
input is the residual stream, which the layer keeps anyway: [Note: folded norms]). An MoE block's intermediates are
those of the routed copies, B * t * top_k rows of each expert's width; its router logits [B * T, E] are kept whole.

Compute: a tile under a checkpoint runs its forward twice with grad, so the block's forward runs once more per
step: three times instead of two in a recomputed layer (forward without grad, the recompute, the re-run in
backward), twice instead of once in a kept layer. At the 7B shape a layer's forward spends about 2 * 3 * H * I
FLOPs per position in the MLP, 2 * 4 * H^2 in the attention projections and 2 * T * H in causal attention; a step
of a recomputed layer costs about four forwards, so one more MLP forward adds about 10% of the layer's compute at
T = 32K (the MLP is 40% of its forward) and 1.4% at 512K (6%). Hence ``seq_tile="auto"`` tiles only rows longer
than ``AUTO_MIN_POSITIONS`` = 32,768: below, the block holds at most 4 * 32K * I * 2 bytes = 2.7 GiB at 7B, not
worth 10% of the compute; above, attention dominates the FLOPs and the block's memory grows to tens of GiB. Its
tiles of ``AUTO_TILE`` = 16,384 positions keep the block's matmuls large ([B * t, H] x [H, I]).

Equality: the tiles compute each position as the untiled block does. Measured in fp32 on the CPU (and tested,
tests/engine/test_tiling.py): a dense MLP's output and input grad are bitwise those of the untiled block (a
position's row is the same GEMM row; a GPU's GEMM may pick other kernels per shape, so there only within rounding);
weight grads add the tiles' partial sums, another summation order: ~2e-7 relative. An MoE block groups each tile's
tokens by expert (other GEMM shapes, another order): output and grads within ~1e-7; its router outputs bitwise.
Folded norms: [Note: folded norms].

Randomness: the checkpoint saves the RNG state (the CPU's, and the device's of a CUDA tile) before each tile and
restores it when re-running the tile in backward, and the engine's recompute restores the layer's, so dropout inside
a block replays the forward's masks. Such a block (dropout, Mixtral's ``router_jitter_noise`` in training) draws
its random numbers tile by tile, though: its masks are not the untiled run's, only from the same distribution. No
family the tests train draws any inside the block (Phi-3's ``resid_mlp_dropout`` is applied outside it).

Compiled layers ([Note: compiled layers] in engine/compiled.py): dynamo traces the tiles into the layer's graph,
each as a nested checkpoint region, without a graph break. The regions' tags override the layer's selective policy,
so the graph saves the block's input, not every tile's matmul outputs, and inductor's backward re-runs each tile
just before that tile's backward, reusing the tile's buffers (read off the generated code on the CPU, 8 tiles: peak
of the backward's own buffers 0.84 * T * I values instead of 4.0). Results (measured with the norm untiled): output
and input grad bitwise those of the untiled compiled layer, weight grads within 2e-7 (CPU). The tiled forward is a
method all blocks share (bound per block, with its state in block attributes), and so is the folded norm's, so
dynamo guards on one function each and one graph per grad mode serves every layer and tile. The number of tiles is
part of the graph, though: a row length with another number of tiles compiles again (once per grad mode; within a
count T stays dynamic), and past dynamo's ``recompile_limit`` (8 per function) new counts run eagerly. Packed rows
of one length compile once. Where the layer runs eagerly (dynamo could not trace it, or the limit), the selective
checkpoint's cache would keep every tile's matmul outputs until the layer's backward; its policy asks
:func:`inside_tile` and leaves a tile's ops to the tile's own checkpoint.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from lightning_megatrain.config import Auto
from lightning_megatrain.engine.recorded import capture, current_frame, merge_tiles

log = logging.getLogger(__name__)

# ``seq_tile="auto"`` tiles only rows longer than this many positions: below it the block's transient memory is small
# next to a layer's saved activations, and a tiled block inside a kept layer's graph is recomputed in backward.
AUTO_MIN_POSITIONS = 32_768
# ``seq_tile="auto"``'s tile: long enough that the block's matmuls stay efficient ([tile * B, H] x [H, I]).
AUTO_TILE = 16_384

# Attribute names of a decoder layer's position-wise block, tried in this order: ``mlp`` (Llama, Qwen2/3, Mistral,
# Gemma, Phi-3, and in transformers 5.x also the MoE blocks of Mixtral, Qwen3-MoE and gpt-oss), ``block_sparse_moe``
# (Mixtral and Granite-MoE in older transformers), ``feed_forward`` (Llama 4, Jamba), ``ffn`` (DBRX).
BLOCK_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn")

# Tiles running eagerly on this thread (``depth``): the compiled layer's selective checkpoint policy
# (engine/streamed.py) reads it and leaves their ops to the tiles' own checkpoints (see [Note: sequence tiles]).
_running = threading.local()


def tile_length(seq_tile: int | Auto | None, seq_len: int) -> int | None:
    """Positions per tile for rows of ``seq_len`` positions under ``seq_tile``; None when the block runs untiled."""
    if seq_tile is None:
        return None
    if seq_tile == "auto":
        return AUTO_TILE if seq_len > AUTO_MIN_POSITIONS else None
    return seq_tile if seq_len > seq_tile else None


def _tile(seq_tile: int | Auto | None, hidden: Tensor) -> int | None:
    """Positions per tile for a call on ``hidden`` [B, T, H] (None: untiled). The one decision the tiled block and
    its folded norm both take, each from its own input (the same T), so they cannot disagree."""
    return tile_length(seq_tile, hidden.shape[1]) if hidden.dim() == 3 else None


def find_block(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The decoder layer's position-wise block as ``(attribute, module)``, or None (see ``BLOCK_NAMES``)."""
    for name in BLOCK_NAMES:
        block = getattr(layer, name, None)
        if isinstance(block, nn.Module):
            return name, block
    return None


def run_tiled(forward: Callable[[Tensor], Any], hidden: Tensor, tile: int) -> Any:
    """``forward(hidden)`` for a position-wise ``forward`` on ``hidden`` [B, T, H], ``tile`` positions at a time.

    With grad each tile runs under a non-reentrant ``checkpoint``: it saves the tile's input (a view of ``hidden``)
    and re-runs the tile in backward, so only one tile's intermediates are alive at a time. Outputs are put back in
    the untiled order: tensors shaped [B, t, ...] are concatenated along T, tensors flattened to [B * t, ...] (MoE
    router logits or scores) along the (b, t) rows; other outputs (None, ints) must be equal across tiles.

    Raises:
        ValueError: an output leaf that is neither (a scalar aux loss, a tensor of another shape): no per-position
            layout to reassemble it in. HINT in the message: ``seq_tile=None``.
    """
    batch = hidden.shape[0]
    tiles = hidden.split(tile, dim=1)  # views: [B, t, H], the last one shorter where tile does not divide T
    lengths = [x.shape[1] for x in tiles]
    frame = current_frame()  # a recording call: each tile captures apart ([Note: recorded outputs])
    outputs, captured = [], []
    for x in tiles:
        with capture(frame.keys if frame is not None else frozenset()) as recorded:
            if torch.is_grad_enabled():  # saves the tile's input and its RNG state; re-runs the tile in backward
                outputs.append(checkpoint(_run_tile, forward, x, use_reentrant=False))
            else:
                outputs.append(_run_tile(forward, x))
        captured.append(recorded)
    if frame is not None:  # one per router call, in the untiled order, as the untiled block records
        frame.items.extend(merge_tiles(captured, lambda parts: _merge(parts, batch, lengths, hidden.dim())))
    flat, spec = zip(*(pytree.tree_flatten(o) for o in outputs))
    merged = [_merge([leaves[k] for leaves in flat], batch, lengths, hidden.dim()) for k in range(len(flat[0]))]
    return pytree.tree_unflatten(merged, spec[0])


def inside_tile() -> bool:
    """Whether this thread is running a tile eagerly (under dynamo the tile is traced and this stays False)."""
    return getattr(_running, "depth", 0) > 0


def _run_tile(forward: Callable[[Tensor], Any], x: Tensor) -> Any:
    # Inside the checkpoint (with grad): the copy a [B, t, H] slice needs for B > 1 (blocks ``view`` it to
    # [B * t, H]) is made again in backward, not saved beside the slice.
    if torch.compiler.is_compiling():  # traced: the nested checkpoint's own tags keep the tile's outputs unsaved
        return forward(x.contiguous())
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        return forward(x.contiguous())
    finally:
        _running.depth -= 1


def _merge(leaves: list[Any], batch: int, lengths: list[int], ndim: int) -> Any:
    """One output leaf of every tile, put back in the untiled order."""
    first = leaves[0]
    if not isinstance(first, Tensor):
        if any(leaf != first for leaf in leaves[1:]):
            raise ValueError(_cannot_merge(first))
        return first
    shapes = [tuple(leaf.shape) for leaf in leaves]
    if all(s[:2] == (batch, t) and len(s) == ndim for s, t in zip(shapes, lengths)):
        return torch.cat(leaves, dim=1)  # [B, t, ...] -> [B, T, ...]
    if all(len(s) >= 1 and s[0] == batch * t for s, t in zip(shapes, lengths)):
        # rows flattened in (b, t) order: [B * t, ...] -> [B, t, ...] -> [B, T, ...] -> [B * T, ...]
        per_row = [leaf.reshape(batch, t, *leaf.shape[1:]) for leaf, t in zip(leaves, lengths)]
        return torch.cat(per_row, dim=1).flatten(0, 1)
    raise ValueError(_cannot_merge(first))


def _cannot_merge(leaf: Any) -> str:
    what = f"a tensor of shape {tuple(leaf.shape)}" if isinstance(leaf, Tensor) else repr(leaf)
    return (
        f"MegaTrainStrategy(seq_tile=...): a decoder layer's position-wise block returned {what}, which is neither "
        "[B, t, ...] nor [B * t, ...] for a tile of t positions, so tiles cannot be put back together. HINT: use "
        "seq_tile=None for this model."
    )


def _tiled_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    """A block's ``forward``, tiled along T when :func:`tile_length` says so for the actual sequence length; a block
    with a folded norm then gets the norm's input and applies the norm in each tile.

    Installed as a method bound to each block, reading the block's own forward, ``seq_tile`` and the folded norm's
    own forward (or None) from attributes, not as a callable object per block: dynamo guards on the function, which
    all blocks share, so one compiled layer serves every layer (see [Note: compiled layers] in engine/compiled.py). A
    call with more than the hidden states (no HF block takes any) runs untiled.
    """
    untiled, norm = self._megatrain_untiled_forward, self._megatrain_norm
    tile = _tile(self._megatrain_seq_tile, hidden_states)
    if tile is None:
        return untiled(hidden_states, *args, **kwargs)
    if args or kwargs:  # untiled, but the folded norm returned its input: it runs here
        return untiled(hidden_states if norm is None else norm(hidden_states), *args, **kwargs)
    return run_tiled(untiled if norm is None else functools.partial(_after_norm, norm, untiled), hidden_states, tile)


def _after_norm(norm: Callable[[Tensor], Tensor], block: Callable[[Tensor], Any], x: Tensor) -> Any:
    """One tile of a block with a folded norm: [B, t, H] residual stream -> the block's outputs."""
    return block(norm(x))


class SequenceTiles:
    """Installs the tiled forward on the position-wise block of every layer of ``stack``, and the folds of
    engine/folded_norms.py ([Note: folded norms]): the folded forward on the norm before the block and on the norm
    before attention, the tiled forward on the attention's input projections, where that module allows;
    :meth:`uninstall` restores each module's own ``forward``."""

    def __init__(self, stack: nn.ModuleList, seq_tile: int | Auto) -> None:
        self.stack = stack
        self.seq_tile = seq_tile
        # the modules our forwards are installed on, each as (module, the instance ``forward`` it shadows or None,
        # ours, the attributes we set): the blocks, the norms before them, the norms before attention, the projections
        self.blocks: list[tuple[nn.Module, Any, Any, tuple[str, ...]]] = []
        self.norms: list[tuple[nn.Module, Any, Any, tuple[str, ...]]] = []
        self.input_norms: list[tuple[nn.Module, Any, Any, tuple[str, ...]]] = []
        self.projections: list[tuple[nn.Module, Any, Any, tuple[str, ...]]] = []

    def install(self) -> None:
        # here, not at the top: folded_norms.py builds on this module's find_block and _tile
        from lightning_megatrain.engine.folded_norms import _folded_norm_forward, folded_attention, folded_norms

        missing, names, norm_names, projection_names = set(), set(), set(), set()
        folds = zip(self.stack, folded_norms(self.stack), folded_attention(self.stack))
        for layer, folded, attention in folds:
            found = find_block(layer)
            if found is None:
                missing.add(type(layer).__name__)
                continue
            name, block = found
            names.add(name)
            norm = None
            if folded is not None:
                norm_names.add(folded[0])
                norm = self._shadow(folded[1], _folded_norm_forward, self.norms, "unfolded")
            self._shadow(block, _tiled_forward, self.blocks, "untiled", norm=norm)
            if attention is not None:
                _, input_norm, projections = attention
                input_norm = self._shadow(input_norm, _folded_norm_forward, self.input_norms, "unfolded")
                for path, projection in projections:
                    projection_names.add(path)
                    self._shadow(projection, _tiled_forward, self.projections, "untiled", norm=input_norm)
        if self.blocks:
            when = (
                f"tiles of {AUTO_TILE} positions for rows longer than {AUTO_MIN_POSITIONS}"
                if self.seq_tile == "auto"
                else f"tiles of {self.seq_tile} positions"
            )
            log.info(
                "MegaTrain: seq_tile=%r: the position-wise block ('%s') of %d layers runs in %s",
                self.seq_tile,
                "', '".join(sorted(names)),
                len(self.blocks),
                when,
            )
        if self.norms:
            log.info(
                "MegaTrain: seq_tile=%r: the norm before the block ('%s') of %d layers runs inside each tile",
                self.seq_tile,
                "', '".join(sorted(norm_names)),
                len(self.norms),
            )
        if self.input_norms:
            log.info(
                "MegaTrain: seq_tile=%r: the norm before attention ('input_layernorm') of %d layers runs inside the "
                "tiles of its projections ('%s'), which run tiled",
                self.seq_tile,
                len(self.input_norms),
                "', '".join(sorted(projection_names)),
            )
        if missing:
            log.info(
                "MegaTrain: seq_tile=%r: no position-wise block (an attribute named one of %s) in %s; those layers "
                "run untiled",
                self.seq_tile,
                ", ".join(BLOCK_NAMES),
                ", ".join(sorted(missing)),
            )

    def _shadow(self, module: nn.Module, forward: Callable, installed: list, own: str, **more: Any) -> Callable:
        """Install ``forward`` bound to ``module`` (an instance attribute shadows the class method), keeping its own
        ``forward`` as ``_megatrain_{own}_forward``, ``seq_tile`` and ``more`` (a tiled forward's ``norm``: the folded
        norm's own forward, or None) as ``_megatrain_*`` attributes; returns the module's own forward."""
        previous = module.forward
        state = {f"_megatrain_{own}_forward": previous, "_megatrain_seq_tile": self.seq_tile}
        state.update({f"_megatrain_{key}": value for key, value in more.items()})
        for key, value in state.items():
            setattr(module, key, value)
        ours = types.MethodType(forward, module)
        installed.append((module, module.__dict__.get("forward"), ours, tuple(state)))
        module.forward = ours
        return previous

    def uninstall(self) -> None:
        for module, shadowed, ours, state in [*self.blocks, *self.norms, *self.input_norms, *self.projections]:
            if module.__dict__.get("forward") is ours:
                del module.forward
                for key in state:
                    delattr(module, key)
                if shadowed is not None:
                    module.forward = shadowed
        self.blocks, self.norms, self.input_norms, self.projections = [], [], [], []
