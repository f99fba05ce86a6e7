"""CUDA: ``gpu_optimizer_groups`` (engine/device_state.py), the groups whose Adam states and fp32 mirrors live on the
GPU, against plain GPU training: parity, grads kept on the device, resume, and the optimizers refused.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import multiprocessing

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.host_ram import MEASURABLE, Wide, save_and_resume_on_gpu
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# Device groups without the overlap and with nothing reading p.grad (no on_before_optimizer_step): their grads are
# summed on the GPU over 2 micro-batches and never copied to the host, the synchronous clip path reads their device
# norms, and their masters reach the host at the train-end barrier (engine/device_state.py).
def test_cuda_device_groups_keep_unread_grads_without_overlap():
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False)

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            on_device = {id(p) for d in engine.device_groups for p in d.group.params}
            self.grads_stayed = all((p.grad is None) == (id(p) in on_device) for p in pl_module.parameters())
            self.mirrors_equal = all(torch.equal(d.master.cpu(), d.group.master) for d in engine.device_groups)

    check = Check()
    strategy = gpu_strategy(cpu_adam="torch", gpu_optimizer_groups=3)
    got, _ = fit_cuda(strategy, lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0, record_grads=False,
                       callbacks=[check])
    assert_records_close(got, ref, rtol=1e-4)
    assert check.grads_stayed and check.mirrors_equal


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
    ref, _ = fit_cuda("auto", lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    strategy = gpu_strategy(cpu_adam="torch", gpu_optimizer_groups=groups, overlap_optimizer=overlap)
    got, _ = fit_cuda(strategy, lambda: ParityLM(family), accumulate=accumulate, clip=clip, callbacks=[check])
    assert_records_close(got, ref, rtol=1e-4)
    assert check.n_device == groups
    # every group of the 3-layer llama_tied is on the GPU at groups=4; the others keep some on the host
    assert check.placement == ({(True, "cuda"), (False, "cpu")} if groups < 4 else {(True, "cuda")})
    assert check.mirrors_equal


def test_gpu_optimizer_groups_resume_exactly(tmp_path):
    """Save after 2 steps with states on the GPU, resume to 4: Lightning's own checkpoint IO loads the checkpoint
    onto the host (its map_location keeps every storage where torch.load restores it: on the CPU), the restored
    masters, device mirrors and Adam states (on the GPU from the restore on) equal it bit for bit, and the resumed
    run matches the same resume with every state on the host (gpu_optimizer_groups=0; the dataloader restarts its
    epoch in both)."""

    def fit(groups, steps, root, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        module = ParityLM("qwen3")  # no dropout: Lightning checkpoints do not restore RNG states
        trainer = L.Trainer(
            accelerator="cuda", devices=1, strategy=gpu_strategy(cpu_adam="torch", gpu_optimizer_groups=groups),
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
                torch.testing.assert_close(state["exp_avg_sq"].cpu(), saved[k]["exp_avg_sq"], rtol=0, atol=0)
            self.checked = True

    torch.backends.cuda.matmul.allow_tf32 = False
    fit(2, 2, tmp_path, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    saved = TorchCheckpointIO().load_checkpoint(tmp_path / "last.ckpt", weights_only=False)
    tensors = [t for s in saved["optimizer_states"][0]["state"].values() for t in s.values()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    check = CheckRestored(saved)
    resumed = fit(2, 4, tmp_path / "on_gpu", ckpt_path=str(tmp_path / "last.ckpt"), callbacks=[check])
    assert check.checked
    on_host = fit(0, 4, tmp_path / "on_host", ckpt_path=str(tmp_path / "last.ckpt"))
    for (name, a), b in zip(resumed.named_parameters(), on_host.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.skipif(not MEASURABLE, reason="needs Linux's /proc/self/clear_refs and glibc")
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_gpu_optimizer_groups_checkpoints_hold_no_host_copy_of_their_states(tmp_path, fmt):
    """Every group's Adam states on the GPU (``Wide(2048, 8)``: 34.6M parameters, 264 MiB of moments, the largest
    group's moment 16 MiB): the save adds one storage's host copy at a time (file: torch.save copies each device
    storage to the host as it writes it) or one 16 MiB staging buffer (sharded), not the 264 MiB the copy of every
    state took; the resume reads them from the mapped checkpoint straight into the GPU moments, a chunk at a time,
    and the host keeps none of them ([Note: mapped checkpoint tensors]). The restored moments equal the saved ones
    bit for bit. In a spawned child whose large allocations the RSS sees exactly."""
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    child = spawn.Process(target=save_and_resume_on_gpu, args=(str(tmp_path), fmt, send))
    child.start()
    saved, loaded, kept, same, on_device = receive.recv()
    child.join()
    assert child.exitcode == 0
    moments = 8 * sum(p.numel() for p in Wide(2048, 8).parameters())
    print(f"{fmt}: save +{saved / 2**20:.1f} MiB, load +{loaded / 2**20:.1f} MiB (kept {kept / 2**20:.1f}), "
          f"moments {moments / 2**20:.0f} MiB")
    assert same and on_device
    assert saved < 40 * 2**20 < moments / 6, (saved, moments)  # one 16 MiB storage or staging buffer at a time
    assert loaded < 40 * 2**20, (loaded, kept)  # a chunk and the driver's staging, no state on the host


# [Note: device states at teardown]: Lightning's teardown copies every optimizer state to the host; the device
# groups' moments stay on the GPU where the host has less free than they take (here: 1 byte), and the trainer still
# saves them after fit. With the host's real free memory they move, as Lightning moves any strategy's.
@pytest.mark.parametrize("host_short", [True, False])
def test_device_states_stay_on_the_gpu_after_fit_when_the_host_cannot_take_them(tmp_path, monkeypatch, host_short):
    import lightning_megatrain.strategy as strategy_module

    if host_short:
        monkeypatch.setattr(strategy_module, "placeable_host_bytes", lambda: (1, "test"))

    class Keep(L.Callback):
        def on_train_end(self, trainer, pl_module):
            Keep.trainer = trainer
            on_gpu = {id(p) for d in trainer.strategy.engine.device_groups for p in d.group.params}
            Keep.device_params = [p for p in pl_module.parameters() if id(p) in on_gpu]

    fit_cuda(gpu_strategy(cpu_adam="torch", gpu_optimizer_groups=3), lambda: ParityLM("llama_untied"),
             callbacks=[Keep()], record_grads=False)
    state = Keep.trainer.optimizers[0].state
    devices = {state[p][k].device.type for p in Keep.device_params for k in ("exp_avg", "exp_avg_sq")}
    assert Keep.device_params and devices == ({"cuda"} if host_short else {"cpu"})
    expected = {id(p): state[p]["exp_avg"].cpu() for p in Keep.device_params}
    Keep.trainer.save_checkpoint(tmp_path / "after-fit.ckpt")
    saved = torch.load(tmp_path / "after-fit.ckpt", map_location="cpu", weights_only=False)["optimizer_states"][0]
    order = [p for g in Keep.trainer.optimizers[0].param_groups for p in g["params"]]
    for k, p in enumerate(order):
        if id(p) in expected:
            assert torch.equal(saved["state"][k]["exp_avg"], expected[id(p)])


def test_gpu_optimizer_groups_refuse_other_optimizers():
    with pytest.raises(ValueError, match="gpu_optimizer_groups=1. steps Adam/AdamW on the GPU, got SGD"):
        fit_cuda(gpu_strategy(gpu_optimizer_groups=1), lambda: ParityLM("llama_tied", optimizer="sgd"))
