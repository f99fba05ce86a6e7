"""Host memory by kind: the sizes ``MegaTrainStrategy.host_memory`` returns and the line it logs at train end."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lightning_megatrain._hardware import GIB, host_rss_gib

log = logging.getLogger(__name__)


def host_memory_by_kind(engine_bytes: dict[str, int], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, int]:
    """``engine_bytes`` (the engine's ``host_bytes``, by kind) with the optimizers' states in host memory, the
    process's resident set (``rss``) and the part of it none of those explain (``other``); sizes only, no sync."""
    sizes = engine_bytes
    states = {
        t.data_ptr(): t.nbytes
        for optimizer in optimizers
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.device.type == "cpu"
    }
    sizes["optimizer_states"] = sum(states.values())
    rss = host_rss_gib()
    if rss is not None:
        sizes["rss"] = int(rss * GIB)
        sizes["other"] = sizes["rss"] - sum(v for k, v in sizes.items() if k != "rss")
    return sizes


def log_host_memory(sizes: dict[str, int], n_params: int) -> None:
    """Log :func:`host_memory_by_kind`'s ``sizes`` at train end, in GiB, with the peak resident set so far, per
    parameter of the model's ``n_params`` where the model's own state is most of the memory."""
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in sizes.items() if k != "rss")
    total = sizes.get("rss", sum(sizes.values()))
    peak = host_rss_gib("VmHWM")
    # Per parameter only where the model's own state is most of the memory: for a tiny model the process
    # (Python, torch, libraries) dominates and "1,000 bytes/param" would read as a leak.
    model_state = sum(v for k, v in sizes.items() if k not in ("rss", "other"))
    per_param = model_state * 2 >= total
    log.info(
        "MegaTrain: host memory at train end %.1f GiB%s: %s GiB%s%s",
        total / GIB,
        f" ({total / max(n_params, 1):.1f} bytes/param)" if per_param else "",
        parts,
        "" if peak is None else f"; peak so far {peak:.1f} GiB"
        + (f" ({peak * GIB / max(n_params, 1):.1f} bytes/param)" if per_param else ""),
        "" if per_param else f" (the {n_params / 1e6:.2f}M-parameter model's state is {model_state / GIB:.2f} GiB "
        "of it; the rest is the Python process)",
    )
