"""The residents' gradient drain (engine/residents.py) on CPU, with stand-ins for the CUDA stream and events: which
copy goes where, what waits for what, and when the host add runs. The real streams: test_gpu_residents_drain.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.host_store import pack_group
from lightning_megatrain.engine.optimizer_step import OptimizerStep
from lightning_megatrain.engine.residents import Residents


class _Stream:
    """A CUDA stream stand-in: counts its host syncs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.syncs = 0
        self.waited: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        assert event.recorded_on is not None, "waits for an event never recorded"
        self.waited.append(event)

    def synchronize(self) -> None:
        self.syncs += 1


class _Event:
    """A CUDA event stand-in (the CPU copies are synchronous, so it is always complete)."""

    made: list[_Event] = []

    def __init__(self) -> None:
        self.recorded_on: _Stream | None = None
        self.syncs = 0
        _Event.made.append(self)

    def record(self, stream: _Stream) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        assert self.recorded_on is not None
        self.syncs += 1

    def query(self) -> bool:
        return True


class _Three(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(5), requires_grad=not frozen)
        self.b = nn.Parameter(torch.randn(3, 4))
        self.c = nn.Parameter(torch.randn(7))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a.sum() * self.b @ x).square().sum() + (self.c * x.sum()).sum()


@contextlib.contextmanager
def _fake_cuda():
    compute, d2h = _Stream("compute"), _Stream("d2h")
    current = [compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    _Event.made = []
    with (
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: current[-1]),
        mock.patch.object(torch.cuda, "stream", stream),
        mock.patch.object(torch.cuda, "Event", _Event),
        mock.patch.object(torch.Tensor, "record_stream", lambda self, s: None),
    ):
        yield compute, d2h


def _residents(frozen: bool) -> tuple[_Three, _Three, Residents]:
    torch.manual_seed(0)
    module, reference = _Three(frozen), _Three(frozen)
    reference.load_state_dict(module.state_dict())
    group = pack_group(tensor_slots(module))
    registry = SimpleNamespace(empty=lambda numel, dtype: torch.full((numel,), float("nan"), dtype=dtype))
    return module, reference, Residents(group, [], torch.device("cpu"), registry, None)


def _backward(module: _Three, reference: _Three, residents: Residents, x: torch.Tensor) -> None:
    with residents.bound():
        loss = module.loss(x)
    loss.backward()
    reference.loss(x).backward()


def test_host_add_waits_for_no_stream_and_lands_later():
    with _fake_cuda() as (compute, d2h):
        module, reference, residents = _residents(frozen=True)
        residents.d2h_stream = d2h
        _backward(module, reference, residents, torch.randn(4))
        residents.drain(wait=False)
        assert compute.syncs == 0 and d2h.syncs == 0  # the old path synchronized the compute stream here
        packed, landed = _Event.made
        assert packed.recorded_on is compute and d2h.waited == [packed] and landed.recorded_on is d2h
        assert landed.syncs == 0 and residents._landed is landed  # in flight
        # into empty host grads the add is a copy: the device norm stands for them, clipping need not wait
        assert not residents.norm_after_landing
        expected = reference.b.grad.square().sum() + reference.c.grad.square().sum()
        torch.testing.assert_close(residents.group.device_norm_sq, expected)
        assert all(c.grad is None for c in residents._copies)  # cleared: the copy read the packed grads
        assert all(p.grad is None for p in (module.a, module.b, module.c))  # the add waits for wait_landed
        residents.wait_landed()
        assert landed.syncs == 1 and residents._landed is None
        torch.testing.assert_close(residents.group.grad_norm_sq(), expected)  # the landed grads' own norm
        residents.wait_landed()  # a no-op now
        assert landed.syncs == 1
    assert module.a.grad is None
    torch.testing.assert_close(module.b.grad, reference.b.grad)
    torch.testing.assert_close(module.c.grad, reference.c.grad)


def test_a_second_drain_lands_the_first_before_reusing_the_staging_buffer():
    with _fake_cuda() as (compute, d2h):
        module, reference, residents = _residents(frozen=True)
        residents.d2h_stream = d2h
        _backward(module, reference, residents, torch.randn(4))
        residents.drain(wait=False)
        first_landed = _Event.made[-1]
        _backward(module, reference, residents, torch.randn(4))
        residents.drain(wait=False)  # no landing between: the first add runs before the second copy
        assert first_landed.syncs == 1 and compute.syncs == 0
        assert residents.norm_after_landing  # host grads hold the first drain's: the second adds to them
        residents.wait_landed()
    assert module.a.grad is None
    torch.testing.assert_close(module.b.grad, reference.b.grad)
    torch.testing.assert_close(module.c.grad, reference.c.grad)


def test_exact_drain_attaches_and_wait_lands_at_once():
    with _fake_cuda() as (compute, d2h):
        module, reference, residents = _residents(frozen=False)
        residents.d2h_stream = d2h
        _backward(module, reference, residents, torch.randn(4))
        residents.drain(wait=True)
        assert compute.syncs == 0 and not residents.norm_after_landing
        assert residents.group.device_norm_sq is not None and _Event.made[-1].syncs == 1
        assert residents.group.grads_are_views()  # straight into the host grads, attached
        # a second one with host grads holding some: the host add, landed before drain returns
        _backward(module, reference, residents, torch.randn(4))
        residents.drain(wait=True)
        assert compute.syncs == 0 and residents.group.device_norm_sq is None and not residents.norm_after_landing
    for name in "abc":
        torch.testing.assert_close(getattr(module, name).grad, getattr(reference, name).grad)


def test_late_grads_land_a_residents_host_add_before_the_norm():
    # [Note: late grads]: the norm is read on the training thread before the worker lands the grads; a residents'
    # host add leaves no device norm, so finalize_gradients lands it at once (an exact copy stays in flight)
    for norm_after_landing in (True, False):
        residents = mock.Mock(norm_after_landing=norm_after_landing)
        overlap = SimpleNamespace(wait_all=mock.Mock())
        transfer = SimpleNamespace(take_host_added=lambda: False, wait_drained=mock.Mock())
        step = OptimizerStep(EngineConfig(), torch.device("cpu"), [], overlap, transfer, residents)
        step.finalize_gradients(grads_read=False)
        residents.drain.assert_called_once_with(wait=False)
        assert residents.wait_landed.call_count == int(norm_after_landing)
        transfer.wait_drained.assert_not_called()  # the layers' grads stay landing either way
