"""The planner's searches over a monotone predicate: the largest micro-batch that fits a limit (:func:`largest`, also
the smallest whose transfers hide) and the fewest ``gpu_optimizer_groups`` that hide the overlapped host Adam
(:func:`groups_to_hide_optimizer`). :func:`~lightning_megatrain.planner.planning.plan` asks both."""

from __future__ import annotations

from lightning_megatrain.planner.memory import _gpu_peak, gpu_bytes
from lightning_megatrain.planner.shape import _Shape
from lightning_megatrain.planner.timing import step_time


def largest(ok, hi: int = 1 << 24) -> int:
    """Largest b in [1, hi] with ok(b) for a monotone (True, then False) predicate; 0 if none. Doubling, then
    bisection: O(log b) evaluations."""
    lo, top = 0, 1
    while top <= hi and ok(top):
        lo, top = top, top * 2
    top = min(top, hi + 1)
    while top - lo > 1:
        mid = (lo + top) // 2
        lo, top = (mid, top) if ok(mid) else (lo, mid)
    return lo


def groups_to_hide_optimizer(s: _Shape, micro_batch: int, seq_len: int, gkw: dict, tkw: dict,
                             gpu_limit: int) -> int | None:
    """The fewest ``gpu_optimizer_groups`` with which the overlapped host Adam no longer outlasts the next forward
    and the GPU still fits one micro-batch; None when none does."""
    for groups in range(len(s.layers) + 2):
        hidden = step_time(s, micro_batch, seq_len, **{**tkw, "gpu_groups": groups})[
            "CPU optimizer (beyond the next forward)"] <= 0.0
        fits = _gpu_peak(gpu_bytes(s, micro_batch, seq_len, **{**gkw, "gpu_groups": groups})[0]) <= gpu_limit
        if not fits:
            return None
        if hidden:
            return groups
    return None
