"""MegaTrainStrategy's errors: invalid arguments, a model it cannot stream, too little host RAM or GPU memory and a
torch.compile that cannot build, each refused before training starts (what several ranks refuse:
tests/engine/test_sharding.py)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import host_store

from helpers.parity import ParityLM, assert_records_close, run
from helpers.trainers import cpu_trainer


def test_invalid_arguments_listed_together():
    with pytest.raises(ValueError, match=r"num_slots=1(.|\n)*keep_layers=-1(.|\n)*cpu_adam='gpu'"):
        MegaTrainStrategy(num_slots=1, keep_layers=-1, cpu_adam="gpu")
    with pytest.raises(ValueError, match=r"keep_layers='all'"):
        MegaTrainStrategy(keep_layers="all")
    with pytest.raises(ValueError, match=r"compile_layers='yes': need 'auto', True or False"):
        MegaTrainStrategy(compile_layers="yes")
    with pytest.raises(
        ValueError, match=r"layers=3: need a dotted path(.|\n)*overlap_optimizer='yes': need 'auto', True"
    ):
        MegaTrainStrategy(layers=3, overlap_optimizer="yes")
    for memo in (-1, 2.0, "yes"):  # an int >= 0 names the last layers that keep memos
        with pytest.raises(ValueError, match=r"attention_memo=.*: need 'auto', True, False or an int >= 0"):
            MegaTrainStrategy(attention_memo=memo)
    assert [MegaTrainStrategy(attention_memo=m).config.memo_layers(4) for m in (True, False, "auto", 0, 3, 9)] == [
        4, 0, 0, 0, 3, 4]


def test_no_layer_stack_error():
    class Flat(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match=r"found no decoder-layer stack(.|\n)*MegaTrainStrategy\(layers="):
        cpu_trainer(strategy="megatrain").fit(Flat(), DataLoader(torch.randn(4, 4)))


def test_explicit_layers_path_and_bad_path():
    module = ParityLM("llama_tied")
    with pytest.raises(ValueError, match=r"layers='model.nope'\) does not name"):
        cpu_trainer(strategy=MegaTrainStrategy(layers="model.nope")).fit(module)
    ref = run("auto", "llama_tied", steps=1)
    got = run(MegaTrainStrategy(layers="model.model.layers", cpu_adam="torch"), "llama_tied", steps=1)
    assert_records_close(got, ref)


def test_manual_placement_error():
    from lightning_megatrain.engine import MegaTrainEngine

    module = ParityLM("llama_tied")
    placed = SimpleNamespace(device=torch.device("cuda", 0))  # what a .cuda() call leaves (no GPU needed)
    buffers = module.named_buffers
    module.named_buffers = lambda *a, **k: [*buffers(*a, **k), ("model.model.placed", placed)]
    with pytest.raises(ValueError, match=r"'model.model.placed' is on cuda:0(.|\n)*remove manual placement"):
        MegaTrainEngine(module, torch.device("cpu"), torch.float32).setup(fitting=True)


def test_meta_parameter_error_is_the_one_raised():
    # a parameter never materialized: the engine's error names it, and Lightning's teardown (which moves the module
    # to the CPU, impossible for meta tensors) does not replace it
    module = ParityLM("llama_tied")
    up = module.model.model.layers[1].mlp.up_proj
    up.weight = nn.Parameter(torch.empty(up.weight.shape, device="meta"))
    with pytest.raises(ValueError, match=r"'model.model.layers.1.mlp.up_proj.weight' is on the meta device, never "
                                         r"materialized(.|\n)*HINT: load or initialize its weights") as info:
        cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch")).fit(module)
    assert type(info.value) is ValueError


def test_dtype_change_after_setup_is_refused_with_the_parameter_named():
    class Double(ParityLM):
        def on_train_start(self):
            self.double()  # after setup packed the fp32 masters

    with pytest.raises(RuntimeError, match=r"'model.model.layers.0.self_attn.q_proj.weight' is now float64 on cpu, "
                                           r"(.|\n)*\(and 27 more\)(.|\n)*`\.double\(\)`(.|\n)*HINT"):
        cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch")).fit(Double("llama_tied"))


def test_an_error_in_user_code_is_not_replaced_by_a_failed_overlapped_step(monkeypatch, caplog):
    # the overlapped step fails on its worker, then a callback raises before anything waited for the step: the
    # callback's error is the one raised; the step's is logged by the barrier's on_exception and teardown
    from lightning_megatrain.optim.host_optimizer import HostUpdate

    def kernel_fault(self, params):
        raise RuntimeError("kernel fault")

    class UserBug(L.Callback):
        megatrain_reads_state = False  # no wait before it: the step's error is still pending

        def on_train_batch_end(self, *args):
            raise ValueError("user bug")

    monkeypatch.setattr(HostUpdate, "__call__", kernel_fault)
    with pytest.raises(ValueError, match="user bug"):
        cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch", overlap_optimizer=True), max_steps=2,
                    callbacks=[UserBug()]).fit(ParityLM("llama_tied"))
    assert "overlapped host optimizer step failed (StepFailed: MegaTrain: optimizer step 0 failed before" in caplog.text


def test_too_little_host_ram_error():
    with mock.patch.object(host_store, "placeable_host_bytes", return_value=(1024, "MemAvailable")):
        with pytest.raises(RuntimeError, match=r"needs about .* MiB more host RAM(.|\n)*\(MemAvailable\)"):
            cpu_trainer(strategy="megatrain").fit(ParityLM("llama_tied"))


def test_too_little_host_ram_for_the_optimizer_states_error():
    # masters and grads fit (4 B/param more than the model already loaded), AdamW's 8 B/param of states do not: refused
    # once configure_optimizers ran, before any step
    module = ParityLM("llama_tied")
    n = sum(p.numel() for p in module.parameters())
    with mock.patch.object(host_store, "placeable_host_bytes", return_value=(6 * n, "MemAvailable")):
        with pytest.raises(RuntimeError, match=r"needs about .* MiB more host RAM for the grads and optimizer "
                                               r"states of the first step(.|\n)*\(MemAvailable\)"):
            cpu_trainer(strategy="megatrain").fit(module)


def test_too_little_gpu_memory_error():
    from lightning_megatrain.engine import MegaTrainEngine

    engine = MegaTrainEngine(nn.Linear(1, 1), torch.device("cuda", 0), torch.bfloat16)
    with mock.patch.object(torch.cuda, "mem_get_info", return_value=(2 * 1024**3, 80 * 1024**3)):
        with pytest.raises(RuntimeError, match=r"one decoder layer must fit on the GPU"):
            engine._check_gpu_memory(max_layer=1_000_000_000, n_resident=0, device_numel=[])
        engine._check_gpu_memory(max_layer=10_000_000, n_resident=50_000_000, device_numel=[])  # 0.6 GiB: fits
        # the same plus the residents' moments (8 B/param) and 10 layers' device state (18 B/param): 2.2 GB more
        with pytest.raises(RuntimeError, match=r"2.6 GiB .* 11 groups with their optimizer on the GPU"):
            engine._check_gpu_memory(
                max_layer=10_000_000, n_resident=50_000_000, device_numel=[50_000_000] + [10_000_000] * 10
            )


def test_too_little_gpu_memory_counts_the_buffers_of_several_ranks():
    """With several ranks a layer's fp32 gather buffer and its padded grad reduce-scatter (N x the largest share
    each) come on top: 540 MB fit in 580, 620 MB do not."""
    from lightning_megatrain.engine import MegaTrainEngine
    from lightning_megatrain.engine.collectives import Ranks

    sizes = dict(max_layer=10_000_000, n_resident=50_000_000, device_numel=[])
    with mock.patch.object(torch.cuda, "mem_get_info", return_value=(580 * 10**6, 80 * 1024**3)):
        MegaTrainEngine(nn.Linear(1, 1), torch.device("cuda", 0), torch.bfloat16)._check_gpu_memory(**sizes)
        ranked = MegaTrainEngine(nn.Linear(1, 1), torch.device("cuda", 0), torch.bfloat16, ranks=Ranks(0, 2))
        with pytest.raises(RuntimeError, match=r"needs 0\.6 GiB of GPU memory"):
            ranked._check_gpu_memory(**sizes)


def test_gpu_optimizer_groups_validated_up_front():
    with pytest.raises(ValueError, match=r"gpu_optimizer_groups=-1: need 'auto' or an int >= 0"):
        MegaTrainStrategy(gpu_optimizer_groups=-1)
    with pytest.raises(ValueError, match=r"keeps optimizer states on a CUDA device, but the compute device is cpu"):
        cpu_trainer(strategy=MegaTrainStrategy(gpu_optimizer_groups=1)).fit(ParityLM("llama_tied"))
    with pytest.raises(ValueError, match=r"clips by norm only"):
        trainer = cpu_trainer(strategy=MegaTrainStrategy(gpu_optimizer_groups=1), gradient_clip_val=1.0,
                           gradient_clip_algorithm="value")
        trainer.fit(ParityLM("llama_tied"))


def test_compile_layers_without_a_working_torch_compile_fails_at_setup():
    # checked before the parameters are packed into host flats: a 100B model would otherwise fail in its first step
    from torch._inductor.exc import InvalidCxxCompiler

    from lightning_megatrain.engine import compiled

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise InvalidCxxCompiler()

        return run

    module = ParityLM("llama_tied")
    storage = [p.data_ptr() for p in module.parameters()]  # packing moves every parameter into a host flat
    with mock.patch.object(compiled.torch, "compile", broken_compile):
        with pytest.raises(RuntimeError, match=r"cannot build CPU kernels here \(InvalidCxxCompiler\)(.|\n)*HINT"):
            cpu_trainer(strategy=MegaTrainStrategy(compile_layers=True)).fit(module)
    assert [p.data_ptr() for p in module.parameters()] == storage  # refused before packing
    with mock.patch("torch.utils._triton.has_triton", lambda: False):
        with pytest.raises(RuntimeError, match=r"needs Triton for torch.compile on CUDA"):
            compiled.check_compilable(torch.device("cuda", 0))
