"""Host updates that start during the optimizer step's backward, each layer's as soon as its grads are final.

[Note: updates during backward]
The overlapped host step (engine/overlap.py) starts when backward ends, so it hides only behind the next forward,
about a quarter of a step; at 7B the host Adam takes longer than that and the GPU waits. The last micro-batch's
backward finishes the layers' grads one at a time, layer L-1 first, so each layer's update could run under the
backward of the layers below it. What stops it is what the step decides only at the end of backward: clipping's
factor (from the global grad norm) and whether the step is finite ([Note: all-or-nothing steps]).

:class:`BackwardUpdates` speculates that the step neither clips nor is skipped. Armed for the closure of an optimizer
step (:meth:`OptimizerStep.arm_backward_updates`), its worker thread takes each host layer once its grads have
landed (as many drains issued while armed as the layer had forwards with grad: a drain issued before the arm, by an
earlier micro-batch, does not count), copies the layer's masters, Adam moments and step counts into a snapshot, and
runs the layer's update exactly as the step would: the same :class:`HostUpdate` kernel, the step's hyperparameters.
Once every grad has landed the step closes the speculation (:meth:`BackwardUpdates.close`: the layer in progress
finishes, the queued ones are left to the step, which updates them without a snapshot) and decides:

- factor 1 and finite: the speculated layers are done; the host step skips them and updates the rest, the first
  layers first, which is what the next forward reads first;
- clipping fired, the step is skipped, or anything raised: each speculated layer is restored from its snapshot,
  bitwise, and the step runs as if nothing had been speculated.

So the result is the unoverlapped step's, bitwise, either way (tests/engine/test_backward_updates.py). Snapshots
cost host memory, 12 bytes per parameter of a speculated layer (fp32 master and two moments), allocated once per
layer and reused, within a budget measured at the first speculating step (:func:`snapshot_budget`); the layers
beyond it wait for the end of backward as before. The first step creates the Adam states and does not speculate.
``update_during_backward="auto"`` does not speculate in the step after one whose clipping fired (it likely fires
again, and the redo costs a restore); ``True`` speculates every step.

Only the host Adam/AdamW (:class:`HostUpdate`, ``host_state="fp32"``) speculates, with one optimizer, one rank, and
no user code that may read grads or parameters between backward and the step (hooks.py
``backward_update_blockers``).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_megatrain._hardware import GIB
from lightning_megatrain.engine.host_budget import host_free_checked
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.transfer import Transfer
from lightning_megatrain.optim.host_optimizer import HostUpdate, Hyper, hyper_snapshot

log = logging.getLogger(__name__)

_SNAPSHOT_BYTES_PER_PARAM = 12  # fp32 master, exp_avg, exp_avg_sq
_RESERVE_BYTES = 4 * GIB  # host memory the snapshots always leave free


def snapshot_budget() -> int:
    """Host bytes the snapshots may take: what the process may still allocate, less 4 GiB (unbounded where that is
    unknown or the host checks are off, ``MEGATRAIN_SKIP_MEMORY_CHECK=1``)."""
    free = host_free_checked()
    return 1 << 62 if free is None else max(free - _RESERVE_BYTES, 0)


@dataclass
class Snapshot:
    """One speculated layer, with what restores it."""

    group: FlatGroup
    params: list[Tensor]  # the parameters the update stepped
    states: list[dict]  # their optimizer states (the dicts themselves)
    slab: Tensor  # 1D fp32 host: the masters, then each parameter's exp_avg, then each exp_avg_sq, as before
    steps: list[Any]  # each parameter's step count before (a 0-dim tensor's copy, or DeepSpeed's int)


@dataclass(eq=False)
class Speculation:
    """One optimizer step's speculation, from :meth:`BackwardUpdates.arm` to :meth:`BackwardUpdates.close`.

    The step after it may arm before it closes (its worker closes it, late grads), so everything is per step: the
    counts, the queued layers and the snapshots; drains tell the one armed when they were issued."""

    optimizer: torch.optim.Optimizer
    hyper: Hyper  # the optimizer's hyperparameters when armed (the LR scheduler steps only after the step)
    skip: frozenset[int]  # ids of parameters the host step does not update (device groups)
    forwarded: dict[int, int] = field(default_factory=dict)  # layer index -> forwards with grad since the arm
    landed: dict[int, int] = field(default_factory=dict)  # layer index -> its drains issued since the arm, landed
    closed: bool = False  # decided: no layer starts any more
    done: list[Snapshot] = field(default_factory=list)  # the speculated layers

    def hyper_unchanged(self, now: Hyper) -> bool:
        """Whether the hyperparameters ``now`` are those the speculation used (code in the closure may set them)."""
        try:
            return bool(self.hyper[1] == now[1])
        except (RuntimeError, TypeError, ValueError):  # a tensor hyperparameter with no single truth value
            return False


class BackwardUpdates:
    """Speculative host updates of the layer groups during backward (see the module note); one worker thread."""

    def __init__(self, groups: list[FlatGroup], transfer: Transfer) -> None:
        self.groups = groups  # the layers', by index
        self.transfer = transfer  # whose drains tell when a layer's grads have landed (its landed_hook)
        self.budget_bytes: int | None = None  # measured at the first layer speculated (snapshot_budget)
        self.clipped_last = False  # the last step's clipping fired (its speculation, if any, was redone)
        self.speculated = 0  # layer updates run during backward, in all
        self.undone = 0  # of which restored from their snapshots
        self._slabs: dict[int, Tensor] = {}  # layer index -> its snapshot storage, reused every step
        self._cond = threading.Condition()  # guards the speculations' counts between the threads that call in
        self._current: Speculation | None = None  # the one the next forwards count for
        self._busy_with: Speculation | None = None  # the one whose layer the worker is updating
        self._queue: queue.Queue[tuple[Speculation, int] | None] = queue.Queue()  # layers whose grads are final
        self._worker = threading.Thread(target=self._work, name="megatrain-backward-updates", daemon=True)
        self._worker.start()

    # - the training thread

    def arm(self, optimizer: torch.optim.Optimizer, skip: frozenset[int]) -> Speculation:
        """Speculate on ``optimizer``'s step (called before the step's closure); the step closes what this returns."""
        speculation = Speculation(optimizer, hyper_snapshot(optimizer), skip)
        with self._cond:
            self._current = speculation
        # drains issued from now on count for this step, whichever step is armed when they land
        self.transfer.landed_hook = functools.partial(self._landed, speculation)
        return speculation

    def forwarded(self, index: int) -> None:
        """Layer ``index`` ran a forward with grad (the streamed Function's forward, on the training thread)."""
        with self._cond:
            current = self._current
            if current is not None and not current.closed:
                current.forwarded[index] = current.forwarded.get(index, 0) + 1

    def _landed(self, speculation: Speculation, index: int) -> None:
        """A drain of layer ``index`` issued while ``speculation`` was armed has landed in its host grads (the
        drain's thread)."""
        with self._cond:
            if speculation.closed:
                return
            speculation.landed[index] = speculation.landed.get(index, 0) + 1
            if speculation.landed[index] == speculation.forwarded.get(index, 0):
                self._queue.put((speculation, index))

    def close(self, speculation: Speculation) -> list[Snapshot]:
        """End ``speculation``: no layer of it starts any more, the one in progress finishes. Returns the speculated
        layers; the others are the step's. Any thread."""
        with self._cond:
            speculation.closed = True
            while self._busy_with is speculation:
                self._cond.wait()
            if self._current is speculation:
                self._current = None
                self.transfer.landed_hook = None
            done, speculation.done = speculation.done, []
        return done

    def decide(self, speculation: Speculation, keep: bool, hyper: Hyper | None = None) -> list[Snapshot]:
        """:meth:`close` ``speculation`` and keep its updates (returned) if ``keep`` and the hyperparameters are
        still those it used (``hyper``, default: now), else undo them (and return none)."""
        done = self.close(speculation)
        if keep and speculation.hyper_unchanged(hyper or hyper_snapshot(speculation.optimizer)):
            return done
        self.restore(done)
        return []

    def restore(self, snapshots: list[Snapshot]) -> None:
        """Put every speculated layer back as it was before its update, bitwise."""
        for snap in snapshots:
            _restore(snap)
        self.undone += len(snapshots)

    def host_bytes(self) -> int:
        """Host bytes of the snapshots' storage."""
        return sum(s.nbytes for s in self._slabs.values())

    def shutdown(self) -> None:
        """Stop the worker (teardown, after the last step was decided)."""
        self._queue.put(None)
        self._worker.join()

    # - the worker

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            speculation, index = item
            with self._cond:
                if speculation.closed:
                    self._queue.task_done()
                    continue
                self._busy_with = speculation
            snap = None
            try:
                snap = self._speculate(index, speculation)
            except BaseException as error:  # the step itself meets the same error, with its report
                log.debug("MegaTrain: no speculative update of layer %d (%s: %s)", index, type(error).__name__, error)
            finally:
                with self._cond:
                    if snap is not None:
                        speculation.done.append(snap)
                        self.speculated += 1
                    self._busy_with = None
                    self._cond.notify_all()
                self._queue.task_done()  # join() waits for every queued layer

    def _speculate(self, index: int, speculation: Speculation) -> Snapshot | None:
        """Snapshot layer ``index`` and update it as the step would; None where it cannot (no state yet, no grads,
        over budget). A failed update is restored before it raises."""
        group, optimizer = self.groups[index], speculation.optimizer
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        params = [p for p in group.params
                  if p.grad is not None and id(p) in in_optimizer and id(p) not in speculation.skip]
        if not params or any(not optimizer.state.get(p) for p in params):
            return None
        slab = self._slab(index)
        if slab is None:
            return None
        snap = _snapshot(group, params, optimizer, slab)
        update = HostUpdate(optimizer, None, skip=speculation.skip, snapshot=speculation.hyper)
        try:
            with torch.no_grad():
                update.prepare([params])
                update(params)
        except BaseException:
            _restore(snap)
            raise
        return snap

    def _slab(self, index: int) -> Tensor | None:
        """Layer ``index``'s snapshot storage (allocated on its first speculation), None beyond the budget, which is
        measured at the first speculation: every Adam state and host grad exists by then."""
        if self.budget_bytes is None:
            self.budget_bytes = snapshot_budget()
            layer = max(g.numel for g in self.groups) * _SNAPSHOT_BYTES_PER_PARAM
            log.info(
                "MegaTrain: host updates start during backward for up to %d of %d layers (snapshots of %.2f GiB "
                "each, %.1f GiB of host memory free for them); a step whose clipping fires or that is skipped "
                "redoes them from the snapshots ([Note: updates during backward])",
                min(len(self.groups), self.budget_bytes // max(layer, 1)), len(self.groups), layer / GIB,
                min(self.budget_bytes, 1 << 50) / GIB,
            )
        slab = self._slabs.get(index)
        if slab is None:
            numel = _SNAPSHOT_BYTES_PER_PARAM // 4 * self.groups[index].numel
            if self.host_bytes() + 4 * numel > self.budget_bytes:
                return None
            slab = self._slabs[index] = torch.empty(numel, dtype=torch.float32)
        return slab


def params_of(snapshots: list[Snapshot]) -> frozenset[int]:
    """Ids of the parameters the kept speculative updates stepped (the host step skips them)."""
    return frozenset(id(p) for snap in snapshots for p in snap.params)


def _snapshot(group: FlatGroup, params: list[Tensor], optimizer: torch.optim.Optimizer, slab: Tensor) -> Snapshot:
    """Copy ``group``'s masters and the Adam state of ``params`` into ``slab``."""
    states = [optimizer.state[p] for p in params]
    n = group.numel
    slab[:n].copy_(group.master)
    offset = n
    for key in ("exp_avg", "exp_avg_sq"):
        for p, state in zip(params, states):
            slab[offset : offset + p.numel()].copy_(state[key].reshape(-1))
            offset += p.numel()
    return Snapshot(group, params, states, slab, [_copy_step(state["step"]) for state in states])


def _restore(snap: Snapshot) -> None:
    """Put ``snap``'s layer back as :func:`_snapshot` found it."""
    n = snap.group.numel
    snap.group.master.copy_(snap.slab[:n])
    offset = n
    for key in ("exp_avg", "exp_avg_sq"):
        for p, state in zip(snap.params, snap.states):
            state[key].copy_(snap.slab[offset : offset + p.numel()].view_as(state[key]))
            offset += p.numel()
    for state, step in zip(snap.states, snap.steps):
        if isinstance(step, Tensor):
            state["step"].copy_(step)
        else:
            state["step"] = step


def _copy_step(step: Any) -> Any:
    return step.clone() if isinstance(step, Tensor) else step
