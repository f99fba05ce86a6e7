"""Time model: seconds per optimizer step (GPU compute, PCIe transfers busy and exposed, host optimizer, resident
traffic) and the FLOPs it counts.

FLOPs (per token): layers 8*N_active (6N fwd+bwd, Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
+2N for the forward recomputed in backward), attention 16*A*T_k per layer (PaLM, Chowdhery et al. 2022, app. B,
counts 12*H*T for fwd+bwd over all T keys; we count the keys a causal mask leaves, T_k ~ T/2, because flash kernels
skip masked blocks, and add one forward 4*A*T_k for the recompute), LM head 6*V*H. They run at the achieved rates of
constants.py (measured on these executed FLOPs); from ``ATTN_RATES_FROM_SEQ`` tokens per row, mask-free SDPA attention
runs at its kernel's own measured rates instead (``attn_tflops``).

Attention, per layer and row of T positions (A = heads * head_dim): the forward's QK^T and PV take 2A FLOPs each per
(query, key) pair, and causal query t attends to t keys, so 4A * T(T+1)/2 ~ 4 * T^2 * A / 2 FLOPs: the causal forward
count of FlashAttention-2's benchmarks (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and
Work Partitioning"), i.e. 4*A*T_k per token with T_k = T/2 (``_keys``). Its backward executes 5 matmuls to the
forward's 2 (2.5x); we count 2x, as PaLM does, and the rates are measured on the FLOPs counted so. At long sequences
attention is most of a layer (Llama-2-7B: 73% of the forward at 131,072 tokens, 91% at 524,288): one eager 7B layer
at 131,072 tokens on the H200 ran 517 (forward) and 463 (recompute + backward) TFLOP/s counted this way
(benchmarks/results/2026-12-01-planner-long-context-h200.json); attention at its kernel's rates (SDPA's cuDNN, 570
and 425: constants.py) and the rest at ACHIEVED_TFLOPS = 450 make those 528 and 460.

Long context (``step_time``'s docstring): segments replay ``L - ceil(L/k)`` layer forwards per micro-batch (more
nested: memory.py ``replayed_forwards``), a tiled
position-wise block runs its forward once more (2 * ``mlp_active`` per token and layer), and so do the attention's
input projections where the norm before them is folded into their tiles (2 * ``folded_attn_params``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_megatrain.engine.backward_updates import SNAPSHOT_BYTES_PER_PARAM as SNAPSHOT_BYTES
from lightning_megatrain.engine.segments import replay_schedule
from lightning_megatrain.planner.constants import HOST_COPY_GBPS
from lightning_megatrain.planner.memory import mask_free_sdpa, memo_served
from lightning_megatrain.planner.shape import _device_numels, _Layer, _Shape

if TYPE_CHECKING:
    from lightning_megatrain.planner.ranks import RankTiming


def _keys(seq_len: int, window: int | None) -> float:
    """Average keys a causal (optionally sliding-window) query attends to."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window * (1 - window / (2 * seq_len))


def _attn_flops(s: _Shape, layer: _Layer, seq_len: int) -> float:
    """Forward token-mixer FLOPs per token of one layer: attention QK^T and PV over the keys a causal mask leaves;
    linear attention, per value head and chunk row: k_beta k^T and q k^T (4 C k_dim), the two triangular solves
    (C (k_dim + v_dim)), the intra-chunk product (2 C v_dim) and three state matmuls (6 k_dim v_dim)."""
    if layer.linear:
        la = s.linear_attn
        return la.v_heads * (5 * la.chunk * la.k_dim + 3 * la.chunk * la.v_dim + 6 * la.k_dim * la.v_dim)
    return 4 * s.heads * s.head_dim * _keys(seq_len, layer.window)


def _attention_forward(s: _Shape, tok: int, seq_len: int, rate: float, attn_tflops: tuple[float, float] | None
                       ) -> tuple[list[float], list[bool], list[float]]:
    """Per layer, for ``tok`` tokens of rows of ``seq_len``: its attention's forward FLOPs, whether its kernel's own
    rates price it (SDPA without a mask, one document per row: the kernel ``attn_tflops`` were measured on), and that
    forward's seconds (at ``attn_tflops[0]`` there, else at ``rate``, FLOP/s)."""
    attn = [_attn_flops(s, ly, seq_len) * tok for ly in s.layers]
    kernel = [attn_tflops is not None and s.attn == "sdpa" and mask_free_sdpa(s, ly, seq_len) for ly in s.layers]
    f_rate = attn_tflops[0] * 1e12 if attn_tflops is not None else rate
    return attn, kernel, [a / (f_rate if k else rate) for a, k in zip(attn, kernel)]


