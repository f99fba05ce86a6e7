"""Memory model: host RAM and GPU memory in bytes for one micro-batch shape (the items ``megatrain plan`` lists).

- host RAM: fp32 masters 4 + fp32 grads 4 (both page-locked at their exact size) + optimizer states (AdamW 8,
  SGD 0, SGD+momentum 4) per parameter, the grads and states only of groups not in ``gpu_optimizer_groups``
  (planner/pool.py, [Note: memory pool]; code reading ``p.grad`` before the step would add their grads), or the
  bytes of a compact ``host_state`` (:data:`HOST_STATE_BYTES`; device groups keep their master only, in the
  layout's weight dtype), 3 grad slabs, offloaded layer inputs (page-locked
  at their exact size too) and the process itself;
- GPU memory: slots, residents, ``gpu_optimizer_groups`` state, saved layer inputs, the runtime reserve, plus the
  larger of two phases that never overlap: the backward of one layer (its recompute activations and grads) and the
  loss. Every layer is recomputed (``keep_layers=0``): the floor that must fit.
- Long context (``gpu_bytes``' docstring): layer-input checkpoints kept on the GPU, the inputs a recompute segment
  regenerates (backward phase), and a tiled position-wise block's activations, with the norm before it, and the
  norm before attention (in the tiles of its projections), where those are folded into the tiles (:func:`_tiled`);
  on the host, only the checkpoints not kept on the GPU are offloaded.

Activation bytes per token of one decoder layer recomputed with grad (``c`` = compute itemsize, 2 under bf16-mixed,
4 under 32-true; the residual stream is fp32 because embeddings and norms are fp32 residents under autocast). Derived
op by op from HF's Llama/Qwen/Gemma/Mixtral layers and checked against the tensors autograd saves
(tests/planner/test_planner.py counts them with ``saved_tensors_hooks``; exact for Llama/Mixtral/Qwen3 with sdpa)::

    saved = 4H                         fp32 residual after attention (saved by the 2nd norm)
          + n_norm * (4H + 4)          each H-wide RMSNorm saves its fp32 normalised value (+ rsqrt)
          + (n_norm - 2) * 4H          Gemma-style post-norms also save an fp32 copy of their bf16 input
          + n_read * 2H   (c = 2)      autocast copy of the fp32 stream for every Linear reading it (q,k,v,gate,up)
          + c*(2A + 2K) + 4*nh         sdpa/flash inputs q,k,v and output, fp32 logsumexp
            [eager: 4cA + nh*T*(4 + c (+c with attention logit softcap)): probabilities over all T keys]
          + (4 + c)*(A + K) + 4(nh+nkv) q/k RMSNorm over head_dim (Qwen3, Gemma3)
          + 2cA                        output gate (Qwen3.5): sigmoid(gate) and the gated output o_proj reads
            [linear attention (Gated DeltaNet layers of Qwen3.5) instead of sdpa/eager: ``_linear_attn_saved``]
          + 4cI (gated MLP: gate, act, up, product) or 2cI (fc1/act/fc2)
          + MoE: 4E + 12k + k*(H(c + 4) + 5cI_e + 20)   router logits/top-k, per routed token gathered input,
                                                         expert intermediates, weighted fp32 output
    transient = 8H + 2c*max(I, k*I_e)   recompute output and incoming grad (fp32), grads of the MLP intermediates

with H hidden, A = heads*head_dim, K = kv_heads*head_dim, I intermediate, E experts, k experts per token.
Llama-3.2-3B on the H200 (benchmarks/planner_gpu_check.py, 2026-11-29, torch 2.11, sdpa): 149,608 B/token
saved, measured = formula to the byte; backward peak 194,664 B/token + the incoming grad 4H allocated before it
= 206,952 = saved + transient, exactly (plus one weight grad, down_proj's, as a constant). Llama-2-7B (multi-head
attention) at 32,768 tokens (benchmarks/planner_long_context_check.py, 2026-12-01, torch 2.11): 211,080 B/token
saved and a backward peak of 274,248 = saved + transient - 4H + down_proj's grad, both to the byte.
"""

from __future__ import annotations

