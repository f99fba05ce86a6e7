"""CUDA: the residents' gradient drain (engine/residents.py, ``Residents.drain``) when it lands through a host add (a
resident without a grad: frozen input embeddings), against plain GPU training, and without a host-device sync.

That path used to copy into the pinned staging buffer on the compute stream and synchronize the compute stream
before the host add; the copy now runs on the D2H stream and the add waits for it in ``Residents.wait_landed``.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import contextlib
import threading
from unittest import mock

import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class FrozenEmbeddingsLM(ParityLM):
    """``llama_untied`` (its lm_head its own weight) with the input embeddings frozen: a resident without a grad, so
    the residents' drain takes the host-add path every step."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__("llama_untied")
        if frozen:
            self.model.get_input_embeddings().weight.requires_grad_(False)


@contextlib.contextmanager
def drain_log():
    """Record every ``Residents.drain`` call: its ``wait``, whether it took the host-add path (a grad missing or host
    grads held), and
    the host-device synchronizations the thread running it made inside it (other threads' are not counted: the
    layer drains' worker and the overlapped step's worker synchronize their own events meanwhile).

    Why this fails on the old code: its host-add path ended in ``compute.synchronize()``, where ``compute`` was
    ``torch.cuda.current_stream(device)``, a ``torch.cuda.Stream``, whose ``synchronize`` is the method patched here
    (at the class, so every instance's call is counted): one ``stream`` sync per host-add drain, whatever ``wait``.
    """
    from lightning_megatrain.engine.residents import Residents

    calls: list[dict] = []
    local = threading.local()
    drain = Residents.drain

    def logged_drain(self, wait: bool = True) -> None:
        # the host-add path: some grad missing (a frozen parameter) or host grads held already; read before the call,
        # as drain decides (the device norm no longer tells: it stands for an add into empty host grads)
        copies = self._copies or []
        host_add = any(c.grad is None for c in copies) or any(p.grad is not None for p in self.group.params)
        local.counts = counts = {"stream": 0, "event": 0, "device": 0}
        try:
            drain(self, wait)
        finally:
            local.counts = None
        calls.append({"wait": wait, "host_add": host_add, **counts})

    def counting(kind, original):
        def wrapper(*args, **kwargs):
            counts = getattr(local, "counts", None)
            if counts is not None:
                counts[kind] += 1
            return original(*args, **kwargs)

        return wrapper

    with (
        mock.patch.object(Residents, "drain", logged_drain),
        mock.patch.object(torch.cuda.Stream, "synchronize", counting("stream", torch.cuda.Stream.synchronize)),
        mock.patch.object(torch.cuda.Event, "synchronize", counting("event", torch.cuda.Event.synchronize)),
        mock.patch.object(torch.cuda, "synchronize", counting("device", torch.cuda.synchronize)),
    ):
        yield calls


def assert_drains_async(calls: list[dict], host_add: bool, wait: bool) -> None:
    assert calls, "the residents were never drained"
    assert all(c["host_add"] == host_add for c in calls), calls
    assert all(c["wait"] == wait for c in calls), calls
    # no stream or device sync in any drain; with wait=False not even the landed event's (the copy stays in flight)
    assert all(c["stream"] == 0 and c["device"] == 0 for c in calls), calls
    if not wait:
        assert all(c["event"] == 0 for c in calls), calls


# record_grads: the recorder's on_before_optimizer_step reads p.grad, so the drain lands its grads at once
# (wait=True), and the recorded grads (the frozen embedding's None included) are compared too.
@pytest.mark.parametrize("accumulate", [1, 2])
def test_cuda_frozen_embeddings_parity(accumulate):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", FrozenEmbeddingsLM, accumulate=accumulate, clip=1.0)
    with drain_log() as calls:
        got, _ = fit_cuda(gpu_strategy(cpu_adam="torch"), FrozenEmbeddingsLM, accumulate=accumulate, clip=1.0)
    assert_records_close(got, ref, rtol=1e-4)
    (embeddings,) = [n for n in got.params if n.endswith("embed_tokens.weight")]
    assert all(g[embeddings] is None for g in got.grads)
    assert_drains_async(calls, host_add=True, wait=True)


def test_cuda_accumulated_residents_parity():
    # the control: every resident has a grad, so the drain goes straight into the host grads (no host add)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", lambda: FrozenEmbeddingsLM(frozen=False), accumulate=2, clip=1.0)
    with drain_log() as calls:
        got, _ = fit_cuda(gpu_strategy(cpu_adam="torch"), lambda: FrozenEmbeddingsLM(frozen=False), accumulate=2,
                          clip=1.0)
    assert_records_close(got, ref, rtol=1e-4)
    assert_drains_async(calls, host_add=False, wait=True)


