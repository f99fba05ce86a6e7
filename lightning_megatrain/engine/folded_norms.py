"""Folded norms: where a decoder layer's rows run in sequence tiles (engine/tiling.py), the norm before the tiled
block and the norm before attention run inside the tiles of what reads them, instead of over the whole row.

[Note: folded norms]
What: a norm whose output only position-wise modules read is "folded" into them. Its ``forward`` returns its input
itself (the fp32 residual stream x) where the row is tiled (``_tile``, from the row's T), and each reader gets the
tiled forward of [Note: sequence tiles] with the norm's own forward applied in each tile: ``reader(norm(x_tile))``,
each tile under its own checkpoint, which saves only the tile's view of x (kept alive anyway: it is the residual
added after the layer's mixer or block). Both sides decide from their own input's T by one function, so they
cannot disagree; on rows that are not tiled the norm runs as itself and its readers untiled. Two folds:

- the norm before the position-wise block (``post_attention_layernorm``; Gemma2/3's ``pre_feedforward_layernorm``,
  whose ``post_attention_layernorm`` normalises the attention output before the residual add), read by the block
  alone in the families of ``FOLDED_NORMS``: the tiled block applies it (:func:`folded_norms`);
- the norm before attention (``input_layernorm``), read by the attention's input projections alone (``q_proj``,
  ``k_proj``, ``v_proj``; Phi-3's fused ``qkv_proj``) in the families of ``FOLDED_ATTENTION``: each projection runs
  tiled, applying the norm in each tile (:func:`folded_attention`). Attention itself stays untiled; it gets q, k
  and v whole, concatenated from the tiles.

Either fold is decided per layer, only where the norm and its readers appear nowhere else in the stack (not shared
between layers, not reused under another name), and the attention fold only in layers whose attention module holds
all the projections (not Qwen3.5's linear-attention layers). Other families keep their norms untiled.

Hooks: while the tiles are installed, a folded norm (either fold) called on a long row anywhere returns its input: a
forward hook on it (or code calling it outside the layer, a logit lens) sees the residual stream, not the normalised
values, and a forward hook on a projection it feeds sees the residual stream as that projection's input.

Memory (per token, H hidden, the 7B shape H = 4096): untiled, a norm saves its fp32 normalised value and rsqrt (4H
+ 4), and each Linear reading its fp32 output saves what it reads: under bf16 autocast its own bf16 copy (2H per
Linear, autocast caches only weights' casts), in fp32 the norm's output itself (4H, one tensor for all readers).
Folded, these exist for one tile at a time. Before the block (gate and up read it): (4H + 4) + 4H = 32 KB less at
7B (16 GiB per layer at 512K tokens), of which the tiled block held the norm's output as its input anyway. Before
attention (q, k, v read it): (4H + 4) + 3 * 2H = 10H + 4 under bf16 autocast, 40 KB at 7B (20 GiB per layer at 512K
tokens); 8H + 4 in fp32. planner/memory.py's ``_tiled`` has both.

Compute: the norm before attention now runs once per projection and tile (three passes over [T, H] instead of
one), in the forward without grad, in the recompute and again in each tile's checkpoint re-run, each pass followed
by its backward: about 12 passes instead of 3 per step of a recomputed layer. A pass is memory-bound (a pointwise
op and a reduction over H, a few reads and writes of [T, H] fp32; about 100 KB per token at 7B eager, fused to
about 32 KB compiled), next to the layer's matmuls (2 * 3 * H * I FLOPs per token in the MLP, 2 * 4 * H^2 in the
attention projections, 2 * T * H in causal attention, per forward): on the H200 (about 4.8 TB/s, 500 TFLOP/s
reached) the nine extra eager passes cost about 3% of a recomputed layer's step at T = 32K and 0.5% at 512K. The
checkpoints also re-run the projections' forward in backward (2 * 3 * H^2 FLOPs per token at 7B, once more per
step): 3.7% at 32K, 0.6% at 512K (planner/timing.py counts it with the block's re-run).

Equality (fp32, CPU; tests/engine/test_tiling.py): a folded norm computes each row as the untiled norm does, so the
block fold's outputs are bitwise those of the same tiles with the norm untiled. The attention fold runs the
projections on tiles of rows: other GEMM shapes, within rounding of the untiled projections (bitwise where the
CPU's GEMM rounds a row alike for every row count). Grads: the residual stream's grad adds the norms' paths per tile
(for the attention, three per tile: one per projection) before the residual add's grad, another summation order
(~1e-7), and the folded norms' and projections' weight grads sum tile partial sums.

Compiled layers ([Note: compiled layers]): the folded norm's forward is one function all folded norms share (bound
per norm, state in attributes), and the projections run the tiled forward the blocks share, so dynamo guards on one
function each and one graph per grad mode still serves every layer.
"""

from __future__ import annotations

from torch import Tensor, nn

from lightning_megatrain.engine.tiling import _tile, find_block

