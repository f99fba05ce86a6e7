"""CUDA: compact host state through the GPU paths: bf16 masters uploaded straight into the compute slots, bf16 grads
drained (first arrival, the device-side fp32 sum of accumulated micro-batches rounded once, the residents' copy),
late grads with the overlapped step, clipping inside the kernel; and device groups holding the compact layout on the
GPU (engine/device_state.py, [Note: compact device groups]).

References (tests/helpers/compact.py): ``bf16_loop`` on the GPU (the same model, same device kernels, bf16 masters
updated on the host as ``CompactAdamW.step`` updates them), and the engine's own CPU run (bitwise the CPU loop,
tests/strategy/test_strategy_compact_state.py), which differs by the CPU's and GPU's bf16 matmuls only.

Skipped without CUDA (CI); on the GPU machine: ``python -m pytest -m gpu tests/engine/test_gpu_compact_state.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.optim import compact_adam

from helpers.compact import bf16_loop, fit_engine, max_relative_error
from helpers.parity import ParityLM
from helpers.trainers import cpu_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTIONS = dict(cpu_adam="torch", compile_layers=False, gpu_optimizer_groups="auto")


@pytest.fixture(autouse=True)
def eager_kernel(monkeypatch):
    """The CPU reference and the engine run the same eager kernel (the compiled one is tested against it in
    tests/optim/test_compact_adam.py)."""
    monkeypatch.setattr(compact_adam, "_compile_failure", "eager in tests")


class Layout(L.Callback):
    """What the engine allocated, read before teardown."""

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        slot = engine.transfer.slots[0]
        self.slot = (slot.staging is slot.compute, slot.compute.dtype)
        self.grads = {(g.grad.dtype, g.grad.is_pinned()) for g in engine.flat_groups}
        self.device_groups = len(engine.device_groups)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("host_state", ["compact", "compact_kahan"])
def test_cuda_compact_state_matches_the_gpu_loop_and_the_cpu_run(host_state, overlap):
    """3 steps, 2 accumulated micro-batches, clipping at 0.05: no fp32 staging slot, pinned bf16 grads, no device
    groups ("auto" places none); the losses equal the GPU loop's to 1e-3 and the weights to about a bf16 unit (a
    last-bit difference of the clipping norm flips a few stochastic roundings, as on the CPU); against the CPU run
    the matmuls differ too, so 2% per tensor."""
    torch.backends.cuda.matmul.allow_tf32 = False
    layout = Layout()
    model, _, losses = fit_engine(host_state, accumulate=2, clip=0.05, overlap=overlap, accelerator="cuda",
                                  callbacks=[layout], **OPTIONS)
    assert layout.slot == (True, torch.bfloat16) and layout.grads == {(torch.bfloat16, True)}
    assert layout.device_groups == 0
    masters, ref_losses, _ = bf16_loop(host_state, accumulate=2, clip=0.05, device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    error, name = max_relative_error(model, masters)
    assert error < 2**-7, (name, error)

    cpu_model, _, cpu_losses = fit_engine(host_state, accumulate=2, clip=0.05, overlap=overlap)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-2, atol=0)
    error, name = max_relative_error(model, [p.detach() for p in cpu_model.parameters()])
    assert error < 2e-2, (name, error)


def test_cuda_int8_moments_match_the_cpu_run():
    """``int8_moments`` keeps fp32 masters and grads: the GPU paths are the fp32 ones, the step CompactAdamW's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, optimizer, losses = fit_engine("int8_moments", accumulate=2, clip=0.05, overlap=True, accelerator="cuda",
                                          **OPTIONS)
    cpu_model, _, cpu_losses = fit_engine("int8_moments", accumulate=2, clip=0.05, overlap=True)
    assert optimizer.state[next(model.parameters())]["exp_avg"].dtype == torch.int8
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-2, atol=0)
    error, name = max_relative_error(model, [p.detach() for p in cpu_model.parameters()])
    assert error < 2e-2, (name, error)


