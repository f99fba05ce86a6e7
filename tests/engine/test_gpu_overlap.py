"""CUDA: the overlapped optimizer step (engine/overlap.py) and late grads (engine/optimizer_step.py, [Note: late
grads]) against plain GPU training.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_overlapped_optimizer_step_parity():
    # step N's host AdamW on the worker thread while step N+1's uploads wait per layer (engine/overlap.py)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0)
    strategy = gpu_strategy(cpu_adam="torch", overlap_optimizer=True)
    got, _ = fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0)
    assert_records_close(got, ref, rtol=1e-4)


# Nothing reads p.grad before the optimizer step: the last grads and the clip factor (computed on the device) land
# while the next step starts, and the host step's worker waits for them (engine/optimizer_step.py, [Note: late grads]).
# groups=0: the residents are a host group (their copy is awaited on the worker); 2: the device step reads the factor
# on the device, and the device groups' grads (summed over 2 micro-batches) and masters never cross to the host
# during training: their host grads stay None, their host masters are written back at the train-end barrier.
@pytest.mark.parametrize("groups", [0, 2])
def test_cuda_late_grads_parity(groups):
    from unittest import mock

    from lightning_megatrain.engine.optimizer_step import OptimizerStep

    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False)
    strategy = gpu_strategy(cpu_adam="torch", overlap_optimizer=True, gpu_optimizer_groups=groups)
    landed = mock.patch.object(OptimizerStep, "_landed_update", autospec=True,
                               side_effect=OptimizerStep._landed_update)

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):  # after the barrier: the deferred copies have landed
            engine = trainer.strategy.engine
            on_device = {id(p) for d in engine.device_groups for p in d.group.params}
            self.grads_landed = all((p.grad is None) == (id(p) in on_device) for p in pl_module.parameters())
            self.no_host_grads = all(d.group._grad is None for d in engine.device_groups)  # never allocated
            # the host memory report counts exactly the host groups' grads, and the pinned slabs
            sizes = trainer.strategy.host_memory()
            host_params = sum(p.numel() for p in pl_module.parameters() if id(p) not in on_device)
            self.grads_reported = sizes["grads"] == 4 * host_params and sizes["grad_slabs"] > 0
            self.mirrors_equal = all(torch.equal(d.master.cpu(), d.group.master) for d in engine.device_groups)

    check = Check()
    with landed as spy:
        got, _ = fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False,
                           callbacks=[check])
    assert spy.call_count == 3  # every step took the late path
    assert all(call.args[3] is not None for call in spy.call_args_list)  # with the device clip factor
    assert_records_close(got, ref, rtol=1e-4)
    assert check.grads_landed and check.mirrors_equal and check.no_host_grads and check.grads_reported
