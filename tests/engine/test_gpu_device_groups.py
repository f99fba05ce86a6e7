"""CUDA backend: slots, H2D/D2H streams, pinned slabs and resident copies against plain GPU training.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.parity import ParityLM, assert_records_close, run

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import engine as engine_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _strategy(**options) -> MegaTrainStrategy:
    """One mechanism at a time: the "auto" choices (compiled layers, overlapped step, device groups) off unless a
    test names them; ``test_cuda_defaults_parity`` runs the defaults."""
    return MegaTrainStrategy(**{"compile_layers": False, "overlap_optimizer": False, "gpu_optimizer_groups": 0, **options})


def _fit_cuda(strategy, module_factory, **kwargs):
    """``parity.run`` on the GPU: the record and the peak allocated GPU memory."""
    torch.cuda.reset_peak_memory_stats()
    record = run(strategy, None, accelerator="cuda", module=module_factory, **kwargs)
    return record, torch.cuda.max_memory_allocated()


# keep "auto": the first micro-batch recomputes every layer, later ones keep all graphs (tiny models fit); 0: every
# layer recomputed in every step; 1: layer 0 kept, the rest recomputed.
@pytest.mark.parametrize(
    ("family", "accumulate", "clip", "keep"),
    [
        ("llama_tied", 1, None, "auto"),
        ("llama_untied", 2, 1.0, "auto"),
        ("llama_untied", 2, 1.0, 0),
        ("gemma2", 1, 1.0, 1),
        ("mixtral", 1, None, "auto"),
        ("mixtral", 2, 1.0, 0),  # experts without tokens take the slab path, the rest the device-side sum
        ("gpt_oss", 1, None, 0),
    ],
)
def test_cuda_fp32_parity(family, accumulate, clip, keep):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = _fit_cuda("auto", lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    strategy = _strategy(cpu_adam="torch", keep_layers=keep)
    got, _ = _fit_cuda(strategy, lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    # CUDA kernels may pick other reduction orders for the host-bound recompute: 1e-4 instead of CPU's 1e-5
    assert_records_close(got, ref, rtol=1e-4)


@pytest.mark.parametrize("groups", [None, 2])
def test_cuda_defaults_parity(groups, monkeypatch, caplog):
    torch._dynamo.reset()
    # MegaTrainStrategy() on CUDA: compiled layers, the overlapped step, device groups decided before the first
    # training micro-batch (after the sanity validation ran on the engine without them); None: the planner's own
    # choice for the tiny model, 2: forced, so that the late placement path runs
    torch.backends.cuda.matmul.allow_tf32 = False
    if groups is not None:
        monkeypatch.setattr(engine_module, "choose_gpu_optimizer_groups", lambda *a, **k: (groups, "forced by the test"))
    ref, _ = _fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0)

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            config = trainer.strategy.engine.config
            self.choices = (config.compile_layers, config.overlap_optimizer, config.gpu_optimizer_groups)

    check = Check()
    with caplog.at_level("INFO", logger="lightning_megatrain"):
        got, _ = _fit_cuda(MegaTrainStrategy(cpu_adam="torch"), lambda: ParityLM("llama_untied"), accumulate=2,
                           clip=1.0, callbacks=[check])
    assert check.choices[:2] == (True, True) and (groups is None or check.choices[2] == groups)
    assert all(f"{k}=" in caplog.text for k in ("compile_layers", "overlap_optimizer", "gpu_optimizer_groups"))
    assert_records_close(got, ref, rtol=1e-4, rtol_updated=1e-3)  # compiled layers: as test_cuda_compiled_layers_parity


def test_cuda_overlapped_optimizer_step_parity():
    # step N's host AdamW on the worker thread while step N+1's uploads wait per layer (engine/overlap.py)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = _fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0)
    strategy = _strategy(cpu_adam="torch", overlap_optimizer=True)
    got, _ = _fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0)
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
    ref, _ = _fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False)
    strategy = _strategy(cpu_adam="torch", overlap_optimizer=True, gpu_optimizer_groups=groups)
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
        got, _ = _fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False,
                           callbacks=[check])
    assert spy.call_count == 3  # every step took the late path
    assert all(call.args[3] is not None for call in spy.call_args_list)  # with the device clip factor
    assert_records_close(got, ref, rtol=1e-4)
    assert check.grads_landed and check.mirrors_equal and check.no_host_grads and check.grads_reported


# Device groups without the overlap and with nothing reading p.grad (no on_before_optimizer_step): their grads are
# summed on the GPU over 2 micro-batches and never copied to the host, the synchronous clip path reads their device
# norms, and their masters reach the host at the train-end barrier (engine/device_state.py).
def test_cuda_device_groups_keep_unread_grads_without_overlap():
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = _fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False)

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            on_device = {id(p) for d in engine.device_groups for p in d.group.params}
            self.grads_stayed = all((p.grad is None) == (id(p) in on_device) for p in pl_module.parameters())
            self.mirrors_equal = all(torch.equal(d.master.cpu(), d.group.master) for d in engine.device_groups)

    check = Check()
    strategy = _strategy(cpu_adam="torch", gpu_optimizer_groups=3)
    got, _ = _fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False,
                       callbacks=[check])
    assert_records_close(got, ref, rtol=1e-4)
    assert check.grads_stayed and check.mirrors_equal


def test_cuda_masters_pinned_on_host():
    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            for p in pl_module.parameters():
                assert p.device.type == "cpu" and p.dtype == torch.float32 and p.is_pinned()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads_pinned = all(p.grad.is_pinned() for p in pl_module.parameters())

    check = Check()
    module = ParityLM("llama_tied")
    _fit_cuda(_strategy(), lambda: module, steps=1, callbacks=[check])
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
    _fit_cuda(_strategy(cpu_adam="torch"), lambda: ParityLM("llama_untied"), accumulate=3, callbacks=[check])
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
    _fit_cuda(_strategy(), lambda: ParityLM("llama_tied"), steps=2, callbacks=[check])
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
    _fit_cuda(_strategy(keep_layers=0), lambda: ParityLM("llama_tied"), steps=4, accumulate=2,
              callbacks=[check])
    assert check.layers == 3 and len(check.sizes) == check.layers and len(set(check.sizes)) == 1
    assert check.nbytes == sum(check.sizes)  # none lent, none retiring: one micro-batch's buffers


def test_auto_policy_keeps_every_layer_of_a_small_model_after_calibrating():
    class Check(L.Callback):
        def __init__(self):
            self.kept = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            streamed = trainer.strategy.engine.streamed
            self.kept.append((streamed.policy.calibrating, sorted(streamed.kept)))

    check = Check()
    module = ParityLM("llama_tied")
    layers = module.model.config.num_hidden_layers
    _fit_cuda(_strategy(), lambda: module, steps=3, callbacks=[check])
    assert check.kept[0] == (False, [])  # step 1: calibrated while recomputing every layer
    assert check.kept[1:] == [(False, list(range(layers)))] * 2


# bf16 compute is not bitwise anywhere: the losses of 5 steps track plain bf16 training. DeepSpeedCPUAdam overlapped
# with the next forward; the throughput configuration (device groups, compiled layers) likewise.
@pytest.mark.parametrize(
    "options",
    [dict(overlap_optimizer=True, cpu_adam="deepspeed"),
     dict(overlap_optimizer=True, gpu_optimizer_groups=2, compile_layers=True)],
)
def test_cuda_bf16_tracks_plain_bf16(options):
    ref, _ = _fit_cuda("auto", lambda: ParityLM("qwen3"), precision="bf16-mixed", steps=5)
    strategy = _strategy(**options)
    got, _ = _fit_cuda(strategy, lambda: ParityLM("qwen3"), precision="bf16-mixed", steps=5)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=2e-2, atol=0)


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
        strategy = _strategy(keep_layers=0)  # recompute every layer: the depth-independent mode
        _, peaks[layers] = _fit_cuda(strategy, lambda: Wide(layers), steps=2, precision="bf16-mixed")
    plain = {}
    for layers in (4, 8):
        _, plain[layers] = _fit_cuda("auto", lambda: Wide(layers), steps=2, precision="bf16-mixed")
    # 12.6M params/layer: plain training grows ~200 MB per 4 layers (weights, grads, Adam); ours holds 2 slots
    assert peaks[8] <= 1.10 * peaks[4], peaks
    assert plain[8] > 1.5 * plain[4], plain


def test_causal_lm_module_validates_on_the_gpu(tmp_path):
    # CausalLMModule's torchmetrics MeanMetric states must follow the loss to the GPU (the module stays on the host)
    from lightning_megatrain.models import CausalLMModule

    config = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    module = CausalLMModule(config=config)
    data = torch.utils.data.DataLoader([{"input_ids": torch.randint(3, 128, (16,))} for _ in range(8)], batch_size=2)
    class Check(L.Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.device = pl_module.val_loss_mean.device  # Lightning's teardown moves the module to the CPU after

    check = Check()
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy="megatrain", max_steps=2, limit_val_batches=2,
                        val_check_interval=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, callbacks=[check])
    trainer.fit(module, data, data)
    assert check.device.type == "cuda"
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


# gpu_optimizer_groups (engine/device_state.py): the residents and the first layers step on the GPU, the rest on
# the host; 2 = residents + layer 0; 4 = every group of a 3-layer model; mixtral's experts without tokens keep
# grad=None through the device sum.
@pytest.mark.parametrize(
    ("family", "groups", "accumulate", "clip", "overlap"),
    [
        ("llama_untied", 2, 2, 1.0, False),
        ("llama_tied", 4, 1, 1.0, True),
        ("llama_untied", 3, 2, None, True),
        ("mixtral", 3, 2, 1.0, False),
    ],
)
def test_gpu_optimizer_groups_parity(family, groups, accumulate, clip, overlap):
    torch.backends.cuda.matmul.allow_tf32 = False

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):  # after the barrier: host masters hold the last update
            engine = trainer.strategy.engine
            optimizer = trainer.optimizers[0]
            on_gpu = {id(p) for d in engine.device_groups for p in d.group.params}
            self.placement = {
                (id(p) in on_gpu, optimizer.state[p]["exp_avg"].device.type)
                for p in pl_module.parameters()
                if p in optimizer.state
            }
            self.mirrors_equal = all(torch.equal(d.master.cpu(), d.group.master) for d in engine.device_groups)
            self.n_device = len(engine.device_groups)

    check = Check()
    ref, _ = _fit_cuda("auto", lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    strategy = _strategy(cpu_adam="torch", gpu_optimizer_groups=groups, overlap_optimizer=overlap)
    got, _ = _fit_cuda(strategy, lambda: ParityLM(family), accumulate=accumulate, clip=clip, callbacks=[check])
    assert_records_close(got, ref, rtol=1e-4)
    assert check.n_device == groups
    # every group of the 3-layer llama_tied is on the GPU at groups=4; the others keep some on the host
    assert check.placement == ({(True, "cuda"), (False, "cpu")} if groups < 4 else {(True, "cuda")})
    assert check.mirrors_equal


# compile_layers (engine/streamed.py, [Note: compiled layers]) on the GPU, kept and recomputed layers, with and
# without device groups: inductor reorders fp32 arithmetic, so 1e-4 on the first step and 1e-3 after (a wrong
# mask or a missed grad is ~1e-1).
@pytest.mark.parametrize(
    ("family", "keep", "groups", "accumulate", "clip"),
    [("llama_untied", 1, 2, 2, 1.0), ("mixtral", "auto", 0, 1, None)],
)
def test_cuda_compiled_layers_parity(family, keep, groups, accumulate, clip):
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = _fit_cuda("auto", lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    torch._dynamo.reset()
    counters.clear()
    strategy = _strategy(cpu_adam="torch", keep_layers=keep, gpu_optimizer_groups=groups, compile_layers=True)
    got, _ = _fit_cuda(strategy, lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    assert counters["stats"]["unique_graphs"] >= 2
    assert_records_close(got, ref, rtol=1e-4, rtol_updated=1e-3)


def test_gpu_optimizer_groups_resume_exactly(tmp_path):
    """Save after 2 steps with states on the GPU, resume to 4: the checkpoint holds CPU tensors, the restored masters,
    device mirrors and Adam states equal it bit for bit, and the resumed run matches the same resume with every
    state on the host (gpu_optimizer_groups=0; the dataloader restarts its epoch in both)."""

    def fit(groups, steps, root, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        module = ParityLM("qwen3")  # no dropout: Lightning checkpoints do not restore RNG states
        trainer = L.Trainer(
            accelerator="cuda", devices=1, strategy=_strategy(cpu_adam="torch", gpu_optimizer_groups=groups),
            max_steps=steps, gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root, callbacks=list(callbacks),
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        return module

    class CheckRestored(L.Callback):
        def __init__(self, saved):
            self.saved = saved

        def on_train_start(self, trainer, pl_module):
            for name, p in pl_module.named_parameters():
                torch.testing.assert_close(p, self.saved["state_dict"][name], rtol=0, atol=0, msg=name)
            for d in trainer.strategy.engine.device_groups:
                assert torch.equal(d.master.cpu(), d.group.master)
            saved = self.saved["optimizer_states"][0]["state"]
            for k, state in trainer.optimizers[0].state_dict()["state"].items():
                torch.testing.assert_close(state["exp_avg_sq"], saved[k]["exp_avg_sq"], rtol=0, atol=0)
            self.checked = True

    torch.backends.cuda.matmul.allow_tf32 = False
    fit(2, 2, tmp_path, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    tensors = [t for s in saved["optimizer_states"][0]["state"].values() for t in s.values()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    check = CheckRestored(saved)
    resumed = fit(2, 4, tmp_path / "on_gpu", ckpt_path=str(tmp_path / "last.ckpt"), callbacks=[check])
    assert check.checked
    on_host = fit(0, 4, tmp_path / "on_host", ckpt_path=str(tmp_path / "last.ckpt"))
    for (name, a), b in zip(resumed.named_parameters(), on_host.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_gpu_optimizer_groups_refuse_other_optimizers():
    with pytest.raises(ValueError, match="gpu_optimizer_groups=1. steps Adam/AdamW on the GPU, got SGD"):
        _fit_cuda(_strategy(gpu_optimizer_groups=1), lambda: ParityLM("llama_tied", optimizer="sgd"))