def _memo_saved(s: _Shape, seq_len: int, attn_f: list[float], attention_memo: bool | int = True) -> list[float]:
    """Per layer, the seconds of ``attn_f`` (its attention's forward) the memos of ``attention_memo`` save in its
    recompute: all of it where they serve the layer (memory.py ``memo_served``), else 0."""
    return [af if served else 0.0 for af, served in zip(attn_f, memo_served(s, seq_len, attention_memo))]


def memo_saved_s(s: _Shape, micro_batch: int, seq_len: int, *, grad_accum: int, tflops: float,
                 attn_tflops: tuple[float, float] | None) -> float:
    """Seconds of compute the attention memos take out of one optimizer step (:func:`step_time` with
    ``attention_memo``): every recomputed layer's attention forward they serve, each micro-batch; the most they can
    shorten the step."""
    tok = micro_batch * seq_len
    _, _, attn_f = _attention_forward(s, tok, seq_len, tflops * 1e12, attn_tflops)
    return grad_accum * sum(_memo_saved(s, seq_len, attn_f))


def host_after_backward(bwd: list[float], speculated: list[int], host_params: int, opt_rate: float,
                        copy_gbps: float = HOST_COPY_GBPS) -> float:
    """Host seconds of the optimizer step left when the last micro-batch's backward ends, where the layers of
    ``speculated`` (their parameters, layer L-1 first, then L-2, ...) start their update during it (engine/
    backward_updates.py, [Note: updates during backward]); ``bwd``: each layer's backward seconds, layer 0 first;
    ``host_params``: every parameter the host steps, ``opt_rate``: its Gparam/s.

    Layer i's grads are final t_i = bwd[L-1] + ... + bwd[i] after that backward starts (its drain, one layer's grads
    over PCIe, ~15 ms for a 7B layer, is left out). One worker updates the speculated layers in that order, each
    taking u_i = n_i / opt_rate (the update) + 2 * 12 * n_i / copy_gbps (its snapshot: the fp32 master and two
    moments read and written; ``HOST_COPY_GBPS`` counts read + write bytes, shared/BENCHMARKS.md): layer i starts at
    s_i = max(f_{i+1}, t_i), its snapshot is copied by c_i = s_i + 24 n_i / copy_gbps and it ends f_i = c_i + n_i /
    opt_rate. A layer whose snapshot would not be copied before T_b = t_0 is not speculated (the step closes the
    speculation when backward ends: the engine abandons that copy and the step updates the layer, without a
    snapshot). Left at T_b: max(0, f - T_b) of the last one speculated, then the parameters not speculated
    (residents, the other layers) at ``opt_rate``. No speculation: ``host_params / opt_rate``."""
    end, t = sum(bwd), 0.0
    f, started = 0.0, 0
    for b, n in zip(reversed(bwd), speculated):
        t += b
        copied = max(f, t) + 2 * SNAPSHOT_BYTES * n / (copy_gbps * 1e9)
        if copied > end:
            break
        f, started = copied + n / (opt_rate * 1e9), started + n
    return max(0.0, f - end) + (host_params - started) / (opt_rate * 1e9)