class DeviceLayout(L.Callback):
    """The device groups' state as the run left it, read before teardown."""

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        optimizer = trainer.optimizers[0]
        self.groups = len(engine.device_groups)
        params = [p for d in engine.device_groups for p in d.group.params]
        self.states = {(k, v.dtype, v.device.type) for p in params for k, v in optimizer.state[p].items()}
        self.host_grad_bytes = sum(d.group.grad_nbytes for d in engine.device_groups)
        self.mirror = {(d.master.dtype, d.compute is d.master) for d in engine.device_groups[1:]}


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("host_state", ["compact", "compact_kahan"])
def test_cuda_compact_device_groups_match_the_gpu_loop(host_state, groups):
    """``gpu_optimizer_groups`` with a compact host_state: the residents and the first layers hold bf16 mirrors
    (the compute copies themselves), bf16 grad sums and CompactAdamW's 8-bit entries on the GPU (the step count on the
    CPU), the host keeps no grads for them; 3 steps, 2 micro-batches, clipping at 0.05, the overlapped host step: the
    same bounds against the GPU loop as without device groups (the GPU's fp32 arithmetic flips a few stochastic
    roundings)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    layout = DeviceLayout()
    model, _, losses = fit_engine(host_state, accumulate=2, clip=0.05, overlap=True, accelerator="cuda",
                                  callbacks=[layout], **{**OPTIONS, "gpu_optimizer_groups": groups})
    assert layout.groups == groups and layout.mirror == {(torch.bfloat16, True)}
    assert layout.host_grad_bytes == 0
    expected = {("step", torch.float32, "cpu"), ("exp_avg", torch.int8, "cuda"), ("exp_avg_sq", torch.uint8, "cuda"),
                ("exp_avg_scale", torch.float32, "cuda"), ("exp_avg_sq_scale", torch.float32, "cuda")}
    if host_state == "compact_kahan":
        expected.add(("compensation", torch.bfloat16, "cuda"))
    assert layout.states == expected
    masters, ref_losses, _ = bf16_loop(host_state, accumulate=2, clip=0.05, device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    error, name = max_relative_error(model, masters)
    assert error < 2**-7, (name, error)


@pytest.mark.parametrize("groups", [2, 3])
def test_cuda_int8_moments_device_groups_match_the_cpu_run(groups):
    """``int8_moments`` device groups: fp32 mirrors with a separate bf16 compute copy, fp32 grad sums and
    CompactAdamW's 8-bit entries on the GPU (the step count on the CPU), no host grads for them; the same bounds
    against the CPU run as the host-stepped GPU run (``test_cuda_int8_moments_match_the_cpu_run``)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    layout = DeviceLayout()
    model, _, losses = fit_engine("int8_moments", accumulate=2, clip=0.05, overlap=True, accelerator="cuda",
                                  callbacks=[layout], **{**OPTIONS, "gpu_optimizer_groups": groups})
    assert layout.groups == groups and layout.mirror == {(torch.float32, False)}
    assert layout.host_grad_bytes == 0
    assert layout.states == {("step", torch.float32, "cpu"), ("exp_avg", torch.int8, "cuda"),
                             ("exp_avg_sq", torch.uint8, "cuda"), ("exp_avg_scale", torch.float32, "cuda"),
                             ("exp_avg_sq_scale", torch.float32, "cuda")}
    cpu_model, _, cpu_losses = fit_engine("int8_moments", accumulate=2, clip=0.05, overlap=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-2, atol=0)
    error, name = max_relative_error(model, [p.detach() for p in cpu_model.parameters()])
    assert error < 2e-2, (name, error)


def _fit_one_batch(root, steps, groups, ckpt_path=None, checkpoint=False):
    """``steps`` steps of ParityLM("qwen3") on its one batch (a resumed run sees what the uninterrupted one does),
    ``compact`` state with ``groups`` device groups, the overlapped step, clipping at 0.05."""
    L.seed_everything(0, verbose=False)
    module = ParityLM("qwen3")
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)] if checkpoint else []
    strategy = MegaTrainStrategy(host_state="compact", **{**OPTIONS, "gpu_optimizer_groups": groups})
    trainer = cpu_trainer(strategy=strategy, accelerator="cuda", max_steps=steps, default_root_dir=root,
                          limit_train_batches=1, precision="bf16-mixed", gradient_clip_val=0.05,
                          enable_checkpointing=checkpoint, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]  # by position: insertion order varies
    state = {k: {key: v.cpu() for key, v in optimizer.state[p].items()} for k, p in enumerate(params)}
    return [p.detach().cpu() for p in module.parameters()], state


def test_cuda_compact_device_groups_resume_bit_for_bit(tmp_path):
    """2 steps with 3 compact device groups, a Lightning checkpoint, 2 more from it: weights, 8-bit moments, scales
    and step counts equal the uninterrupted 4 steps' bit for bit; the same checkpoint resumed with every group on the
    host (``gpu_optimizer_groups=0``) trains on, its states on the CPU, its weights within the GPU-versus-CPU kernel
    difference of the uninterrupted run's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    full, full_state = _fit_one_batch(tmp_path / "full", 4, 3)
    _fit_one_batch(tmp_path / "resumed", 2, 3, checkpoint=True)
    last = str(tmp_path / "resumed" / "last.ckpt")
    resumed, resumed_state = _fit_one_batch(tmp_path / "resumed", 4, 3, ckpt_path=last)
    for k, (a, b) in enumerate(zip(full, resumed)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), k
    assert full_state.keys() == resumed_state.keys()
    for k, state in full_state.items():
        assert state.keys() == resumed_state[k].keys()
        for key, value in state.items():
            assert torch.equal(value, resumed_state[k][key]), (k, key)
        assert int(state["step"]) == 4
    on_host, host_state = _fit_one_batch(tmp_path / "host", 4, 0, ckpt_path=last)
    assert all(int(s["step"]) == 4 for s in host_state.values())
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(on_host, full)]
    assert max(errors) < 2**-7, max(errors)


def test_cuda_auto_splits_a_compact_state_the_host_cannot_hold(monkeypatch):
    """``gpu_optimizer_groups="auto"`` with host_state="compact" and the host's free memory mocked to 2 bytes per
    parameter (the grads and 8-bit moments still to come take 4.03) and the split's spare host memory (1 GiB, more
    than this model) set to 0: the engine moves the first groups to the GPU, no more than it must, and trains as the
    GPU loop does, to the bounds above."""
    from lightning_megatrain.engine import host_budget
    from lightning_megatrain.planner import pool

    torch.backends.cuda.matmul.allow_tf32 = False
    n_params = sum(p.numel() for p in ParityLM("qwen3").parameters())
    monkeypatch.setattr(host_budget, "placeable_host_bytes", lambda: (2 * n_params, "mocked"))
    monkeypatch.setattr(pool, "SPLIT_HOST_MARGIN_GIB", 0.0)
    layout = DeviceLayout()
    model, _, losses = fit_engine("compact", accumulate=2, clip=0.05, overlap=True, accelerator="cuda",
                                  callbacks=[layout], **OPTIONS)
    assert 0 < layout.groups < len(list(model.model.layers)) + 1
    assert layout.host_grad_bytes == 0 and ("exp_avg", torch.int8, "cuda") in layout.states
    masters, ref_losses, _ = bf16_loop("compact", accumulate=2, clip=0.05, device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    error, name = max_relative_error(model, masters)
    assert error < 2**-7, (name, error)
