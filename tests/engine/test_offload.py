"""Activation offload (engine/offload.py), its stash pool: host buffers of offloaded layer inputs are reused, best
fit, freed only once their copies are done, and the host never waits for the device."""

from __future__ import annotations

import torch

from lightning_megatrain.engine.offload import StashPool


class _Event:
    """Stands for the CUDA event of a buffer's last copy: the pool only polls it."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _pool():
    made, freed = [], []

    def alloc(nbytes):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return StashPool(alloc, lambda buf: freed.append(buf.numel())), made, freed


def test_buffers_are_reused_with_the_event_of_their_last_restore():
    pool, made, _ = _pool()
    a, ev_a = pool.take(100)
    b, ev_b = pool.take(100)
    assert made == [100, 100] and ev_a is None and ev_b is None
    restored = _Event()  # handed to the next writer (the D2H stream waits for it), never waited on by the host
    pool.give(a, restored)
    pool.give(b, None)
    again, event = pool.take(100)
    assert made == [100, 100] and pool.nbytes == 200  # no new buffer: a micro-batch reuses the previous one's
    assert again.data_ptr() in (a.data_ptr(), b.data_ptr()) and event is (restored if again is a else None)


def test_smallest_fitting_buffer_is_taken():
    pool, made, _ = _pool()
    big, _ = pool.take(300)
    small, _ = pool.take(120)
    pool.give(big, None)
    pool.give(small, None)
    got, _ = pool.take(100)
    assert got is small and made == [300, 120] and pool.sizes() == [300]


def test_smaller_idle_buffers_retire_and_are_freed_once_their_copies_are_done():
    # the idle buffers served smaller micro-batches (a shorter last batch): they would never fit again
    pool, made, freed = _pool()
    first, second = pool.take(100), pool.take(100)
    pending, done = _Event(), _Event(done=True)
    pool.give(first[0], pending)
    pool.give(second[0], done)
    got, _ = pool.take(200)
    assert got.numel() == 200 and made == [100, 100, 200] and pool.sizes() == []
    assert freed == [100] and pool.nbytes == 300  # the copy still reading the other one is running: not freed
    pool.give(got, None)
    pending.done = True
    pool.take(200)  # polled again at the next take
    assert freed == [100, 100] and pool.nbytes == 200


def test_release_frees_every_idle_buffer_and_keeps_the_lent_ones():
    pool, _, freed = _pool()
    idle, _ = pool.take(100)
    pool.take(50)  # lent: a stash still holds it
    pool.give(idle, _Event())  # the caller synchronized the device before release: pending events count as done
    pool.release()
    assert freed == [100] and pool.nbytes == 50 and pool.sizes() == []


def test_a_dropped_stash_returns_its_buffer_with_its_last_copy_event():
    # a graph freed without backward (an exception, a training_step that returns None) drops its stashes unrestored:
    # their buffers come back to the pool, to be written again only after the last copy queued on them
    from lightning_megatrain.engine.offload import ActivationOffload, _Stashed

    offload = object.__new__(ActivationOffload)  # only the pool and the handle bookkeeping, no device
    offload.stash_pool, made, _ = _pool()
    buffer, _ = offload.stash_pool.take(100)
    offloaded, restored = _Event(), _Event()
    stashed = _Stashed(host=buffer.view(torch.float32), buffer=buffer, offloaded=offloaded)
    offload._return_if_dropped(stashed, offloaded)
    offload._return_if_dropped(stashed, restored)  # prefetch_stash queued the restore: it now reads the buffer last
    assert offload.stash_pool.sizes() == []
    del stashed
    again, event = offload.stash_pool.take(100)
    assert again is buffer and event is restored and made == [100]  # with the restore's event,
    assert offload.stash_pool.sizes() == []  # and once
