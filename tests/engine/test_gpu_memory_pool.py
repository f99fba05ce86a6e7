"""CUDA: both memories as one pool (planner/pool.py, [Note: memory pool]): with the host's free memory mocked too
small for every group's state, ``gpu_optimizer_groups="auto"`` keeps the state of the first groups on the GPU, the
host allocates grads for the rest only, and training matches plain GPU training.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests/engine/test_gpu_memory_pool.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_megatrain.engine import host_budget

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class _Check(L.Callback):
    def on_train_end(self, trainer, pl_module):  # after the barrier: host masters hold the last update
        engine = trainer.strategy.engine
        forward = [engine.resident_group, *engine.groups]
        self.n_device = len(engine.device_groups)
        self.n_groups = len(forward)
        self.grad_bytes = [g.grad_nbytes for g in forward]
        self.numels = [g.numel for g in forward]
        self.mirrors_equal = all(torch.equal(d.master.cpu(), d.group.master) for d in engine.device_groups)


@pytest.mark.parametrize(("record_grads", "overlap"), [(False, False), (True, True)])
def test_auto_splits_the_state_when_the_host_is_short(monkeypatch, record_grads, overlap):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=record_grads)
    n_params = sum(p.numel() for p in ParityLM("llama_untied").parameters())
    # half the grads and Adam moments of every group (12 B/param) fit the host: auto must move groups to the GPU
    monkeypatch.setattr(host_budget, "placeable_host_bytes", lambda: (6 * n_params, "mocked"))
    check = _Check()
    strategy = gpu_strategy(cpu_adam="torch", gpu_optimizer_groups="auto", overlap_optimizer=overlap)
    got, _ = fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, callbacks=[check],
                      record_grads=record_grads)
    assert_records_close(got, ref, rtol=1e-4)
    assert 0 < check.n_device < check.n_groups and check.mirrors_equal
    host = range(check.n_device, check.n_groups)
    assert 12 * sum(check.numels[k] for k in host) <= 6 * n_params  # what the host was said to hold
    # host grads: every host group's; the device groups' only where a hook reads p.grad (record_grads)
    assert [check.grad_bytes[k] for k in host] == [4 * check.numels[k] for k in host]
    assert all((b == 4 * n) if record_grads else b == 0
               for b, n in zip(check.grad_bytes[: check.n_device], check.numels))

