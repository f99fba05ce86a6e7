"""Gradient drain (engine/drain.py): the host side of [Note: gradient drain], on the CPU.

The D2H copies need CUDA (the GPU tests, tests/**/test_gpu_*.py, run every drain path against plain training); here
a queue entry stands for a copy in flight, and an event the test opens stands for its ``done`` event, so the worker's
bookkeeping is checked exactly: slabs come back, device buffers stay referenced until the copy is done, counts of
drains in flight, and a worker failure surfaces on the training thread.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch import nn

from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.drain import DEVICE_DRAINS, GradDrain, _Drain, add_packed
from lightning_megatrain.engine.host_store import pack_group

SHAPES = ((3, 4), (5,), (2, 2))


class _Done:
    """Stands for a D2H copy's ``done`` event: ``synchronize`` blocks until the test opens it (or raises)."""

    def __init__(self, done: bool = True, error: BaseException | None = None) -> None:
        self.waited = threading.Event()  # the worker is in ``synchronize``
        self.opened = threading.Event()
        if done:
            self.opened.set()
        self.error = error

    def synchronize(self) -> None:
        self.waited.set()
        self.opened.wait(timeout=10)
        if self.error is not None:
            raise self.error


class _Registry:
    """Stands for engine/pinned.py's registry: ordinary host tensors."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)


def _group():
    return pack_group(tensor_slots(nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in SHAPES)))


@pytest.fixture
def drain():
    drain = GradDrain([_group()], torch.device("cpu"), torch.float32, _Registry(), None, None, {})
    yield drain
    drain.close()
    assert not drain._worker.is_alive()


def _queue_slab(drain: GradDrain, present: list[bool], grads: list[torch.Tensor], done: _Done, device=()) -> bool:
    """What ``drain`` queues on its slab path, once the D2H has written ``grads`` packed into a slab."""
    idle = drain._count_in_flight(0)
    slab = drain._free_slabs.get()
    packed = torch.cat([g.reshape(-1) for g in grads])
    slab[: packed.numel()].copy_(packed)
    drain._pending.put(_Drain(0, present, device, slab, done))
    return idle


def test_add_packed_unpacks_the_present_grads_as_autograd_would():
    # an expert without tokens: its grad stays None, the others' offsets skip it (a slab is longer than the grads)
    group = _group()
    a, c = torch.randn(3, 4), torch.randn(2, 2)
    slab = torch.cat([a.reshape(-1), c.reshape(-1), torch.full((7,), float("nan"))])
    add_packed(group, [True, False, True], slab)
    assert torch.equal(group.params[0].grad, a) and group.params[1].grad is None
    assert torch.equal(group.params[2].grad, c)
    b = torch.randn(5)
    add_packed(group, [True, True, True], torch.cat([a.reshape(-1), b, c.reshape(-1)]))
    assert torch.equal(group.params[0].grad, 2 * a)
    assert torch.equal(group.params[1].grad, b)


def test_the_worker_adds_a_slab_and_returns_it(drain):
    group = drain.groups[0]
    grads = [torch.randn(*s) for s in SHAPES]
    assert _queue_slab(drain, [True, True, True], grads, _Done())  # none in flight before
    drain.wait_drained()
    assert all(torch.equal(p.grad, g) for p, g in zip(group.params, grads))
    assert drain._free_slabs.qsize() == 3 and drain._in_flight == {0: 0}
    assert drain.slab_nbytes == 3 * group.numel * 4


def test_a_first_arrival_is_attached_not_added(drain):
    # the D2H wrote the fp32 grads themselves: the worker only points p.grad at them once the copy is done
    group = drain.groups[0]
    group.grad.copy_(torch.arange(group.numel, dtype=torch.float32))
    drain._count_in_flight(0)
    drain._pending.put(_Drain(0, [True, False, True], (), None, _Done()))
    drain.wait_drained()
    views = group.views(group.grad)
    assert group.params[0].grad is not None and torch.equal(group.params[0].grad, views[0])
    assert group.params[1].grad is None and torch.equal(group.params[2].grad, views[2])
    assert drain._free_slabs.qsize() == 3


def test_a_drain_tells_its_landed_hook_once_the_grads_are_attached(drain):
    # the hook captured when the drain was issued ([Note: updates during backward]) is called by the worker after
    # the grads are in place, with the layer's index; a drain issued without one tells nobody
    group, told = drain.groups[0], []
    drain._count_in_flight(0)
    drain._pending.put(_Drain(0, [True] * 3, (), None, _Done(),
                              lambda index: told.append((index, all(p.grad is not None for p in group.params)))))
    drain._count_in_flight(0)
    drain._pending.put(_Drain(0, [True] * 3, (), None, _Done()))
    drain.wait_drained()
    assert told == [(0, True)]


def test_device_buffers_stay_referenced_until_the_copy_is_done(drain):
    # the structural invariant of [Note: gradient drain]: the allocator may not reuse what the D2H stream still reads
    packed = torch.randn(3)
    alive = weakref.ref(packed)
    done = _Done(done=False)
    assert _queue_slab(drain, [True, True, True], [torch.randn(*s) for s in SHAPES], done, device=(packed,))
    del packed
    assert done.waited.wait(timeout=10)
    assert alive() is not None and not drain._count_in_flight(0)  # the worker still owns layer 0's host grads
    with drain._lock:
        drain._in_flight[0] -= 1  # undo the probe's count
    done.opened.set()
    drain.wait_drained()
    assert alive() is None and drain._in_flight == {0: 0}


def test_a_worker_failure_surfaces_on_the_training_thread_once(drain):
    _queue_slab(drain, [True, True, True], [torch.randn(*s) for s in SHAPES], _Done(error=ValueError("boom")))
    with pytest.raises(RuntimeError, match="gradient drain worker failed") as raised:
        drain.wait_drained()
    assert isinstance(raised.value.__cause__, ValueError)
    assert drain._free_slabs.qsize() == 3 and drain._in_flight == {0: 0}  # the slab and the count came back
    drain.wait_drained()  # reported once

    _queue_slab(drain, [True, True, True], [torch.randn(*s) for s in SHAPES], _Done(error=ValueError("boom")))
    drain._pending.join()
    with pytest.raises(RuntimeError, match="gradient drain worker failed"):
        drain.drain(0, [None, None, None])  # the next layer's drain reports it before queueing anything
    drain.drain(0, [None, None, None])  # no grads: nothing to send


def test_the_slot_comes_back_once_the_copy_is_done_before_the_host_add(drain):
    # [Note: one drain on the device]: the next drain may pack once this one's D2H has completed; the host add
    # (here: the landed hook, called after it) does not hold the slot
    assert DEVICE_DRAINS == 1
    free_at_hook = []
    drain._device_slots.acquire()  # what drain() takes before it packs
    done = _Done(done=False)
    drain._count_in_flight(0)
    drain._pending.put(_Drain(0, [True] * 3, (torch.randn(3),), None, done,
                              lambda index: free_at_hook.append(_slot_is_free(drain)), holds_slot=True))
    assert done.waited.wait(timeout=10)
    assert not drain._device_slots.acquire(blocking=False)  # the copy is in flight: a second pack would wait
    done.opened.set()
    drain.wait_drained()
    assert free_at_hook == [True]
    assert _slot_is_free(drain)


def test_a_failed_copy_gives_its_slot_back(drain):
    drain._device_slots.acquire()
    drain._count_in_flight(0)
    drain._pending.put(_Drain(0, [True] * 3, (), None, _Done(error=ValueError("boom")), holds_slot=True))
    with pytest.raises(RuntimeError, match="gradient drain worker failed"):
        drain.wait_drained()
    assert _slot_is_free(drain)


def _slot_is_free(drain: GradDrain) -> bool:
    """Whether a drain could take a slot now (taken and given back at once)."""
    if not drain._device_slots.acquire(blocking=False):
        return False
    drain._device_slots.release()
    return True