# Late grads (engine/optimizer_step.py, [Note: late grads]): nothing reads p.grad before the overlapped step, so the
# drain leaves its copy in flight (wait=False). Its host add leaves no device norm, so gradient finalization lands it
# before clipping takes the global norm: checked by comparing the norm clipping used with the landed grads' (AdamW
# barely sees a wrong clip factor, so the weights alone would not show it).
@pytest.mark.parametrize("accumulate", [1, 2])
def test_cuda_frozen_embeddings_late_grads(accumulate):
    from lightning_megatrain.engine.optimizer_step import OptimizerStep

    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", FrozenEmbeddingsLM, accumulate=accumulate, clip=1.0, record_grads=False)
    clip = OptimizerStep.clip_grad_norm_
    norms: list[tuple[float, float]] = []

    def checked_clip(self, params, max_norm, defer=False):
        late = self._late_grads
        out = clip(self, params, max_norm, defer)
        if late:
            used = float(self._norm_sq)
            self.transfer.wait_drained()  # the layers' grads still landing (the check's wait only)
            self.residents.wait_landed()
            assert all(p.grad is None for p in self.residents.group.params if not p.requires_grad)
            norms.append((used, sum(float(p.grad.double().square().sum())
                                    for g in self.groups for p in g.params if p.grad is not None)))
        return out

    strategy = gpu_strategy(cpu_adam="torch", overlap_optimizer=True)
    with drain_log() as calls, mock.patch.object(OptimizerStep, "clip_grad_norm_", checked_clip):
        got, _ = fit_cuda(strategy, FrozenEmbeddingsLM, accumulate=accumulate, clip=1.0, record_grads=False)
    assert_records_close(got, ref, rtol=1e-4)
    assert_drains_async(calls, host_add=True, wait=False)
    assert len(norms) == len(calls), (norms, calls)  # every step clipped with its grads left landing
    for used, landed in norms:
        assert used == pytest.approx(landed, rel=1e-4)


class _Three(torch.nn.Module):
    """Three resident parameters: ``a`` frozen, ``b`` and ``c`` trained."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(3, 4))
        self.c = torch.nn.Parameter(torch.randn(7))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a.sum() * self.b @ x).square().sum() + (self.c * x.sum()).sum()


def test_cuda_residents_host_add_is_deferred_and_never_overwritten():
    # Residents directly: a drain with a frozen parameter leaves its copy in flight behind a busy compute stream
    # (wait=False returns before the GPU got there), and a second drain before any landing lands the first one's
    # host add before its own copy may overwrite the staging buffer; the grads end up summed, as autograd sums them.
    from lightning_megatrain.engine.discovery import tensor_slots
    from lightning_megatrain.engine.host_store import pack_group
    from lightning_megatrain.engine.pinned import HostRegistry
    from lightning_megatrain.engine.residents import Residents

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    module = _Three()
    reference = _Three()
    reference.load_state_dict(module.state_dict())
    registry = HostRegistry()
    group = pack_group(tensor_slots(module), registry)
    residents = Residents(group, [], device, registry, torch.cuda.Stream(device))
    xs = [torch.randn(4), torch.randn(4)]
    try:
        for k, x in enumerate(xs):
            with residents.bound():
                loss = module.loss(x.to(device))
            loss.backward()
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the drain's copy
            with drain_log() as calls:
                residents.drain(wait=False)
            assert calls[0]["host_add"] and calls[0]["stream"] == calls[0]["device"] == 0
            # the first drain did not wait at all; the second landed the first (its event: that one sync) only
            assert calls[0]["event"] == k
            assert residents._landed is not None and not residents._landed.query()  # in flight behind the sleep
            # the first lands into empty host grads (its device norm stands), the second adds onto the first's
            assert residents.norm_after_landing == (k == 1)
            assert all(c.grad is None for c in residents._copies)  # cleared at once: the copy reads ``present``
            reference.loss(x).backward()
        residents.wait_landed()
        assert residents._landed is None
        assert module.a.grad is None
        torch.testing.assert_close(module.b.grad, reference.b.grad, rtol=1e-5, atol=1e-6)  # GPU vs CPU kernels
        torch.testing.assert_close(module.c.grad, reference.c.grad, rtol=1e-5, atol=1e-6)
    finally:
        torch.cuda.synchronize(device)
        registry.release()
