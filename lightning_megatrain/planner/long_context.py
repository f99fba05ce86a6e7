"""Long context: where one micro-batch's layer-input checkpoints go, and the longest sequence that fits a machine.

A recomputed layer's input (the fp32 residual stream, ``4 * H * B * T`` bytes) is saved for its recompute: the
*layer-input checkpoint*. At long sequences these outgrow host memory (Llama-2-7B at 524,288 tokens: 8 GiB each, 256
GiB for 32 layers), so three options place them (config.py; memory.py's ``gpu_bytes`` and ``host_bytes`` model
each): ``seq_tile`` (the position-wise block run a tile at a time, which lowers the GPU peak), ``segment_layers``
(``k``: one checkpoint per ``k`` layers, ``ceil(L / k)`` in all, backward replaying the other ``k - 1``) and
``device_checkpoints`` (``n``: the last ``n`` stay on the GPU). With ``S`` the size of one checkpoint, ``P(k, n)`` the
GPU peak (memory.py) and ``F`` the host memory free for checkpoints:

    host  (ceil(L / k) - n) * S  <=  F          GPU  P(k, n)  <=  the GPU's memory

:func:`place` decides the ``"auto"`` ones as config.py declares them: ``k = 1, n = 0`` when every checkpoint fits the
host; else, still at ``k = 1``, the fewest on the GPU that leave the rest to the host (``P`` grows by ``S`` per
checkpoint there beyond the first), so the GPU memory left stays with ``keep_layers="auto"`` and the allocator's
slack; else the smallest ``k`` that fits both (``P`` grows by ``S`` per replayed input held), each ``k`` again with
``n = 0`` first, then the fewest the host needs. (Filling the GPU instead planned Llama-3-8B at 262,144 tokens at
138.2 of 139 GiB with 19 checkpoints on it where 1 was needed.) An explicit int is taken as given and checked.
Where no flat segment length fits, nested ones (``sub_segment_layers = m``, engine/segments.py: a segment's replay
keeps every ``m``-th regenerated input, so it holds fewer at once and replays more): ``"auto"`` tries every
``(k, m)`` in the order of the layer forwards they replay (memory.py ``replayed_forwards``), flat ones included, and
takes the first that fits. ``seq_tile`` is not searched: engine/tiling.py's ``tile_length`` resolves it. Every
layer is planned recomputed (``keep_layers=0``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.tiling import tile_length
from lightning_megatrain.planner.constants import PRECISIONS
from lightning_megatrain.planner.machine import Machine
from lightning_megatrain.planner.memory import (
    _gpu_peak,
    checkpoints,
    gpu_bytes,
    gpu_keywords,
    regenerated,
    replayed_forwards,
)
from lightning_megatrain.planner.shape import _Shape, describe

# The longest-sequence search: multiples of this many positions, up to LONGEST_CAP.
SEQ_STEP = 1024
LONGEST_CAP = 1 << 24


@dataclass(frozen=True)
class Placement:
    """The long-context options for one micro-batch shape, decided (:func:`place`). Bytes are bytes."""

    seq_tile: int | None  # positions per tile of the position-wise block; None: untiled
    segment_layers: int
    sub_segment_layers: int  # 1: flat segments
    device_checkpoints: int  # at most ``checkpoints``
    checkpoints: int  # ceil(layers / segment_layers)
    checkpoint_bytes: int  # one: 4 * hidden * micro-batch * seq (fp32 residual stream)
    host_need: int  # the checkpoints offloaded to pinned host memory
    host_free: int  # host memory free for them
    gpu_peak: int  # memory.py's peak with this placement
    gpu_limit: int
    fits: bool
    why: str  # the reason for the choice, or, where none fits, the numbers of the closest


def _count(n: int) -> str:
    return f"{n} layer-input checkpoint{'s' if n != 1 else ''}"


def _size(nbytes: float) -> str:
    """GiB, or MiB below one GiB (a short sequence's checkpoints do not print as 0.0 GiB)."""
    return f"{nbytes / GIB:.1f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


def place(s: _Shape, micro_batch: int, seq_len: int, *, config: EngineConfig, gkw: dict, host_free: int,
          gpu_limit: int) -> Placement:
    """Decide ``segment_layers``, ``sub_segment_layers`` and ``device_checkpoints`` (``"auto"`` as the module
    docstring says; ints checked) for one micro-batch of ``seq_len`` positions. ``gkw``: memory.py ``gpu_bytes``'s
    keyword arguments, without the long-context ones. Never raises for a shape that fits nothing: ``fits`` is False
    and ``why`` has the numbers."""
    tile = tile_length(config.seq_tile, seq_len)
    S, L = 4 * s.hidden * micro_batch * seq_len, len(s.layers)
    peaks: dict[tuple[int, int, int], int] = {}

    def gpu(k: int, m: int, n: int) -> int:
        key = (k, regenerated(L, k, m), n)  # the peak depends on the sub-segments only through what they hold
        if key not in peaks:
            items, _ = gpu_bytes(s, micro_batch, seq_len, **gkw, tile=tile, segment=k, device_checkpoints=n, sub=m)
            peaks[key] = _gpu_peak(items)
        return peaks[key]

    def host(k: int, n: int) -> int:
        return (checkpoints(s, k) - n) * S

    def fewest_on_gpu(k: int) -> int:
        """The fewest checkpoints on the GPU with which the rest fit the host, at segments of ``k``."""
        C = checkpoints(s, k)
        return min(C, max(0, C - host_free // S))

    def result(k: int, m: int, n: int, fits: bool, why: str) -> Placement:
        return Placement(seq_tile=tile, segment_layers=k, sub_segment_layers=m, device_checkpoints=n,
                         checkpoints=checkpoints(s, k), checkpoint_bytes=S, host_need=host(k, n),
                         host_free=host_free, gpu_peak=gpu(k, m, n), gpu_limit=gpu_limit, fits=fits, why=why)

    auto_k, auto_n = config.segment_layers == "auto", config.device_checkpoints == "auto"
    auto_m = config.sub_segment_layers == "auto"
    each = f"of {_size(S)} (4 B x hidden {s.hidden} x {micro_batch} x {seq_len:,} tokens)"
    free = f"{_size(host_free)} of pinned host memory free"

    def offloaded(k: int, n: int) -> str:
        return f"{checkpoints(s, k) - n} offloaded ({_size(host(k, n))} of {_size(host_free)} free)"

    closest: tuple[int, int, int, int] | None = None  # (larger shortfall, k, m, n) of the one nearest to fitting
    given_k = None if auto_k else config.segment_layers
    for replays, k, m in _candidates(L, given_k, None if auto_m else config.sub_segment_layers):
        C = checkpoints(s, k)
        if auto_n and host(k, 0) <= host_free and gpu(k, m, 0) <= gpu_limit:
            n, why = 0, f"all {_count(C)} {each} fit pinned host memory: {offloaded(k, 0)}"
        elif auto_n:
            n = fewest_on_gpu(k)
            why = (f"the {_count(C)} {each}, {_size(C * S)} in all, exceed the {free}: the last {n} stay on the "
                   f"GPU, the fewest the host needs; {offloaded(k, n)}")
        else:
            n = min(config.device_checkpoints, C)
            why = f"{_count(C)} {each}: {n} on the GPU as given, {offloaded(k, n)}"
        if host(k, n) <= host_free and gpu(k, m, n) <= gpu_limit:
            nested = 1 < m < k
            held = (f"sub-segments of {m} ({regenerated(L, k, m)} regenerated inputs held at once instead of "
                    f"{k - 1})")
            if k > 1 and auto_k:
                on_gpu = "the fewest on the GPU" if auto_n else f"device_checkpoints={config.device_checkpoints}"
                why = (f"one checkpoint per layer does not fit with {on_gpu}; segments of {k} layers"
                       f"{', nested in ' + held if nested else ''}, {replays} layer forwards replayed per "
                       f"micro-batch: {why}")
            elif nested and auto_m:  # segment_layers as given
                why = (f"flat segments of {k} do not fit; nested in {held}, {replays} layer forwards replayed per "
                       f"micro-batch: {why}")
            return result(k, m, n, True, why)
        miss = max(host(k, n) - host_free, gpu(k, m, n) - gpu_limit)  # the larger shortfall, in bytes
        if closest is None or miss < closest[0]:
            closest = (miss, k, m, n)
    # nothing fits: the numbers of the floor (one checkpoint per layer, none on the GPU) and of the closest candidate
    k0, n0, m0 = config.checkpoints_unplanned()
    n0 = min(n0, checkpoints(s, k0))
    given = "" if auto_k and auto_n and auto_m else (
        f" with segment_layers={config.segment_layers!r}, sub_segment_layers={config.sub_segment_layers!r}, "
        f"device_checkpoints={config.device_checkpoints!r}")
    lines = [f"the layer-input checkpoints of micro-batch {micro_batch} x {seq_len:,} tokens fit neither host nor "
             f"GPU{given}: {checkpoints(s, k0)} {each}, {_size(host(k0, 0))} in all; the host holds "
             f"{max(host_free, 0) // S} ({free})"]
    if host_free < 0:
        lines[0] = (f"no host memory is left for the layer-input checkpoints of micro-batch {micro_batch} x "
                    f"{seq_len:,} tokens ({_count(checkpoints(s, k0))} {each}): what else it holds already exceeds "
                    f"it by {_size(-host_free)}")
    elif gpu(k0, m0, n0) > gpu_limit:
        lines.append(f"the GPU peak is {_size(gpu(k0, m0, n0))} of {_size(gpu_limit)} at segment_layers={k0}, "
                     f"sub_segment_layers={m0}, device_checkpoints={n0}, and longer segments or more checkpoints on "
                     "the GPU only raise it")
    else:
        spare = gpu_limit - gpu(k0, m0, n0)
        lines.append(f"the GPU's {_size(gpu_limit)} leave {_size(spare)} beside its {_size(gpu(k0, m0, n0))} peak: "
                     f"{spare // S} more inputs; segments of k layers leave ceil({L}/k) - n checkpoints on the "
                     "host and put the inputs a segment regenerates (k - 1, fewer in sub-segments) and all but one "
                     "of the n device checkpoints on the GPU")
        if closest is not None and (auto_k or auto_n):
            _, k, m, n = closest
            lines.append(f"the closest, segment_layers={k}, sub_segment_layers={m} with device_checkpoints={n}, "
                         f"needs {_size(host(k, n))} of host and a GPU peak of {_size(gpu(k, m, n))}")
    tiled = f"seq_tile={tile}" if tile is not None else "untiled (seq_tile=None)"
    return result(k0, m0, n0, False, "; ".join(lines) + f" ({tiled})")


@functools.cache
def _candidates(L: int, k: int | None, m: int | None) -> tuple[tuple[int, int, int], ...]:
    """``(replayed forwards, segment_layers, sub_segment_layers)`` for ``L`` recomputed layers in the order
    :func:`place` tries them: every ``k`` (or the given one) with every ``m`` (or the given one), fewest replays first,
    then the shortest segments. Left out: any that another candidate beats on all three of replays, inputs
    held at once and checkpoints (the GPU peak and host need rise with the last two), which cannot fit where that
    one does not."""
    every = []
    for k_ in range(1, L + 1) if k is None else [k]:
        for m_ in [1, *range(2, k_)] if m is None else [m]:
            every.append((replayed_forwards(L, k_, m_), regenerated(L, k_, m_), -(-L // k_), k_, m_))
    # one sorted sweep: a candidate is kept unless an earlier one (no more replays) holds no more inputs and needs no
    # more checkpoints; of equal ones the first, the shortest segments, flat before nested, stays
    front: list[tuple[int, int]] = []
    kept = []
    for replays, held, count, k_, m_ in sorted(every):
        if any(h <= held and c <= count for h, c in front):
            continue
        front.append((held, count))
        kept.append((replays, k_, m_))
    return tuple(sorted(kept))


def longest_seq_len(fits: Callable[[int], bool], step: int = SEQ_STEP, cap: int = LONGEST_CAP) -> int:
    """The longest multiple of ``step`` up to ``cap`` for which ``fits`` holds; 0 if not even ``step`` does.

    Memory grows with the sequence except where ``seq_tile="auto"`` starts tiling (engine/tiling.py:
    ``AUTO_MIN_POSITIONS``, a power of two times ``step``), where it drops. So every doubling of ``step`` up to
    ``cap`` is tried (not only up to the first that fails), then the gap above the longest that fits is bisected."""
    doublings = [step << j for j in range((cap // step).bit_length()) if step << j <= cap]
    fitting = [t for t in doublings if fits(t)]
    if not fitting:
        return 0
    lo, hi = fitting[-1] // step, min(2 * fitting[-1], cap + step) // step  # in steps: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def longest_placeable(s: _Shape, micro_batch: int, *, config: EngineConfig, gkw: dict, host_free: int,
                      gpu_limit: int) -> int:
    """The longest sequence (a multiple of ``SEQ_STEP``) whose checkpoints :func:`place` fits, at ``micro_batch``
    with ``config``'s options (``"auto"`` decided again at each length) and these limits."""
    return longest_seq_len(lambda t: place(s, micro_batch, t, config=config, gkw=gkw, host_free=host_free,
                                           gpu_limit=gpu_limit).fits)


def place_checkpoints(model: Any, *, seq_len: int, micro_batch: int, gpu_limit: int, host_free: int,
                      precision: str = "bf16-mixed", loss: str = "chunked", loss_chunk_size: int = 4096,
                      attn_implementation: str | None = None, config: EngineConfig = EngineConfig(),
                      gpu_reserve_gib: float = Machine().gpu_reserve_gib) -> tuple[Placement, int | None]:
    """The long-context options for one micro-batch (:func:`place`) on a GPU of ``gpu_limit`` bytes with
    ``host_free`` bytes of host memory free for the offloaded checkpoints, and, where nothing fits, the longest
    sequence (a multiple of 1024) that fits these limits at this micro-batch (else None).

    ``config``'s ``num_slots``, ``gpu_optimizer_groups`` (an int; ``"auto"`` plans none; their state in
    ``host_state``'s layout) and the three long-context options are read. Reads nothing of this machine.

    Raises:
        ValueError: an unknown precision or loss; ``seq_len`` or ``micro_batch`` below 1.
    """
    if precision not in PRECISIONS or loss not in ("chunked", "naive"):
        raise ValueError(f"precision in {list(PRECISIONS)}, loss in ['chunked', 'naive']; got {precision!r}, {loss!r}")
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len, micro_batch must be >= 1; got {seq_len}, {micro_batch}")
    s = describe(model, attn_implementation=attn_implementation)
    groups = config.gpu_optimizer_groups if config.gpu_optimizer_groups != "auto" else 0
    gkw = {**gpu_keywords(config, precision=precision, loss=loss, loss_chunk=loss_chunk_size,
                          reserve_gib=gpu_reserve_gib), "gpu_groups": groups}
    placed = place(s, micro_batch, seq_len, config=config, gkw=gkw, host_free=host_free, gpu_limit=gpu_limit)
    longest = None if placed.fits else longest_placeable(s, micro_batch, config=config, gkw=gkw, host_free=host_free,
                                                         gpu_limit=gpu_limit)
    return placed, longest


def planned_placement(s: _Shape, micro_batch: int, seq_len: int, config: EngineConfig, gkw: dict, host_free: int,
                      gpu_limit: int, offload: bool) -> Placement:
    """The long-context options :func:`~lightning_megatrain.planner.planning.plan` plans: decided by :func:`place`;
    where nothing fits, ``"auto"`` as the engine was before them (one checkpoint per layer, none on the GPU) so the
    tables show what that needs, explicit values as given. Without offload every checkpoint stays on the GPU."""
    placed = place(s, micro_batch, seq_len, config=config, gkw=gkw, host_free=host_free if offload else 1 << 62,
                   gpu_limit=gpu_limit)
    k, n, m = config.checkpoints_unplanned()
    if not offload:
        return dataclasses.replace(placed, segment_layers=k, sub_segment_layers=m, device_checkpoints=0, host_need=0,
                                   why="no activation offload: every checkpoint stays on the GPU")
    if placed.fits:
        return placed
    return dataclasses.replace(placed, segment_layers=k, sub_segment_layers=m, device_checkpoints=n)
