"""Child processes for tests that measure a process of their own or kill one (host RAM, SIGKILL loops).

[Note: test children]
- A child that measures its host RAM is *spawned* (:func:`in_child`): a forked child inherits its parent's heap, and
  after a long test session that heap holds large free blocks, already resident, which serve the child's allocations
  unseen by the RSS (a checkpoint load measured 0.1 MiB instead of 52).
- A child started many times is *forked* (:func:`start_forked`: no new interpreter per start). GNU OpenMP's thread
  pool does not survive a fork: a parallel kernel in the child (the ``fill_`` of a new parameter, say) waits forever
  for workers that exist only in the parent, so forked children set ``torch.set_num_threads(1)`` before any torch
  work (the several-rank harness, helpers/ranks.py, does the same).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch

_FORK = multiprocessing.get_context("fork")  # no new interpreter: the child has everything imported
_SPAWN = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the parent's heap


def start_forked(target: Callable[..., None], *args: Any, daemon: bool | None = None) -> BaseProcess:
    """A started forked child running ``target(*args)`` on one thread (see the note)."""
    child = _FORK.Process(target=_one_thread, args=(target, *args), daemon=daemon)
    child.start()
    return child


def in_child(target: Callable[..., None], *args: Any, timeout: float = 300.0) -> Any:
    """``target(*args, send)`` in a spawned child (``target`` importable: a test module's or a helper's function);
    returns what it sent through ``send``. A child that sends nothing within ``timeout`` seconds is killed and the
    test fails instead of hanging the suite."""
    receive, send = _SPAWN.Pipe(duplex=False)
    child = _SPAWN.Process(target=target, args=(*args, send))
    child.start()
    try:
        if not receive.poll(timeout):
            raise TimeoutError(f"{target.__name__} sent nothing within {timeout:.0f} s")
        result = receive.recv()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0, child.exitcode
    return result


def _one_thread(target: Callable[..., None], *args: Any) -> None:
    torch.set_num_threads(1)  # [Note: test children]
    target(*args)
