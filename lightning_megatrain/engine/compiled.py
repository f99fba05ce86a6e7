"""Compiled decoder layers: each layer class's ``forward`` through ``torch.compile``, saving only matmul and
attention outputs for backward, and the setup check that inductor can build kernels here.

[Note: compiled layers]
With ``compile_layers`` every layer runs its class's ``forward`` through ``torch.compile`` (inductor): the
elementwise work between the matmuls (RMSNorm in fp32, SiLU x up, rotary, residual adds) fuses into few kernels.
The auto recompute policy calibrates on the compiled layers, so it counts what their graphs really save.
One compiled function serves every layer of a class: dynamo lifts the weights a layer reads (bound by ``bind``
to slot views) to graph inputs instead of specializing on them, so a 28-layer stack compiles one graph per grad mode
(no-grad forward, forward with grad), not one per layer. ``fallback_random`` keeps torch's eager RNG for dropout,
so a recompute under the forward's saved RNG state replays the same masks, exactly as without compile.

With grad, the compiled function runs the layer under a *selective* ``torch.utils.checkpoint`` whose policy saves
the outputs of matmuls and attention and marks everything else for recompute: inductor's partitioner then saves
those, the layer's input and the small statistics, and recomputes RMSNorm, rotary, SiLU x up and the casts inside
the backward's fused kernels (pointwise work on tensors it reads anyway). A kept Llama layer's graph holds 31% fewer
bytes (the CPU test, at the 3B shape's ratios and a quarter of its width: 11,536 -> 7,948 bf16 values per token;
on the H200 at 3B and 64K tokens, 5.91 -> 4.16 GiB per layer), so the auto policy keeps more layers and recomputes
fewer; the results are bitwise those of
the plain compiled layer. A recomputed layer's backward runs the same graph, so calibration measures what a kept
one holds. Where dynamo cannot trace the layer whole (Mixtral's routing on the GPU), the checkpoint runs eagerly:
it saves the same outputs and re-runs the layer's own code inside backward, which therefore binds the layer's
weights again around ``autograd.grad``. A layer whose MLP or MoE block runs in sequence tiles compiles them into the
same graph, and the policy leaves a tile's matmuls to the tile's own checkpoint (see [Note: sequence tiles]).

The batch and sequence dims of the layer's tensor arguments are marked dynamic on every call (``_TOKEN_DIMS`` names
them per argument), so the first call already compiles the graph that serves every shape. Left to dynamo's
automatic dynamic shapes, the first shape compiled a static graph and the first other shape a dynamic one: the
kernels that ran a batch depended on the shapes seen before it, and a run resumed mid-epoch (whose first batch has
another shape) or a second run in the same process differed from the uninterrupted run (on the H200: losses from the
first resumed step, 9e-4 in the weights after 3 steps). Hidden and head dims stay static; a dim of size 0 or 1 is
not marked (dynamo specializes it, the same way whatever came before). The marking is ``maybe_mark_dynamic``: code
that specializes a marked dim (sequence tiles loop over T's tiles) gets a graph per value it depends on (per number
of tiles), where
``mark_dynamic`` would raise. What the marking leaves to the first call are inductor's size hints: its guards on them
(the CPU's ``B*T > 4096``) split the shapes into graphs, each still chosen by the shape alone, but its unguarded
choices (block sizes, split reductions) and Triton's autotuning see the first batch of a graph. Pinning the hints
(``mark_dynamic(hint_override=)``) does not help: dynamo guards on the pinned hint too, and a batch on the other side
of such a guard fails the graph compiled for it. Only the layer's own frame is marked: where dynamo breaks the
graph inside a layer (packed rows' attention with a document mask, Mixtral's routing on the GPU), the code after the
break gets tensors it did not mark, which fall back to automatic dynamic shapes (a static graph first), so such
layers are not guaranteed bitwise across a resume.

transformers 5.25 wraps attention forwards in the ``kernels`` package's router (``use_kernelized_func``), which
sets and resets a module-level variable on every call. Dynamo refuses that mutation inside the checkpoint's
higher-order op ("HOP: Unsafe side effect": eager checkpointing would replay it in the backward's recompute), so
the layer's graph broke there and the checkpoint ran eagerly, losing the selective saving. The router's variable is
restored before the forward returns, so nothing needs replaying: the compiled call runs with dynamo's
``skip_fwd_side_effects_in_bwd_under_checkpoint`` on (where this torch has it), and the layer compiles whole again.

Layers left eager: ``compile_layers="auto"`` does not compile a model that :func:`compile_hazard` names. gpt-oss with
transformers' default experts implementation, ``grouped_mm``, ended its first compiled step through the strategy in
a device-side assert on the H200 (torch 2.11, transformers 5.17: a 2-layer, 16-expert model and the 120B shape
truncated to 2 layers), while the same model trained there compiled without the strategy, with or without dynamic
shapes, and through the strategy with eager layers (benchmarks/grouped_mm_check.py,
benchmarks/results/2026-12-04-grouped-mm-check-*); the cause is not found. With eager layers and ``grouped_mm`` the
120B shape trained 2.05x faster than compiled layers with eager experts (10,495 against 5,124 tokens/s at 8 x 4,096,
2 layers, compact state), so eager layers are the faster of the two that work. An explicit ``compile_layers=True``
is used as given, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_megatrain.engine.attention_memo import MEMO_OP, routed
from lightning_megatrain.engine.tiling import inside_tile

_aten = torch.ops.aten


def _varlen_ops() -> frozenset:
    """torch's flash varlen attention (packed documents on a GPU: models/packed_attention.py), where this build has
    it: registered when ``torch.nn.attention.varlen`` is imported."""
    try:
        import torch.nn.attention.varlen  # noqa: F401

        return frozenset({torch.ops.torch_attn._varlen_attn.default})
    except (ImportError, AttributeError):
        return frozenset()

# The ops whose outputs a compiled layer's graph saves for backward (see [Note: compiled layers]): matmuls and
# attention, the work a recompute would repeat at full cost. Looked up by name: not every build has every kernel.
_SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm", "addmm", "bmm", "_grouped_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
) | _varlen_ops() | {MEMO_OP}


# The forward's side effects inside the checkpoint, left out of the backward's recompute (see [Note: compiled layers]);
# a no-op context where this torch's dynamo lacks the option.
_SIDE_EFFECTS_NOT_REPLAYED = (
    functools.partial(torch._dynamo.config.patch, skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint") else contextlib.nullcontext
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # not a sequence tile's: its own checkpoint re-runs it in backward (see [Note: sequence tiles])
    save = op in _SAVED_OPS and not inside_tile()
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


_BATCH, _SEQUENCE = 0, 1  # indices into a call's (B, T)
# Per argument of a decoder layer's forward: (dim, what it counts) of its tensors' batch and sequence dims
_TOKEN_DIMS: dict[str, tuple[tuple[int, int], ...]] = {
    "hidden_states": ((0, _BATCH), (1, _SEQUENCE)),  # [B, T, hidden]
    "position_embeddings": ((0, _BATCH), (1, _SEQUENCE)),  # (cos, sin), each [B or 1, T, head_dim]
    "position_ids": ((0, _BATCH), (1, _SEQUENCE)),  # [B or 1, T]
    "cache_position": ((0, _SEQUENCE),),  # [T]
    "attention_mask": ((0, _BATCH), (-2, _SEQUENCE), (-1, _SEQUENCE)),  # [B, 1, T, T] (or [B, T])
}


def _mark_token_dims(arguments: dict[str, Any]) -> None:
    """Mark the batch and sequence dims of a layer call's tensor ``arguments`` dynamic (see [Note: compiled
    layers]): those of ``_TOKEN_DIMS`` whose size is the call's B or T, 2 or more."""
    hidden_states = arguments.get("hidden_states")
    if not isinstance(hidden_states, Tensor):
        return
    sizes = hidden_states.shape[:2]  # (B, T)
    for name, dims in _TOKEN_DIMS.items():
        for t in pytree.tree_leaves(arguments.get(name)):
            if not isinstance(t, Tensor):
                continue
            marked: set[int] = set()
            for d, role in dims:
                if -t.dim() <= d < t.dim() and d % t.dim() not in marked and t.shape[d] == sizes[role] >= 2:
                    marked.add(d % t.dim())
                    torch._dynamo.maybe_mark_dynamic(t, d % t.dim())