# Decoder layers (transformers' classes) whose norm before the position-wise block (``mlp`` in all of them) feeds only
# that block: its output is read by nothing else in the layer's forward (read off transformers 5.24's modeling code).
# Gemma2/3 apply ``post_attention_layernorm`` to the attention output before the residual add: theirs is
# ``pre_feedforward_layernorm``. Every other family keeps its norm untiled, among them Cohere (one norm's output feeds
# attention and MLP) and OLMo-2 (its ``post_attention_layernorm`` normalises the attention output; none before the
# MLP).
FOLDED_NORMS = {
    **dict.fromkeys(
        ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer",
         "MixtralDecoderLayer", "Phi3DecoderLayer", "GptOssDecoderLayer", "Qwen3_5DecoderLayer",
         "Qwen3_5MoeDecoderLayer", "Qwen3NextDecoderLayer"),
        "post_attention_layernorm",
    ),
    "Gemma2DecoderLayer": "pre_feedforward_layernorm",
    "Gemma3DecoderLayer": "pre_feedforward_layernorm",
}

# Decoder layers whose ``input_layernorm`` output goes only to ``self_attn``, and whose attention reads that input only
# through these projections (and its shape), read off transformers 5.24's modeling code: their outputs are then
# position-wise functions of each token's residual stream. Qwen3.5 and Qwen3-Next fold in their full-attention layers
# (``q_proj`` also computes the output gate, still per token); their linear-attention layers have no ``self_attn``.
# Every other family keeps its norm before attention untiled (not read, or like Cohere's, also read by the MLP).
ATTENTION_NORM, ATTENTION = "input_layernorm", "self_attn"
FOLDED_ATTENTION = {
    **dict.fromkeys(
        ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer",
         "MixtralDecoderLayer", "GptOssDecoderLayer", "Gemma2DecoderLayer", "Gemma3DecoderLayer",
         "Qwen3_5DecoderLayer", "Qwen3_5MoeDecoderLayer", "Qwen3NextDecoderLayer"),
        ("q_proj", "k_proj", "v_proj"),
    ),
    "Phi3DecoderLayer": ("qkv_proj",),
}


def folded_norms(stack: nn.ModuleList) -> list[tuple[str, nn.Module] | None]:
    """Per layer of ``stack``, the norm folded into its tiled block as ``(attribute, module)``, or None: the layer is
    a transformers decoder layer of a family in ``FOLDED_NORMS`` with that attribute and a block (:func:`find_block`),
    and the norm appears nowhere else in the stack (not shared between layers, not reused under another name)."""
    uses = _uses(stack)
    found: list[tuple[str, nn.Module] | None] = []
    for layer in stack:
        name = FOLDED_NORMS.get(type(layer).__name__) if _own(layer) else None
        norm = getattr(layer, name, None) if name else None
        found.append((name, norm) if isinstance(norm, nn.Module) and uses[id(norm)] == 1 else None)
    return found


def folded_attention(stack: nn.ModuleList) -> list[tuple[str, nn.Module, list[tuple[str, nn.Module]]] | None]:
    """Per layer of ``stack``, the norm before attention folded into the attention's input projections as ``(norm
    attribute, norm, [(projection path, projection), ...])``, paths like ``"self_attn.q_proj"``, or None: the layer
    is a transformers decoder layer of a family in ``FOLDED_ATTENTION`` with a block (:func:`find_block`), an attention
    module holding all of the family's projections, and neither the norm nor a projection appears elsewhere in the
    stack."""
    uses = _uses(stack)
    found: list[tuple[str, nn.Module, list[tuple[str, nn.Module]]] | None] = []
    for layer in stack:
        names = FOLDED_ATTENTION.get(type(layer).__name__, ()) if _own(layer) else ()
        attention, norm = getattr(layer, ATTENTION, None), getattr(layer, ATTENTION_NORM, None)
        projections = [(f"{ATTENTION}.{name}", getattr(attention, name, None)) for name in names]
        modules = [norm, *(m for _, m in projections)]
        fold = bool(names) and all(isinstance(m, nn.Module) and uses[id(m)] == 1 for m in modules)
        found.append((ATTENTION_NORM, norm, projections) if fold else None)
    return found


def _uses(stack: nn.ModuleList) -> dict[int, int]:
    """How many times each module of ``stack`` (by id) appears in it, under every name."""
    uses: dict[int, int] = {}
    for _, module in stack.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1
    return uses


def _own(layer: nn.Module) -> bool:
    """A transformers decoder layer (not a user's class of the same name) with a position-wise block: one that
    :class:`~lightning_megatrain.engine.tiling.SequenceTiles` tiles."""
    return type(layer).__module__.startswith("transformers.models.") and find_block(layer) is not None


def _folded_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """A folded norm's ``forward``: its input unchanged where its readers run tiled (:func:`_tile`, from the same T),
    which then apply the norm's own forward in each tile; the norm itself otherwise. Shared by all folded norms and
    bound per norm, as the tiled forward (engine/tiling.py)."""
    if _tile(self._megatrain_seq_tile, hidden_states) is not None:
        return hidden_states
    return self._megatrain_unfolded_forward(hidden_states)