from typing import Any

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig, memo_layers
from lightning_megatrain.engine.backward_updates import SNAPSHOT_BYTES_PER_PARAM as SNAPSHOT_BYTES
from lightning_megatrain.engine.backward_updates import SNAPSHOT_RESERVE_BYTES as SNAPSHOT_RESERVE
from lightning_megatrain.engine.device_state import gpu_bytes_per_param
from lightning_megatrain.engine.segments import replay_schedule
from lightning_megatrain.models.packed_attention import PACKED_SDPA
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS
from lightning_megatrain.planner.constants import OPTIMIZERS, PRECISIONS
from lightning_megatrain.planner.shape import _device_numels, _Layer, _LinearAttn, _Shape

# host_state -> host bytes per parameter of the weights ("masters"), the grads and the Adam moments, from the layouts
# of optim/compact_adam.py ([Note: compact host state]): fp32 16, int8_moments 10.03, compact 6.03, compact_kahan 8.03
HOST_STATE_BYTES = {
    name: {"masters": b["weights"], "grads": b["grads"], "optimizer states": b["optimizer states"]}
    for name, b in ((name, layout.bytes_per_param()) for name, layout in HOST_STATE_LAYOUTS.items())
}


def layer_activation(s: _Shape, layer: _Layer, seq_len: int, c: int, tile: int | None = None) -> tuple[float, float]:
    """(saved, transient) bytes per token of one layer recomputed with grad (formula: module docstring); with
    ``tile`` positions per tile of its position-wise block, as :func:`_tiled` changes them."""
    if tile is not None:
        return _tiled(s, layer, seq_len, c, tile)
    H, A, K = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    saved = 4 * H + layer.norms * (4 * H + 4) + max(layer.norms - 2, 0) * 4 * H
    saved += layer.readers * 2 * H if c < 4 else 0
    if layer.linear:
        saved += _linear_attn_saved(s.linear_attn, seq_len, c)
    elif s.attn == "eager":
        # q, repeated k and v, output; fp32 softmax + low-precision probs over all T keys (+ tanh with softcap)
        saved += 4 * c * A + s.heads * seq_len * (4 + c + (c if s.attn_softcap else 0))
    else:
        saved += c * (2 * A + 2 * K) + 4 * s.heads
    if layer.out_gate:  # sigmoid(gate) and the gated output that o_proj reads (else o_proj reads the attention output)
        saved += 2 * c * A
    if layer.qk_norm:
        saved += (4 + c) * (A + K) + 4 * (s.heads + s.kv_heads)
    saved += (4 if layer.gated else 2) * c * layer.dense_i
    widest = layer.dense_i
    if layer.moe:
        k = s.top_k
        saved += 4 * s.experts + 12 * k + k * (H * (c + 4) + 5 * c * s.expert_i + 20)
        widest = max(widest, k * s.expert_i)
    return saved, 8 * H + 2 * c * widest


def _block_saved(s: _Shape, layer: _Layer, c: int) -> float:
    """Bytes per token of :func:`layer_activation`'s ``saved`` that the position-wise block (the MLP or MoE module)
    saves: the autocast copies its Linears read, its intermediates, the MoE terms. The norm before it is not part of
    it (:func:`_tiled` takes a folded norm's values out apart)."""
    H = s.hidden
    saved = layer.mlp_readers * 2 * H if c < 4 else 0
    saved += (4 if layer.gated else 2) * c * layer.dense_i
    if layer.moe:
        k = s.top_k
        saved += 4 * s.experts + 12 * k + k * (H * (c + 4) + 5 * c * s.expert_i + 20)
    return saved


