"""Forked child processes for tests that measure a process of their own or kill one (host RAM, SIGKILL loops).

[Note: forked children compute on one thread]
GNU OpenMP's thread pool does not survive a fork: a parallel kernel in the child (the ``fill_`` of a new
parameter, say) waits forever for workers that exist only in the parent. Every forked child therefore sets
``torch.set_num_threads(1)`` before any torch work (the several-rank harness, helpers/ranks.py, does the same).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch

_FORK = multiprocessing.get_context("fork")  # no new interpreter: the child has everything imported


def start_forked(target: Callable[..., None], *args: Any, daemon: bool | None = None) -> BaseProcess:
    """A started forked child running ``target(*args)`` on one thread (see the note)."""
    child = _FORK.Process(target=_one_thread, args=(target, *args), daemon=daemon)
    child.start()
    return child


def in_child(target: Callable[..., None], *args: Any, timeout: float = 300.0) -> Any:
    """``target(*args, send)`` in a forked child; returns what it sent through ``send``. A child that sends nothing
    within ``timeout`` seconds is killed and the test fails instead of hanging the suite."""
    receive, send = _FORK.Pipe(duplex=False)
    child = start_forked(target, *args, send)
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
    torch.set_num_threads(1)  # [Note: forked children compute on one thread]
    target(*args)
