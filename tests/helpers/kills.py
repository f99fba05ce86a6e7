"""SIGKILL during checkpoint saves: the loop the file and sharded checkpoint formats are both tested with."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.forked import start_forked


def kill_during_saves(root: Path, train: Callable[[int], None], load: Callable[[Path], dict[str, Any]], *,
                      kills: int, max_saves: int, max_pause: float) -> int:
    """Fork ``train(max_steps)`` (a child that resumes from ``root``'s ``last.ckpt`` and saves every step) ``kills``
    times and SIGKILL each once its 1 to ``max_saves``-th save has begun (a ``.*.tmp`` entry appeared in ``root``),
    after a random pause of up to ``max_pause`` s (none the first time: surely inside a save). After every kill each
    ``*.ckpt`` must ``load``; at least one kill must have landed inside a save. Then one more child trains a step
    past ``last.ckpt`` and exits cleanly. Returns ``last.ckpt``'s global step before that child."""
    rng = random.Random(0)
    killed_mid_save, child = 0, None
    try:
        for kill in range(kills):
            child = start_forked(train, 10_000, daemon=True)
            saves, seen, deadline = rng.randint(1, max_saves), set(), time.monotonic() + 120
            while len(seen) < saves:  # until the saves-th save of this child has begun
                assert child.is_alive() and time.monotonic() < deadline, f"the child began {len(seen)} saves"
                seen |= {p.name for p in root.glob(".*.tmp")}
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, max_pause) if kill else 0.0)
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            assert child.exitcode == -signal.SIGKILL
            killed_mid_save += bool(list(root.glob(".*.tmp")))
            ckpts = sorted(root.glob("*.ckpt"))
            assert any(c.name == "last.ckpt" for c in ckpts) or len(ckpts) == 0
            for ckpt in ckpts:
                load(ckpt)  # raises for a truncated or incomplete checkpoint
        assert killed_mid_save >= 1  # at least one kill landed inside a save (most do)
        start = load(root / "last.ckpt")["global_step"]
        child = start_forked(train, start + 1)
        child.join(timeout=300)
        assert child.exitcode == 0
        return start
    finally:
        if child is not None and child.is_alive():  # a failed assertion above
            os.kill(child.pid, signal.SIGKILL)
            child.join()
