"""The host optimizer step of step N, run group by group on a worker thread while step N+1 starts.

[Note: overlapped optimizer step]
With fp32 masters in host RAM the optimizer step is pure CPU work (~0.6 s for 3B parameters) during which the GPU
would idle. :class:`OverlappedStep` instead runs it on a worker thread, one :class:`FlatGroup` at a time, in the
order the next forward reads the masters: the residents (embeddings first), then layers 0..L-1. Every reader of a
master calls :meth:`OverlappedStep.wait` for its group first (the H2D prefetch of a layer, the residents' upload,
the CPU backend's acquire), so layer i of the next forward starts as soon as layer i's update is done, while the
update of layer i+1 runs. The clipping factor, when clipping bites, is applied per group on the worker too, just
before that group's update. Everything that reads or writes masters, grads or optimizer states outside the forward
waits for the whole step (:meth:`wait_all`): the next backward (its drains write the grads), checkpointing,
validation, the end of training and teardown. Hyperparameters are read when the step is launched, so the LR
scheduler may step meanwhile (optim/host_optimizer.py ``HostUpdate``).

The worker first builds the update (``launch(make_update)``): that is where it waits for what the training thread
no longer waits for when grads land late (engine/optimizer_step.py, [Note: late grads]): the last D2H copies into
the host grads and the clipping factor computed on the device; there too it may find the step non-finite and update
nothing (``make_update`` returns None), or fail before any group is updated ([Note: all-or-nothing steps]). A
failure stops the groups after it, and surfaces on the training thread at its next wait, with its message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from torch import Tensor

from lightning_megatrain.engine.host_store import FlatGroup


class OverlappedStep:
    """Runs one optimizer update per group on a worker thread; readers wait per group (see the module note)."""

    def __init__(self, groups: list[FlatGroup]) -> None:
        self.groups = groups  # in the order the next forward reads them
        self._done = {id(g): threading.Event() for g in groups}
        for event in self._done.values():
            event.set()  # nothing in flight
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def set_groups(self, groups: list[FlatGroup]) -> None:
        """Step ``groups`` from now on (device groups were placed: they leave the host step); no step in flight."""
        self.wait_all()
        self.groups = groups
        self._done = {id(g): self._done[id(g)] for g in groups}

    def launch(self, make_update: Callable[[], Callable[[list[Tensor]], None] | None]) -> None:
        """Start ``update = make_update()`` on the worker, then ``update(group.params)`` for every group, in order
        (none when ``update`` is None: nothing to update)."""
        self.wait_all()
        for event in self._done.values():
            event.clear()
        self._thread = threading.Thread(
            target=self._run, args=(make_update,), name="megatrain-optimizer-step", daemon=True
        )
        self._thread.start()

    def _run(self, make_update: Callable[[], Callable[[list[Tensor]], None] | None]) -> None:
        update = None
        try:
            update = make_update()
        except BaseException as e:  # surfaced on the training thread by wait / wait_all
            self._error = e
        for group in self.groups:
            try:
                if update is not None and self._error is None:
                    update(group.params)
            except BaseException as e:  # surfaced on the training thread by wait / wait_all
                self._error = e
            finally:
                self._done[id(group)].set()

    def wait(self, group: FlatGroup) -> None:
        """Block until ``group``'s masters are updated (no-op when no step is in flight)."""
        event = self._done.get(id(group))
        if event is not None and not event.is_set():
            event.wait()
        self._raise_error()

    def wait_all(self) -> None:
        """Block until the step in flight, if any, has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"MegaTrain: the overlapped host optimizer step failed ({type(error).__name__}: {error})"
            ) from error


def overlapped_step(
    groups: list[FlatGroup], owned: Callable[[FlatGroup], FlatGroup] | None = None
) -> tuple[OverlappedStep, Callable[[FlatGroup], None]]:
    """The worker over ``groups``, in the order the next forward reads them (the residents', then the layers'), and
    the gate every reader of a group's masters calls first. ``owned(group)``: with several ranks, this rank's owned
    share of a group, which the worker steps and the gate waits for (engine/sharding.py, [Note: sharded host
    state]); readers still pass the whole group."""
    if owned is None:
        step = OverlappedStep(groups)
        return step, step.wait
    step = OverlappedStep([owned(g) for g in groups])
    return step, lambda group: step.wait(owned(group))
