"""Host memory by kind: the sizes ``MegaTrainStrategy.host_memory`` returns, the line it logs at train end, and the
watch that warns when the host runs nearly out during fit ([Note: host memory watch])."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from lightning_megatrain import _hardware
from lightning_megatrain._hardware import GIB, host_os_reserve, host_rss_gib

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


def _by_kind(sizes: dict[str, int]) -> str:
    """``sizes`` but the resident set, in GiB: ``masters 48.5, grads 20.1, ...``."""
    return ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in sizes.items() if k != "rss")


def log_host_memory(sizes: dict[str, int], n_params: int) -> None:
    """Log :func:`host_memory_by_kind`'s ``sizes`` at train end, in GiB, with the peak resident set so far, per
    parameter of the model's ``n_params`` where the model's own state is most of the memory."""
    parts = _by_kind(sizes)
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


class HostMemoryWatch:
    """A thread that says, once, when the machine's host memory is nearly gone during training.

    Note: host memory watch
        Pinned memory cannot be swapped out, and when the host runs out the kernel's OOM killer ends the trainer
        with SIGKILL: no traceback, no message, the last log line unrelated. The placements leave a reserve
        ([Note: host reserve] in _hardware.py), but what other processes, the data loader or the user's code take
        after them is not theirs to count. So, during fit and its teardown, this thread reads what the process may
        still allocate every second (``MemAvailable``, or a cgroup's headroom where smaller: /proc and /sys reads, no
        work on the training threads) and, when it falls below ``floor`` (half the OS reserve, at least 1 GiB: 1.9
        GiB on a 128 GiB host), logs one warning with the numbers and what this process holds, so a run the OOM
        killer ends says why in its last lines. It warns again only after memory came back above twice the floor.
    """

    PERIOD_S = 1.0

    def __init__(self, holdings: Callable[[], dict[str, int]], floor: int | None = None) -> None:
        total = _hardware.meminfo_bytes("MemTotal")
        self.holdings = holdings  # this process's host memory by kind (MegaTrainStrategy.host_memory)
        self.floor = floor if floor is not None else max(GIB, host_os_reserve(total or 0) // 2)
        self.total = total
        self.armed = True  # no warning since memory was last above twice the floor
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.total is None or self._thread is not None:  # no /proc/meminfo: nothing to watch
            return
        self._thread = threading.Thread(target=self._run, name="megatrain-host-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                self.check()
            except Exception as error:  # a watch must not end on what it reads; the next sample tries again
                log.debug("MegaTrain: host memory watch: %s", error)

    def check(self) -> None:
        """One sample: warn if the memory the process may still allocate (``MemAvailable``, or a cgroup's or
        ``ulimit -v``'s headroom where smaller: ``_hardware.available_host_bytes``) is below the floor and the watch
        is armed; re-arm above twice it."""
        bound = _hardware.available_host_bytes()
        if bound is None:
            return
        available, limit = bound
        if available >= 2 * self.floor:
            self.armed = True
        if available >= self.floor or not self.armed:
            return
        self.armed = False
        try:
            sizes = self.holdings()
        except Exception:  # the training thread changed the states or tore the engine down meanwhile: the RSS
            rss = host_rss_gib()
            sizes = {} if rss is None else {"rss": int(rss * GIB)}
        held = _by_kind(sizes)
        log.warning(
            "MegaTrain: host memory is nearly gone: %.1f GiB available (%s) of %.1f GiB; this process holds %s "
            "GiB%s. If the kernel's OOM killer ends this run, this is why. HINT: a smaller micro-batch or sequence, "
            "more gpu_optimizer_groups, host_state='int8_moments', fewer data loader workers, or more host RAM; "
            "`megatrain plan` shows what the model needs.",
            available / GIB, limit, (self.total or 0) / GIB,
            f"{sizes['rss'] / GIB:.1f}" if "rss" in sizes else "an unknown amount", f" ({held})" if held else "",
        )