def step_time(s: _Shape, micro_batch: int, seq_len: int, *, c: int, grad_accum: int, offload: bool, tflops: float,
              h2d: float, d2h: float, duplex: float, num_slots: int, opt_rate: float,
              overlap_optimizer: bool = False, gpu_groups: int = 0, tile: int | None = None, segment: int = 1,
              device_checkpoints: int = 0, weight_bytes: int = 4, grad_bytes: int = 4,
              ranks: RankTiming | None = None, speculated_layers: int = 0,
              copy_gbps: float = HOST_COPY_GBPS, sub: int = 1, attention_memo: bool | int = False,
              attn_tflops: tuple[float, float] | None = None) -> dict[str, float]:
    """Seconds per optimizer step. Transfers overlap compute layer by layer (exposed = what exceeds it); with
    ``overlap_optimizer`` the host Adam runs beside the next step's first forward (engine/overlap.py), which it paces
    when it is the slower of the two. ``gpu_groups`` (engine/device_state.py): those groups neither upload weights
    nor step on the host (their GPU step, ~28 B/param at HBM speed, is not counted).

    Long context (planner/memory.py's ``gpu_bytes`` names the options): a tiled position-wise block runs its forward
    once more in backward (``2 * mlp_active`` FLOPs per token, + ``2 * folded_attn_params`` for projections tiled with
    the norm before attention, engine/folded_norms.py; the norm's own passes are memory-bound, not counted); a
    segment's last layer first replays the forward of the segment's other layers (attention included), each
    uploading its weights once more (nested, ``sub`` > 1: each lower sub-segment's last layer replays its
    sub-segment again, engine/segments.py's ``replay_schedule``); only checkpoints move over PCIe, and only those not
    kept on the GPU (the last ``device_checkpoints``).

    ``weight_bytes`` and ``grad_bytes``: bytes per parameter of the host masters each upload reads and of the host
    grads each drain writes (4 for fp32; 2 for the bf16 weights and grads of a compact ``host_state``, which the GPU
    receives without an fp32 staging copy, docs/compact-state.md).

    ``ranks``: one rank of several (planner/ranks.py, [Note: planning several ranks]): each upload is the rank's
    shard followed by the layer's all-gather on the H2D stream; each layer's grads are reduce-scattered on the
    compute stream (serial) and the rank's fp32 ``[S]`` mean drained as one rank drains a layer; the host optimizer
    steps the rank's shard; the residents' collectives add serial seconds. ``None``: one rank, the model above.

    ``speculated_layers`` (with ``overlap_optimizer``, one rank): that many host layers, the last ones, start their
    update during the last micro-batch's backward (engine/backward_updates.py, [Note: updates during backward]);
    :func:`host_after_backward` gives the host seconds left when backward ends, which then overlap the next forward.
    ``copy_gbps``: the host's memory copy rate for their snapshots (read + write bytes per second).

    ``attention_memo`` (``True``, or the last ``N`` layers: memory.py ``memo_served``; [Note: attention memo] in
    engine/attention_memo.py): a served layer's recompute takes its attention output from the forward, so its
    backward loses the attention's forward FLOPs (SDPA layers; a segment's replay still runs it).

    ``attn_tflops``: (forward, backward) TFLOP/s of the attention kernel where SDPA runs a layer's attention without a
    mask (constants.py ``ATTN_FWD_TFLOPS``); the layer's other FLOPs, and attention elsewhere, run at ``tflops``.
    ``None``: everything at ``tflops``."""
    on_gpu_resident, on_gpu_layers = _device_numels(s, gpu_groups)
    tok, H, rate = micro_batch * seq_len, s.hidden, tflops * 1e12
    both = min(h2d, d2h, duplex / 2) * 1e9  # per direction while both directions are busy
    lin = [2 * ly.active * tok / rate for ly in s.layers]  # a layer's forward matmuls
    attn, kernel, attn_f = _attention_forward(s, tok, seq_len, rate, attn_tflops)
    b_rate = attn_tflops[1] * 1e12 if attn_tflops is not None else rate
    fwd = [li + af for li, af in zip(lin, attn_f)]
    # recompute (1x forward) + backward (2x forward: the matmuls, and the attention at its backward rate)
    bwd = [f + 2 * li + 2 * a / (b_rate if k else rate) for f, li, a, k in zip(fwd, lin, attn, kernel)]
    if attention_memo:  # the recompute's attention forward is the memo's where it serves the layer
        bwd = [b - saved for b, saved in zip(bwd, _memo_saved(s, seq_len, attn_f, attention_memo))]
    if tile is not None:  # the tiled block's forward again, tile by tile, before its backward (and the projections')
        bwd = [b + 2 * (ly.mlp_active + ly.folded_attn_params) * tok / rate for b, ly in zip(bwd, s.layers)]
    L = len(s.layers)
    firsts = list(range(0, L, segment))  # the layers whose input is a checkpoint
    replays: list[list[int]] = [[] for _ in range(L)]  # per layer: the layers replayed just before its backward
    for first in firsts:
        for i, replayed in enumerate(replay_schedule(min(segment, L - first), sub)[1]):
            replays[first + i] = [first + j for j in replayed]
    bwd = [b + sum(fwd[j] for j in r) for b, r in zip(bwd, replays)]
    wb, gb = weight_bytes, grad_bytes
    # Each layer's upload: the bytes its host master (several ranks: this rank's shard) moves over PCIe, cast on the
    # GPU, then the seconds of the layer's all-gather on the same H2D stream (several ranks); none for device groups.
    n_dev = len(on_gpu_layers)
    numels = [ly.numel for ly in s.layers] if ranks is None else ranks.shard_numels
    up_bytes = [0] * n_dev + [wb * n for n in numels[n_dev:]]
    gather = [0.0] * L if ranks is None else ranks.gather_s
    up = [b / (h2d * 1e9) + g for b, g in zip(up_bytes, gather)]  # alone on the H2D stream (forward)
    act = 4 * H * tok if offload else 0
    on_host = firsts[: max(len(firsts) - device_checkpoints, 0)] if offload else []
    stash = [act if i in on_host else 0 for i in range(L)]  # D2H in forward, H2D (restore) in backward
    # Grads go D2H (fp32, or bf16 for bf16 host grads) straight into the pinned host grads. The 1st micro-batch of a
    # step writes them; later ones first upload them (H2D) and write back the sum made on the device (engine/drain.py,
    # [Note: gradient drain]).
    grads = [gb * ly.numel for ly in s.layers] if ranks is None else [4 * n for n in ranks.shard_numels]
    grads_up = [[0] * len(s.layers), [0] * len(on_gpu_layers) + grads[len(on_gpu_layers):]]  # device groups sum there
    exposed, fill = 0.0, 0.0
    for m in range(grad_accum):
        for i in range(L):  # forward: upload i+1 and offload input i while i computes
            exposed += max(0.0, max(up[i + 1] if i + 1 < L else 0, stash[i] / (d2h * 1e9)) - fwd[i])
        for i in reversed(range(L)):  # backward: upload i-1 (not for the layers still in slots), restore its input
            uploads = ([i - 1] if 0 <= i - 1 < L - num_slots else []) + replays[i]  # and the replayed layers'
            load = sum(up_bytes[j] for j in uploads) + grads_up[min(m, 1)][i]
            load += stash[i - segment] if i - segment >= 0 else 0  # the segment below's checkpoint, prefetched
            exposed += max(0.0, max(load / both + sum(gather[j] for j in uploads), grads[i] / both) - bwd[i])
        fill += up[0] + grads[0] / (d2h * 1e9)  # the first upload and the last drain are never hidden
    head = 6 * s.vocab * H * tok / rate
    compute = sum(fwd) + sum(bwd) + head
    r = s.resident_params
    speculated = [ly.numel for ly in s.layers[len(on_gpu_layers):]][::-1][:max(speculated_layers, 0)]  # L-1 first
    optimizer_s = (s.n_params - on_gpu_resident - sum(on_gpu_layers)) / (opt_rate * 1e9)
    host_left = optimizer_s  # host seconds left when backward ends
    if ranks is not None:
        optimizer_s = host_left = ranks.optimizer_params / (opt_rate * 1e9)
        gathers = sum(ranks.gather_s) + sum(ranks.gather_s[: max(L - num_slots, 0)])
        gathers += sum(ranks.gather_s[j] for rep in replays for j in rep)
    elif overlap_optimizer and speculated:
        host_left = host_after_backward(bwd, speculated, s.n_params - on_gpu_resident - sum(on_gpu_layers),
                                        opt_rate, copy_gbps)
    return {
        "GPU compute": grad_accum * compute,
        "  of which layers": grad_accum * (sum(fwd) + sum(bwd)),
        "  of which LM head + loss": grad_accum * head,
        "H2D busy": grad_accum * (sum(up) + sum(up[: max(L - num_slots, 0)]) + sum(up[j] for r in replays for j in r)
                                  + sum(stash) / (h2d * 1e9))
        + (grad_accum - 1) * sum(grads) / (h2d * 1e9),
        **({"  of which layer all-gathers": grad_accum * gathers} if ranks is not None else {}),
        "D2H busy": grad_accum * (sum(grads) + sum(stash)) / (d2h * 1e9),
        "transfers exposed": exposed,
        "pipeline fill + last drain": fill,
        # One D2H straight into the pinned host grads, no host pass (engine/residents.py ``drain``); not priced, the
        # host add through a staging buffer where a resident has no grad (a frozen embedding) or the host grads are
        # not empty at the drain. Several ranks reduce them from the device instead (``residents' collectives``).
        "residents up + drain (serial)": (0 if on_gpu_resident else r * wb / (h2d * 1e9))
        + (r * gb / (d2h * 1e9) if ranks is None else 0.0),
        **({"layer reduce-scatters (serial)": grad_accum * sum(ranks.reduce_s),
            "residents' collectives (serial)": ranks.residents_s} if ranks is not None else {}),
        **({"CPU optimizer (beyond the next forward)": max(0.0, host_left - sum(fwd) - head / 3)}
           if overlap_optimizer else {"CPU optimizer (serial)": optimizer_s}),
    }