def compile_hazard(hf_config: Any) -> str | None:
    """Why ``compile_layers="auto"`` leaves this model's decoder layers eager, or ``None`` (see [Note: compiled
    layers]): ``hf_config`` is the model's HF config (``None``: none known, compiled as usual)."""
    if getattr(hf_config, "model_type", None) != "gpt_oss":
        return None
    # None: transformers' default, grouped_mm
    if getattr(hf_config, "_experts_implementation", None) not in (None, "grouped_mm"):
        return None
    return ("gpt-oss experts through transformers' grouped_mm hit a device-side assert in compiled layers on the "
            "H200 (torch 2.11); eager layers train them")


def compile_layer_forward(forward: Callable[..., Any], attention_memo: bool = False) -> Callable[..., Any]:
    """``torch.compile`` a layer class's ``forward``, saving only matmul and attention outputs for backward, with
    the batch and sequence dims of its arguments dynamic from the first call (see [Note: compiled layers]).
    ``attention_memo``: the checkpointed forward routes attention through the memo's op ([Note: attention memo]):
    dynamo traces the checkpoint's body without the modes entered around the compiled call."""
    names = list(inspect.signature(forward).parameters)[1:]  # after the layer
    body = functools.partial(routed, forward) if attention_memo else forward

    def selective(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(layer, *args, **kwargs)
        return checkpoint(
            body, layer, *args, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls), **kwargs,
        )

    compiled = torch.compile(selective, options={"fallback_random": True})

    def marked(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        _mark_token_dims(dict(zip(names, args)) | kwargs)
        with _SIDE_EFFECTS_NOT_REPLAYED():
            return compiled(layer, *args, **kwargs)

    return marked


def _probe(x: Tensor) -> Tensor:
    return x * 2 + 1


def check_compilable(device: torch.device) -> None:
    """Fail at setup, before the model is packed, where ``torch.compile`` cannot build kernels for ``device``:
    inductor needs Triton on CUDA and a C++ compiler on the CPU, and would otherwise fail in the first step."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise RuntimeError(
                "MegaTrainStrategy(compile_layers=True) needs Triton for torch.compile on CUDA, and it is not usable "
                "here. HINT: install the triton that matches your torch (it ships with torch's CUDA wheels), or use "
                "compile_layers=False."
            )
        return
    try:
        torch.compile(_probe)(torch.ones(2))
    except Exception as e:  # inductor raises its own types (InvalidCxxCompiler, BackendCompilerFailed, ...)
        raise RuntimeError(
            f"MegaTrainStrategy(compile_layers=True): torch.compile cannot build CPU kernels here "
            f"({type(e).__name__}). HINT: install a C++ compiler (g++ or clang++; or point CXX at one), or use "
            "compile_layers=False."
        ) from e