def _tiled(s: _Shape, layer: _Layer, seq_len: int, c: int, tile: int) -> tuple[float, float]:
    """(saved, transient) bytes per token of one recomputed layer whose position-wise block (the MLP or MoE module)
    runs ``tile`` positions at a time (engine/tiling.py, [Note: sequence tiles]): each tile under its own
    checkpoint, so the block keeps only its input from its forward, and in backward runs each tile's forward again
    with grad, then that tile's backward. Its activations and intermediate grads then exist for one tile at a time
    (``f = tile / seq_len`` of the tokens); the token mixer is untiled. Where the norm before the block is folded into
    the tiles (``layer.folded_norm``: engine/folded_norms.py's ``FOLDED_NORMS``) the block's input is the residual
    stream, saved anyway (the ``4H`` of the module docstring, now by the tiles instead of the norm), and the norm's own
    saved values (``4H + 4``) exist for one tile; otherwise the block's input is the norm's fp32 output, one more
    ``4H``.
    Where the norm before attention is folded into the tiles of the attention's input projections too
    (``layer.folded_attn`` of them: q, k, v, or Phi-3's qkv; engine/folded_norms.py, [Note: folded norms]), its saved
    values and the projections' autocast copies of its output exist for one tile as well::

        saved     = layer_activation(...).saved - block + 4H        all but the block's own saved values, + its input
                    [folded norm: - block - (4H + 4)]                 and the norm's, whose input the tiles keep
                    [folded attention: - (4H + 4) - n_attn * 2H]      the norm before attention's values and the
                                                                    projections' autocast copies (c = 2; 0 in fp32)
        transient = max(14H + f * (block + norm + 2c * max(I, k*I_e)),  the block's backward, one tile at a time: the
                                                                    incoming grad (fp32) and its copy in c for the
                                                                    block's output, the block input's grad (fp32)
                                                                    and each tile's, sliced into a full-size fp32
                                                                    tensor before it is added; norm = 8H + 4 for a
                                                                    folded norm's values in a tile (its normalised
                                                                    value, rsqrt and output), else 0
                        8H + c*(2A + 2K) + 4A                       then the attention's: the incoming grad and the
                                                                    grad of the residual after attention (fp32), the
                                                                    grads of q, k, v, out and the kernel's fp32 dq,
                        [folded attention: + f * (8H + 4 + n_attn*2H)]) + a tile of the norm before attention and of
                                                                    the copies, recomputed in each projection's tile

    (``block``: :func:`_block_saved`.) Measured on the H200 with the tiles under ``torch.utils.checkpoint`` and the
    norm untiled (benchmarks/planner_long_context_check.py, 2026-12-01, torch 2.11, sdpa (cuDNN); results in
    benchmarks/results/2026-12-01-planner-long-context-h200.json): ``saved`` to the byte for the Llama-2-7B shape at
    32,768 and 131,072 tokens and the Llama-3.2-3B shape at 65,536; backward peak = saved + transient - 4H (the
    incoming grad, allocated before) + the block's three weight grads, to the byte where the block's phase is the
    larger (7B at tiles of 8,192 of 32,768; 3B at 16,384 of 65,536), 4 B/token above where the attention's is (7B at
    16,384 of 131,072). The folded norms' terms are derived and checked on the CPU (tests/engine/test_tiling.py,
    test_folded_norm_keeps_no_activations: (8H + 4) B/token less alive after forward in fp32 for each norm, (10H +
    4) for the norm before attention under bf16 autocast; in fp32 that norm's fp32 output, which q, k and v save,
    leaves too, 4H this formula does not count untiled), and on the H200 with the engine's tiles and both folds
    (2026-12-02, benchmarks/results/2026-12-02-planner-long-context-h200-folds-*.json): ``saved`` to the byte for
    the 7B shape at 32,768, 131,072 and 524,288 tokens and the 3B shape at 65,536; the backward peak 1.4-10.7% under
    this formula (the folded attention's transient term is an upper estimate). A mechanism that writes each tile's
    input grad into one buffer instead saves 4H of the 14H. Untiled, the block's intermediate grads (``2c * I`` per
    token) exceed the attention backward's for every shape measured, so ``transient`` there has no attention term.
    Eager attention adds the grads of its [heads, T, T] scores and probabilities (``nh * T * (4 + c)``, not
    measured)."""
    H, A, K = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    saved, _ = layer_activation(s, layer, seq_len, c)
    block = _block_saved(s, layer, c)
    widest = max(layer.dense_i, s.top_k * s.expert_i if layer.moe else 0)
    attention = 8 * H + c * (2 * A + 2 * K) + 4 * A
    if s.attn == "eager" and not layer.linear:
        attention += s.heads * seq_len * (4 + c)
    # folded: the norm's normalised value and rsqrt leave (its input, the residual, stays as the tiles' input), and a
    # tile holds them and the norm's output; unfolded: the block's input, the norm's output, stays
    kept, norm = (-(4 * H + 4), 8 * H + 4) if layer.folded_norm else (4 * H, 0)
    f = min(tile, seq_len) / seq_len
    per_tile = 14 * H + f * (block + norm + 2 * c * widest)
    if layer.folded_attn:  # the norm before attention's values and the projections' copies of its output leave; a
        copies = layer.folded_attn * 2 * H if c < 4 else 0  # tile of them is recomputed in the attention's backward
        kept -= 4 * H + 4 + copies
        attention += f * (8 * H + 4 + copies)
    return saved - block + kept, max(per_tile, attention)


