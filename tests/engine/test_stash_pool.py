"""Stash pool: host buffers of offloaded layer inputs are reused, best fit, without the host waiting."""

from __future__ import annotations

import torch

from lightning_megatrain.engine.transfer import StashPool


def _pool():
    made = []

    def alloc(nbytes):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return StashPool(alloc), made


def test_buffers_are_reused_with_the_event_of_their_last_restore():
    pool, made = _pool()
    a, ev_a = pool.take(100)
    b, ev_b = pool.take(100)
    assert made == [100, 100] and ev_a is None and ev_b is None
    restored = object()  # stands for the restore's CUDA event: handed to the next writer, never waited on here
    pool.give(a, restored)
    pool.give(b, None)
    again, event = pool.take(100)
    assert made == [100, 100]  # no new buffer: a micro-batch reuses the previous one's
    assert again.data_ptr() in (a.data_ptr(), b.data_ptr()) and event is (restored if again is a else None)


def test_smallest_fitting_buffer_is_taken():
    pool, made = _pool()
    big, _ = pool.take(300)
    small, _ = pool.take(120)
    pool.give(big, None)
    pool.give(small, None)
    got, _ = pool.take(100)
    assert got is small and made == [300, 120] and pool.sizes() == [300]


def test_a_larger_request_releases_the_smaller_free_buffers():
    # the free buffers served smaller micro-batches (a shorter last batch): they would never fit again
    pool, made = _pool()
    for buf, _ in [pool.take(100), pool.take(100)]:
        pool.give(buf, None)
    got, _ = pool.take(200)
    assert got.numel() == 200 and made == [100, 100, 200] and pool.sizes() == []
    pool.give(got, None)
    pool.clear()
    assert pool.sizes() == []
