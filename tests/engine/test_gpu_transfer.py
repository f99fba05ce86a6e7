"""CUDA backend of the transfers: pinned host masters and grads, grads summed on the device, the page-locked buffers
of offloaded layer inputs, and GPU memory that does not grow with depth (two slots).

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_masters_pinned_on_host():
    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            for p in pl_module.parameters():
                assert p.device.type == "cpu" and p.dtype == torch.float32 and p.is_pinned()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads_pinned = all(p.grad.is_pinned() for p in pl_module.parameters())

    check = Check()
    module = ParityLM("llama_tied")
    fit_cuda(gpu_strategy(), lambda: module, steps=1, callbacks=[check])
    assert check.grads_pinned
    # teardown unregistered the page-locked regions; the parameters still hold their (now pageable) values
    assert not any(p.is_pinned() for p in module.parameters())
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_accumulated_grads_are_summed_on_the_device():
    # every micro-batch after the first adds into the host grads on the device: no slab, no host pass, and the
    # per-layer norms clipping reads stay on the device (see engine/drain.py, [Note: gradient drain])
    class Check(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            engine = trainer.strategy.engine
            self.norms_on_device = all(g.device_norm_sq is not None for g in engine.groups)

    check = Check()
    fit_cuda(gpu_strategy(cpu_adam="torch"), lambda: ParityLM("llama_untied"), accumulate=3, callbacks=[check])
    assert check.norms_on_device


def test_calibration_frees_its_exact_size_offload_buffers():
    # the calibrating micro-batch offloads every layer input into a page-locked buffer of exactly its size; once
    # calibrated they are unregistered and freed (engine/offload.py, trim_stash_cache)
    class Check(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:  # one fp32 residual stream [B, T, H] per layer
                self.input_bytes = batch.numel() * pl_module.model.config.hidden_size * 4
                self.layers = pl_module.model.config.num_hidden_layers
                self.regions = len(trainer.strategy.engine.registry._regions)

        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == 0:
                self.lent = trainer.strategy.engine.transfer.offload.stash_pool.nbytes

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                engine = trainer.strategy.engine
                self.after = engine.transfer.offload.stash_pool.nbytes, len(engine.registry._regions)

    check = Check()
    fit_cuda(gpu_strategy(), lambda: ParityLM("llama_tied"), steps=2, callbacks=[check])
    assert check.layers == 3 and check.lent == check.layers * check.input_bytes
    assert check.after == (0, check.regions)


def test_offloaded_inputs_reuse_one_micro_batch_of_pinned_buffers():
    # keep_layers=0 recomputes every layer: each micro-batch offloads every layer's input. However far the host runs
    # ahead of the GPU, the stash pool then holds exactly those buffers (engine/offload.py, [Note: activation
    # offload]); torch's caching host allocator kept several micro-batches'.
    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            self.sizes, self.layers = engine.transfer.offload.stash_pool.sizes(), len(engine.groups)
            self.nbytes = engine.transfer.offload.stash_pool.nbytes

    check = Check()
    fit_cuda(gpu_strategy(keep_layers=0), lambda: ParityLM("llama_tied"), steps=4, accumulate=2,
              callbacks=[check])
    assert check.layers == 3 and len(check.sizes) == check.layers and len(set(check.sizes)) == 1
    assert check.nbytes == sum(check.sizes)  # none lent, none retiring: one micro-batch's buffers


def test_gpu_memory_does_not_grow_with_depth():
    from transformers import AutoModelForCausalLM, LlamaConfig

    class Wide(ParityLM):
        def __init__(self, layers):
            L.LightningModule.__init__(self)
            self.optimizer_name, self.use_scheduler, self.lr = "sgd", False, None
            config = LlamaConfig(
                vocab_size=128, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=8, use_cache=False,
            )
            self.model = AutoModelForCausalLM.from_config(config)

    peaks = {}
    for layers in (4, 8):
        strategy = gpu_strategy(keep_layers=0)  # recompute every layer: the depth-independent mode
        _, peaks[layers] = fit_cuda(strategy, lambda: Wide(layers), steps=2, precision="bf16-mixed")
    plain = {}
    for layers in (4, 8):
        _, plain[layers] = fit_cuda("auto", lambda: Wide(layers), steps=2, precision="bf16-mixed")
    # 12.6M params/layer: plain training grows ~200 MB per 4 layers (weights, grads, Adam); ours holds 2 slots
    assert peaks[8] <= 1.10 * peaks[4], peaks
    assert plain[8] > 1.5 * plain[4], plain