def _linear_attn_saved(la: _LinearAttn, seq_len: int, c: int) -> float:
    """Bytes per token that one Gated DeltaNet mixer saves for backward, op by op, in transformers' PyTorch chunked
    delta rule (``torch_chunk_gated_delta_rule``, the path without flash-linear-attention / causal-conv1d; their
    fused kernels save less). Checked against the tensors autograd saves (tests/planner/test_planner.py).

    q = k = v_heads * k_dim (q and k repeated to the value heads), v = v_heads * v_dim, C = chunk; under autocast
    (c = 2) every matmul in the chunk loop saves compute-dtype copies of its inputs (no autocast cache), under
    32-true the fp32 tensors, most of which are saved anyway."""
    hv, C, autocast = la.v_heads, la.chunk, c < 4
    q, v = hv * la.k_dim, hv * la.v_dim
    chunks = -(-seq_len // C)
    pad = chunks * C / seq_len  # tensors from the padding to whole chunks on are chunks * C long
    # chunk 0 reads a zero state (its k_cumdecay and query products save no copy); the state update after the last
    # chunk feeds nothing, so autograd frees what it saved
    later = (chunks - 1) / chunks
    state = hv * la.k_dim * la.v_dim / C  # one [v_heads, k_dim, v_dim] fp32 recurrent state per chunk
    unpadded = (c * (2 * la.k_heads * la.k_dim + v) * (2 + (la.conv - 1) / seq_len)  # conv1d input, SiLU input
                + c * hv + 8 * hv  # sigmoid(b); fp32 softplus input and output of the decay g
                + 2 * (4 * q + 4 * hv)  # l2norm of q and of k: fp32 input, rsqrt
                + (12 + 2 * c) * v + 4 * hv  # gated RMSNorm: fp32 input, rsqrt, normed, weighted, fp32 z, SiLU(z)
                + c * v)  # out_proj input
    padded = (4 * hv + 4 * v + 4 * q  # beta and value (v_beta), normalised key (k_beta)
              + 4 * hv * C + 2 * c * hv * C  # exp of the pairwise decays [C, C]; k_beta k^T and q k^T products
              + 4 * c * q  # copies of k_beta, key (twice) and query that those two 5-D matmuls save
              + 4 * hv + 4 * q  # exp(cumulative decay), fp32 k_beta (decayed_k_beta)
              + 4 * hv * C + 4 * v + 4 * q  # triangular solves: the system, new values, k_cumdecay
              + 8 * hv + 4 * q)  # decays applied to query and key, the scaled query
    if autocast:  # chunk loop: copies of k_cumdecay, query, key, intra-chunk attention, v_new (twice), state (twice);
        # the fp32 state itself is saved only by its decay product, so not the last chunk's
        loop = 3 * c * q * later + c * hv * C + c * v * (1 + later) + (2 * c + 4 * later) * state
    else:  # decayed query and key, intra-chunk attention, v_new, state
        loop = 8 * q * (chunks > 1) + 4 * hv * C + 4 * v + 4 * state
    return unpadded + (padded + loop) * pad


def _gpu_peak(gpu: dict[str, int]) -> int:
    persistent = sum(v for k, v in gpu.items() if not k.startswith("phase"))
    backward = sum(v for k, v in gpu.items() if k.startswith("phase backward"))
    loss = sum(v for k, v in gpu.items() if k.startswith("phase loss"))
    return persistent + max(backward, loss)


def regenerated(L: int, segment: int, sub: int = 1) -> int:
    """The most regenerated layer inputs a segment holds at once in backward (its checkpoint aside), for ``L``
    recomputed layers: ``segment - 1`` flat, fewer nested with sub-segments of ``sub`` (engine/segments.py's
    ``replay_schedule``, [Note: recompute segments]); the segments are ``segment`` layers each, the last what is
    left."""
    return max(replay_schedule(min(segment, L - first), sub)[0] for first in range(0, L, segment))


def replayed_forwards(L: int, segment: int, sub: int = 1) -> int:
    """Layer forwards the backward of ``L`` recomputed layers replays: ``L - ceil(L / segment)`` flat, more
    nested."""
    return sum(sum(map(len, replay_schedule(min(segment, L - first), sub)[1])) for first in range(0, L, segment))


def checkpoints(s: _Shape, segment: int) -> int:
    """Layer-input checkpoints per micro-batch: one per segment of ``segment`` recomputed layers (every layer is
    planned recomputed, ``keep_layers=0``)."""
    return -(-len(s.layers) // segment)


def mask_free_sdpa(s: _Shape, layer: _Layer, seq_len: int) -> bool:
    """Whether SDPA runs ``layer``'s attention at ``seq_len`` without a mask: not a sliding window shorter than the
    row, not linear attention, not eager attention. Those layers are the ones the attention memo serves ([Note:
    attention memo]) and, unpacked, the ones the attention kernel's measured rates price (timing.py). Packed rows (the
    varlen kernel) are not served by the memo either; the plan assumes one document per row."""
    return (s.attn in ("sdpa", PACKED_SDPA) and not layer.linear
            and (layer.window is None or layer.window >= seq_len))


def memo_served(s: _Shape, seq_len: int, attention_memo: bool | int) -> list[bool]:
    """Per layer, whether the attention memos of the option ``attention_memo`` serve it ([Note: attention memo] in
    engine/attention_memo.py): among the last layers that keep memos (config.py ``memo_layers``) and
    :func:`mask_free_sdpa`. The plan recomputes every layer, so each of them is counted."""
    first = len(s.layers) - memo_layers(attention_memo, len(s.layers))
    return [i >= first and mask_free_sdpa(s, layer, seq_len) for i, layer in enumerate(s.layers)]


def _memo_layer_bytes(s: _Shape, micro_batch: int, seq_len: int, c: int) -> int:
    """One served layer's memos for one micro-batch: its attention output (compute dtype) and fp32 log-sum-exp."""
    return s.heads * (s.head_dim * c + 4) * micro_batch * seq_len


def attention_memo_bytes(s: _Shape, micro_batch: int, seq_len: int, c: int, attention_memo: bool | int = True
                         ) -> int:
    """GPU bytes of the attention memos of one micro-batch (``micro_batch`` rows of ``seq_len``): each served
    layer's (:func:`memo_served`), held from the forward to that layer's recompute."""
    return _memo_layer_bytes(s, micro_batch, seq_len, c) * sum(memo_served(s, seq_len, attention_memo))


def memo_layers_fitting(s: _Shape, micro_batch: int, seq_len: int, c: int, room: int) -> int:
    """The fewest last layers that hold the most memos fitting ``room`` bytes of GPU memory: 0 where none fit or no
    layer is served (:func:`memo_served`)."""
    per_layer, size, best = _memo_layer_bytes(s, micro_batch, seq_len, c), 0, 0
    for n, served in enumerate(reversed(memo_served(s, seq_len, True)), 1):  # the last layer first
        if served:
            if size + per_layer > room:
                break
            size, best = size + per_layer, n
    return best


def gpu_keywords(config: EngineConfig, *, precision: str, loss: str, loss_chunk: int, reserve_gib: float,
                 offload: bool = True, host_state: str | None = None) -> dict[str, Any]:
    """:func:`gpu_bytes`' keyword arguments for the engine options ``config`` (``host_state`` overrides the config's),
    without ``gpu_groups`` and the long-context ones, which each caller decides: the one place an option that changes
    the GPU items is read for them."""
    memo = config.attention_memo
    return {"c": PRECISIONS[precision], "offload": offload, "loss": loss, "loss_chunk": loss_chunk,
            "num_slots": config.num_slots, "reserve_gib": reserve_gib,
            "host_state": host_state if host_state is not None else config.host_state,
            "attention_memo": False if memo == "auto" else memo}  # "auto": none until decided (engine/placement.py)


def gpu_bytes(s: _Shape, micro_batch: int, seq_len: int, *, c: int, offload: bool, loss: str, loss_chunk: int,
              num_slots: int, reserve_gib: float, gpu_groups: int = 0, tile: int | None = None, segment: int = 1,
              device_checkpoints: int = 0, sub: int = 1, host_state: str = "fp32", attention_memo: bool | int = False
              ) -> tuple[dict[str, int], tuple[float, float]]:
    """GPU items in bytes for one micro-batch, and the (saved, transient) activation bytes per token. The
    ``gpu_groups`` device groups hold the ``host_state`` layout's state (engine/device_state.py
    ``gpu_bytes_per_param``, [Note: compact device groups]).

    Long context (engine/tiling.py, [Note: recompute segments]; each item appears only where it is not zero):
    ``tile`` positions per tile of the position-wise block (:func:`_tiled`); ``segment`` recomputed layers per
    checkpoint: backward replays a segment's forward from its checkpoint and holds the ``segment - 1`` regenerated
    layer inputs while the segment's layers run backward (fewer with sub-segments of ``sub``: :func:`regenerated`);
    the last ``device_checkpoints`` checkpoints (at most :func:`checkpoints`) stay on the GPU. The backward then
    starts from the top one, which needs no restore, so the stream it would have been restored into is not needed:
    saved layer inputs are one stream plus the checkpoints (the same peak for one checkpoint on the GPU as for
    none). ``attention_memo``: the memos of :func:`attention_memo_bytes`."""
    tokens, H, V = micro_batch * seq_len, s.hidden, s.vocab
    max_layer = max(layer.numel for layer in s.layers)
    act = max((layer_activation(s, layer, seq_len, c, tile) for layer in s.layers), key=sum)
    resident_on_gpu, layers_on_gpu = _device_numels(s, gpu_groups)
    stream = 4 * H * tokens  # one layer's input: fp32 residual stream [B, T, H]
    memos = attention_memo_bytes(s, micro_batch, seq_len, c, attention_memo)
    on_gpu = min(device_checkpoints, checkpoints(s, segment)) if offload else 0
    if not offload:
        live = checkpoints(s, segment)
    else:
        live = 2 if on_gpu == 0 else 1
    if loss == "chunked":  # models/loss.py: [C, V] fp32 logits + exp/softmax temporaries, bf16 copies
        chunk = min(loss_chunk, tokens) * V * (8 + (4 if s.logit_softcap else 0))
        head = V * H * (4 + (4 if c < 4 else 0)) + chunk  # fp32 dL/dW accumulator (+ bf16 W copy, bf16 product)
    else:  # HF loss: bf16 logits, fp32 upcast, log_softmax output, its grad and the grad of the logits
        head = tokens * V * 12
    w = HOST_STATE_LAYOUTS[host_state].weight_dtype.itemsize  # the masters' dtype: fp32, or bf16 under compact
    gpu = {
        # engine/transfer.py: a staging buffer in the masters' dtype, and a compute-dtype one where they differ
        f"slots ({num_slots} x largest layer)": num_slots * max_layer * (w + (c if c != w else 0)),
        # engine/residents.py: the device leaves and their grads, in the masters' dtype
        "residents (fp32 copy + grad)" if w == 4 else "residents (bf16 copy + grad)":
            2 * w * s.resident_params + s.resident_buffer_bytes,
        # engine/device_state.py: the residents' moments (+ Kahan compensation); a layer's mirror, grad, moments
        # (+ compute copy), in the host_state layout's formats
        "optimizer groups on the GPU": round(gpu_bytes_per_param(c, resident=True, host_state=host_state)
                                             * resident_on_gpu
                                             + gpu_bytes_per_param(c, resident=False, host_state=host_state)
                                             * sum(layers_on_gpu)),
        "saved layer inputs": live * stream + 8 * s.head_dim * tokens,
        **({"layer-input checkpoints on the GPU": on_gpu * stream} if on_gpu else {}),
        **({"attention memos": memos} if memos else {}),
        "runtime reserve": int(reserve_gib * GIB),
        "phase backward: one layer's activations": int(sum(act) * tokens),
        **({"phase backward: the segment's regenerated inputs": regenerated(len(s.layers), segment, sub) * stream}
           if segment > 1 else {}),
        # autograd's per-parameter grads + the torch.cat pack + its fp32 cast (direct D2H into the host grads)
        "phase backward: one layer's weight grads": max_layer * (2 * c + (4 if c < 4 else 0)),
        # final norm saves 8H, its output 4H, dL/dh kept in ctx 4H (+ its scaled copy in backward)
        "phase loss: head + loss": int(20 * H * tokens + head),
    }
    return gpu, act


def host_bytes(s: _Shape, micro_batch: int, seq_len: int, *, c: int, optimizer: str, offload: bool,
               process_gib: float, pinned_pow2: bool, gpu_groups: int = 0, segment: int = 1,
               device_checkpoints: int = 0, host_state: str = "fp32") -> dict[str, int]:
    """Host items in bytes (engine/host_store.py, transfer.py, residents.py). The offloaded layer inputs are the
    checkpoints not kept on the GPU: :func:`checkpoints` less ``device_checkpoints`` (:func:`gpu_bytes`). A
    ``host_state`` other than ``"fp32"`` (Adam/AdamW only) sizes masters, grads and moments by
    :data:`HOST_STATE_BYTES`. Of the ``gpu_groups`` device groups' parameters the host keeps the master only, in the
    layout's weight dtype (4 bytes for fp32 weights, 2 for bf16): their grads, moments and Kahan compensation live on
    the GPU ([Note: memory pool])."""
    n, max_layer = s.n_params, max(layer.numel for layer in s.layers)
    groups = [4 * layer.numel for layer in s.layers] + [4 * s.resident_params]  # one master and one grad flat each
    stash = 4 * s.hidden * micro_batch * seq_len if offload else 0
    offloaded = max(checkpoints(s, segment) - device_checkpoints, 0) if offload else 0
    # page-locked at their exact size (engine/pinned.py); ``pinned_pow2`` models the engine that took them from
    # torch's power-of-two caching host allocator instead
    rounded = [stash] * offloaded + groups * 2 + [4 * s.resident_params] + [max_layer * c] * 3
    rounded = rounded if pinned_pow2 else []
    pow2 = lambda b: 1 << (int(b) - 1).bit_length() if b > 0 else 0
    state = HOST_STATE_BYTES[host_state]
    moments = OPTIMIZERS[optimizer][0] if host_state == "fp32" else state["optimizer states"]
    resident_on_gpu, layers_on_gpu = _device_numels(s, gpu_groups)
    on_host = n - resident_on_gpu - sum(layers_on_gpu)  # device groups keep only masters here ([Note: memory pool])
    # every parameter's master; the rest of the layout's "masters" bytes (a Kahan compensation) for the host groups'
    weight = HOST_STATE_LAYOUTS[host_state].weight_dtype.itemsize
    return {
        "masters": round(weight * n + (state["masters"] - weight) * on_host),
        "grads": round(state["grads"] * on_host),
        "optimizer states": round(moments * on_host),
        "grad slabs": 3 * max_layer * c,
        # the residents' grads go straight into their host grads; a frozen resident adds a pinned staging buffer of
        # the residents' size (4 B/param under fp32), not counted here
        "resident grad staging": 4 * s.resident_params if pinned_pow2 else 0,
        "activation offload": stash * offloaded,
        "pinned pow2 rounding": sum(pow2(b) - b for b in rounded),
        "process": int(process_gib * GIB),
    }


def speculated_layers(s: _Shape, host_free: int, gpu_groups: int = 0) -> int:
    """The host layers, the last ones first, whose update starts during backward (engine/backward_updates.py,
    [Note: updates during backward]): as many as their snapshots (12 bytes per parameter: the fp32 master and two
    Adam moments) fit in ``host_free`` less the 4 GiB the snapshots always leave free (``snapshot_budget``); the
    layers of ``gpu_optimizer_groups`` step on the GPU and are never speculated."""
    budget, count = host_free - SNAPSHOT_RESERVE, 0
    for layer in reversed(s.layers[len(_device_numels(s, gpu_groups)[1]):]):
        budget -= SNAPSHOT_BYTES * layer.numel
        if budget < 0:
            break
        count += 1
    return count


def transfer_bytes(host_state: str) -> dict[str, int]:
    """Bytes per parameter that an upload reads from the host masters and a drain writes to the host grads: the
    itemsize of the host_state layout's weights and grads (optim/compact_adam.py; a Kahan compensation stays on
    the host)."""
    layout = HOST_STATE_LAYOUTS[host_state]
    return {"weight_bytes": layout.weight_dtype.itemsize, "grad_bytes": layout.grad_dtype.itemsize}
