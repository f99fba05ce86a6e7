"""Activation offload: the CUDA backend moves saved layer inputs to pinned host memory and back.

The streamed Function (engine/streamed.py) stashes the inputs a recomputed layer needs through its transfer backend
(engine/transfer.py), whose CUDA half is an :class:`ActivationOffload` on the transfer's H2D and D2H streams.

[Note: activation offload]
The input a streamed layer saves for its recompute (the residual stream, B x T x H) would otherwise stay on the
GPU for every layer until backward, so GPU memory would grow with depth. ``stash(x)`` copies it to pinned host
memory on the D2H stream after an event on the compute stream; ``x.record_stream(d2h)`` keeps the caching
allocator from reusing x's memory before that copy has run. In backward, ``prefetch_stash`` (layer i-1 while
layer i recomputes) copies it back on the H2D stream into memory allocated on the compute stream; the H2D stream
first waits for the compute stream (the new block may still be read by queued compute kernels of its previous
tenant) and for the offload's event; ``unstash`` makes the compute stream wait for the restore. (Keeping the last
layer's input on the GPU instead, whose restore nothing hides, removed a 15 ms gap at the start of backward at 3B and
64K tokens but cost one more layer input of GPU memory: throughput stayed within noise, the auto policy kept one
layer fewer, and the planner's ready configs no longer fit. Reverted; benchmarks/HISTORY.md.)

The host buffers come from a :class:`StashPool`. ``unstash`` hands a buffer back as soon as its restore is *queued*,
with the restore's event; the next ``stash`` into it has the D2H stream wait for that event, so the device orders
the reuse and the host never waits. torch's caching host allocator, which these buffers came from before, reuses a
block only once the host has *seen* its copies complete, and the training thread runs steps ahead of the GPU: at
3B and 64K tokens per micro-batch it held 13 blocks of 1 GiB for 8 stashes a micro-batch (benchmarks/HISTORY.md,
host_steady_by_kind_gib). It also rounds every block up to a power of two: 1 GiB for the 768 MiB fp32
residual stream. The pool holds one micro-batch's stashes, page-locked at their exact size (engine/pinned.py), and
frees a buffer only once its last copy has completed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_megatrain.engine.pinned import HostRegistry


class StashPool:
    """Page-locked host buffers for offloaded layer inputs, of exactly the requested size, reused across micro-batches
    (see [Note: activation offload]).

    The pool owns every buffer it allocates until it frees it. A buffer is *lent* (a stash holds it), *idle* (with
    the event of the last copy that used it, ``None`` if none did) or *retiring* (idle but smaller than the current
    requests, freed as soon as its event has completed; polled, never waited for).
    """

    def __init__(self, alloc: Callable[[int], Tensor], free: Callable[[Tensor], None]) -> None:
        self._alloc = alloc  # [nbytes] uint8 page-locked host buffer
        self._free = free  # releases one; only called once no copy touches it
        self._idle: list[tuple[Tensor, torch.cuda.Event | None]] = []
        self._retiring: list[tuple[Tensor, torch.cuda.Event | None]] = []
        self.nbytes = 0  # every buffer the pool owns: lent, idle and retiring

    def take(self, nbytes: int) -> tuple[Tensor, torch.cuda.Event | None]:
        """The smallest idle buffer of at least ``nbytes`` and the event its next writer waits for; a new buffer
        when none fits (the idle ones, smaller, served smaller micro-batches: they retire)."""
        self._reap()
        fits = [k for k, (buf, _) in enumerate(self._idle) if buf.numel() >= nbytes]
        if fits:
            return self._idle.pop(min(fits, key=lambda k: self._idle[k][0].numel()))
        self._retiring += self._idle
        self._idle = []
        self._reap()  # before allocating: the host peaks lower
        buf = self._alloc(nbytes)
        self.nbytes += nbytes
        return buf, None

    def give(self, buf: Tensor, last_use: torch.cuda.Event | None) -> None:
        """Return a buffer whose last copy (already queued) records ``last_use``."""
        self._idle.append((buf, last_use))

    def release(self) -> None:
        """Free the idle and retiring buffers: the caller has synchronized the device (the lent ones return later)."""
        self._retiring += self._idle
        self._idle = []
        self._reap(done=True)

    def sizes(self) -> list[int]:
        """Bytes of each idle buffer."""
        return [buf.numel() for buf, _ in self._idle]

    def _reap(self, done: bool = False) -> None:
        """Free the retiring buffers whose last copy has completed (all of them with ``done``)."""
        keep = []
        for buf, event in self._retiring:
            if done or event is None or event.query():
                self._free(buf)
                self.nbytes -= buf.numel()
            else:
                keep.append((buf, event))
        self._retiring = keep



@dataclass
class _Stashed:
    """A saved layer input offloaded to pinned host memory (see [Note: activation offload])."""

    host: Tensor | None  # pinned host copy, same shape and dtype as the device input; None once restored
    buffer: Tensor | None  # the pool's [nbytes] uint8 buffer ``host`` views, returned to the pool on restore
    # - CUDA events for stream synchronization
    offloaded: torch.cuda.Event  # recorded by the D2H stream after the copy; waited on by the H2D stream on restore
    device: Tensor | None = None  # device copy once restored
    restored: torch.cuda.Event | None = None  # recorded by the H2D stream after restore; waited on by compute
    # returns ``buffer`` to the pool, with the event of its last queued copy, if this handle is dropped before
    # ``unstash`` (a graph freed without backward: an exception, a skipped step); detached by ``unstash``, which
    # returns the buffer itself
    returned: weakref.finalize | None = None


class ActivationOffload:
    """Offloads saved layer inputs on the D2H stream and restores them on the H2D stream (see
    [Note: activation offload]); both streams are the transfer's (engine/transfer.py)."""

    def __init__(
        self, device: torch.device, h2d_stream: torch.cuda.Stream, d2h_stream: torch.cuda.Stream, registry: HostRegistry
    ) -> None:
        self.device = device
        self.h2d_stream = h2d_stream  # restores queue behind the weight uploads
        self.d2h_stream = d2h_stream  # offloads queue beside the grad drains
        self.stash_pool = StashPool(lambda nbytes: registry.empty(nbytes, torch.uint8), registry.free)

    def stash(self, x: Tensor) -> _Stashed:
        """Offload a saved layer input to pinned host memory (see [Note: activation offload])."""
        compute = torch.cuda.current_stream(self.device)
        nbytes = x.numel() * x.element_size()
        buffer, last_read = self.stash_pool.take(nbytes)
        host = buffer[:nbytes].view(x.dtype).view(x.shape)
        produced = torch.cuda.Event()  # recorded by the compute stream after x's producer; waited on by the D2H stream
        produced.record(compute)
        offloaded = torch.cuda.Event()  # recorded by the D2H stream after the copy; waited on by the restore's H2D
        with torch.cuda.stream(self.d2h_stream), torch.profiler.record_function("megatrain::offload"):
            self.d2h_stream.wait_event(produced)
            if last_read is not None:
                self.d2h_stream.wait_event(last_read)  # the buffer's previous restore may still read it
            host.copy_(x, non_blocking=True)
            offloaded.record(self.d2h_stream)
        x.record_stream(self.d2h_stream)
        stashed = _Stashed(host, buffer, offloaded)
        self._return_if_dropped(stashed, offloaded)
        return stashed

    def _return_if_dropped(self, stashed: _Stashed, last_use: torch.cuda.Event) -> None:
        """Should ``stashed`` be dropped unrestored, its buffer goes back to the pool with its last copy's event."""
        if stashed.returned is not None:
            stashed.returned.detach()
        stashed.returned = weakref.finalize(stashed, self.stash_pool.give, stashed.buffer, last_use)

    def prefetch_stash(self, stashed: _Stashed | None) -> None:
        """Start copying an offloaded input back to the device (no-op if already there)."""
        if stashed is None or stashed.device is not None:
            return
        assert stashed.host is not None
        compute = torch.cuda.current_stream(self.device)
        stashed.device = torch.empty(stashed.host.shape, dtype=stashed.host.dtype, device=self.device)
        allocated = torch.cuda.Event()  # recorded by the compute stream; waited on by the H2D stream
        allocated.record(compute)
        stashed.restored = torch.cuda.Event()
        with torch.cuda.stream(self.h2d_stream), torch.profiler.record_function("megatrain::restore"):
            self.h2d_stream.wait_event(allocated)
            self.h2d_stream.wait_event(stashed.offloaded)
            stashed.device.copy_(stashed.host, non_blocking=True)
            stashed.restored.record(self.h2d_stream)
        self._return_if_dropped(stashed, stashed.restored)  # the restore now reads the buffer last

    def trim_stash_cache(self) -> None:
        """Return the stash pool's idle buffers to the OS once the auto recompute policy has calibrated (once per run).

        The calibrating micro-batch offloads every layer's input; later micro-batches keep most layers on the device
        and stash few inputs. Freed here, before the first optimizer step allocates the Adam states, they no longer
        add to the host RSS. The restores just queued still read them: hence one device synchronize first (once per
        run, not in the per-step path).
        """
        torch.cuda.synchronize(self.device)
        self.stash_pool.release()

    def unstash(self, stashed: _Stashed) -> Tensor:
        """The offloaded input on the device, ready for the compute stream."""
        self.prefetch_stash(stashed)
        assert stashed.device is not None and stashed.restored is not None and stashed.buffer is not None
        torch.cuda.current_stream(self.device).wait_event(stashed.restored)
        # its restore is queued: the next stash into the buffer waits for ``restored``
        assert stashed.returned is not None
        stashed.returned.detach()
        self.stash_pool.give(stashed.buffer, stashed.restored)
        stashed.host = stashed.buffer = None
        device, stashed.device = stashed.device, None  # the caller owns it now; the handle keeps no device memory
        return device
