"""The Lightning contract of MegaTrainStrategy: registration, placement, precision mapping, errors, checkpoints."""

from __future__ import annotations

import re
import textwrap
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from helpers.parity import ParityLM, assert_records_close, make_data, run
from torch import nn
from torch.utils.data import DataLoader

import lightning_megatrain
from lightning_megatrain import MegaTrainPrecision, MegaTrainStrategy
from lightning_megatrain.engine import host_store


def _trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_registered_by_name_and_instance():
    assert "megatrain" in StrategyRegistry
    assert isinstance(_trainer(strategy="megatrain").strategy, MegaTrainStrategy)
    strategy = MegaTrainStrategy(num_slots=3)
    assert _trainer(strategy=strategy).strategy is strategy


def test_root_device_follows_parallel_devices():
    strategy = MegaTrainStrategy()
    assert strategy.root_device == torch.device("cpu")
    strategy.parallel_devices = [torch.device("cuda", 0)]
    assert strategy.root_device == torch.device("cuda", 0)


def test_metrics_follow_the_compute_device():
    # the module stays on the host, but torchmetrics states must meet the step's outputs on the compute device
    # (CausalLMModule's validation on the GPU crashed without this); "meta" stands in for the GPU here
    from lightning_megatrain.models import CausalLMModule

    module = CausalLMModule(config=dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32))
    module.configure_model()
    strategy = MegaTrainStrategy()
    strategy.parallel_devices = [torch.device("meta")]
    strategy.connect(module)
    strategy.model_to_device()
    assert module.val_loss_mean.device.type == "meta" and module.test_loss_mean.device.type == "meta"
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_lightning_cli_class_path(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            """
            trainer:
              accelerator: cpu
              strategy:
                class_path: lightning_megatrain.MegaTrainStrategy
                init_args:
                  num_slots: 3
                  keep_layers: 2
                  cpu_adam: torch
            model:
              family: llama_tied
            """
        )
    )
    cli = LightningCLI(ParityLM, run=False, args=["--config", str(config)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, MegaTrainStrategy)
    config = cli.trainer.strategy.config  # the options' one home (lightning_megatrain/config.py)
    assert config.num_slots == 3 and config.cpu_adam == "torch" and config.keep_layers == 2


@pytest.mark.parametrize(
    ("flag", "expected"), [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-mixed")]
)
def test_precision_mapping(flag, expected):
    if flag == "bf16-true":
        with pytest.warns(UserWarning, match="runs as 'bf16-mixed'"):
            trainer = _trainer(strategy="megatrain", precision=flag)
    else:
        trainer = _trainer(strategy="megatrain", precision=flag)
    assert isinstance(trainer.strategy.precision_plugin, MegaTrainPrecision)
    assert trainer.strategy.precision_plugin.precision == expected


def test_unsupported_precision_is_refused():
    with pytest.raises(TypeError, match="supports precision='bf16-mixed', '32-true'"):
        _trainer(strategy="megatrain", precision="64-true")
    with pytest.raises(ValueError, match="is not supported"):
        MegaTrainPrecision("16-mixed")


def test_precision_without_the_strategy_is_refused():
    # the plugin translates Lightning's hooks into engine calls: the engine comes from MegaTrainStrategy's setup only
    with pytest.raises(RuntimeError, match=r"MegaTrainPrecision has no engine(.|\n)*strategy='megatrain'"):
        MegaTrainPrecision("32-true", "cpu").engine
    trainer = _trainer(strategy="auto", plugins=[MegaTrainPrecision("32-true", "cpu")])
    with pytest.raises(RuntimeError, match=r"works only under MegaTrainStrategy"):
        trainer.fit(ParityLM("llama_tied"))


def test_invalid_arguments_listed_together():
    with pytest.raises(ValueError, match=r"num_slots=1(.|\n)*keep_layers=-1(.|\n)*cpu_adam='gpu'"):
        MegaTrainStrategy(num_slots=1, keep_layers=-1, cpu_adam="gpu")
    with pytest.raises(ValueError, match=r"keep_layers='all'"):
        MegaTrainStrategy(keep_layers="all")
    with pytest.raises(ValueError, match=r"compile_layers='yes': need 'auto', True or False"):
        MegaTrainStrategy(compile_layers="yes")
    with pytest.raises(ValueError, match=r"layers=3: need a dotted path(.|\n)*overlap_optimizer='yes': need 'auto', True"):
        MegaTrainStrategy(layers=3, overlap_optimizer="yes")


def test_arguments_become_one_engine_config():
    # the strategy's keyword arguments are EngineConfig's fields (config.py); the engine gets that object, with no
    # gpu_optimizer_groups outside fitting (no optimizer step to hold states for)
    from lightning_megatrain.config import EngineConfig

    strategy = MegaTrainStrategy(num_slots=3, keep_layers=1, gpu_optimizer_groups=1, cpu_adam="torch")
    assert strategy.config == EngineConfig(num_slots=3, keep_layers=1, gpu_optimizer_groups=1, cpu_adam="torch")

    class Check(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            self.config = trainer.strategy.engine.config

    class WithVal(ParityLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    check = Check()
    _trainer(strategy=strategy, callbacks=[check]).validate(WithVal("llama_tied"), DataLoader(make_data()[:2]))
    # a CPU device refuses 1 when fitting; the "auto" options resolved for a CPU compute device
    assert check.config == strategy.config.replace(gpu_optimizer_groups=0, overlap_optimizer=False, compile_layers=False)


def test_host_residency_after_setup():
    module = ParityLM("llama_untied")

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            layers = pl_module.model.model.layers
            for p in pl_module.parameters():
                assert p.device.type == "cpu" and p.dtype == torch.float32
            for layer in layers:  # one flat host buffer per layer
                storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
                assert len(storages) == 1
            self.checked = True

    check = Check()
    _trainer(strategy=MegaTrainStrategy(cpu_adam="torch"), callbacks=[check]).fit(module)
    assert check.checked
    assert "forward" not in module.model.model.layers[0].__dict__  # teardown restored the layers' own forward


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
        _trainer(strategy="megatrain").fit(Flat(), DataLoader(torch.randn(4, 4)))


def test_explicit_layers_path_and_bad_path():
    module = ParityLM("llama_tied")
    with pytest.raises(ValueError, match=r"layers='model.nope'\) does not name"):
        _trainer(strategy=MegaTrainStrategy(layers="model.nope")).fit(module)
    ref = run("auto", "llama_tied", steps=1)
    got = run(MegaTrainStrategy(layers="model.model.layers", cpu_adam="torch"), "llama_tied", steps=1)
    assert_records_close(got, ref)


def test_manual_placement_error():
    from lightning_megatrain.engine import MegaTrainEngine

    module = ParityLM("llama_tied")
    module.model.model.register_buffer("placed", torch.zeros(1, device="meta"))  # stands in for a .cuda() call
    with pytest.raises(ValueError, match=r"'model.model.placed' is on meta(.|\n)*remove manual placement"):
        MegaTrainEngine(module, torch.device("cpu"), torch.float32).setup(fitting=True)


def test_too_little_host_ram_error():
    with mock.patch.object(host_store, "available_host_bytes", return_value=1024):
        with pytest.raises(RuntimeError, match=r"needs about .* GiB more host RAM"):
            _trainer(strategy="megatrain").fit(ParityLM("llama_tied"))


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


def test_gpu_optimizer_groups_validated_up_front():
    with pytest.raises(ValueError, match=r"gpu_optimizer_groups=-1: need 'auto' or an int >= 0"):
        MegaTrainStrategy(gpu_optimizer_groups=-1)
    with pytest.raises(ValueError, match=r"keeps optimizer states on a CUDA device, but the compute device is cpu"):
        _trainer(strategy=MegaTrainStrategy(gpu_optimizer_groups=1)).fit(ParityLM("llama_tied"))
    with pytest.raises(ValueError, match=r"clips by norm only"):
        trainer = _trainer(strategy=MegaTrainStrategy(gpu_optimizer_groups=1), gradient_clip_val=1.0,
                           gradient_clip_algorithm="value")
        trainer.fit(ParityLM("llama_tied"))

def test_more_than_one_device_refused():
    strategy = MegaTrainStrategy()
    trainer = _trainer(strategy=strategy)
    strategy.parallel_devices = [torch.device("cpu"), torch.device("cpu")]
    with pytest.raises(ValueError, match=r"trains on one device(.|\n)*devices=1"):
        trainer.fit(ParityLM("llama_tied"))


def test_validation_matches_plain(tmp_path):
    class WithVal(ParityLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def val_dataloader(self):
            return DataLoader(make_data()[:4], batch_size=2)

    results = []
    for strategy in ("auto", MegaTrainStrategy(cpu_adam="torch")):
        L.seed_everything(0)
        trainer = _trainer(strategy=strategy, max_steps=2, val_check_interval=2)
        trainer.fit(WithVal("qwen3"))
        results.append(float(trainer.callback_metrics["val_loss"]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=0)


def test_checkpoint_resume_restores_exactly_and_matches_plain(tmp_path):
    """Save after 2 steps, resume to 4: the restored masters and Adam states equal the checkpoint bit for bit, the
    states stay on the host, and the resumed run matches plain Lightning's resumed run."""

    def fit(strategy, root, steps, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        module = ParityLM("qwen3")  # no dropout: Lightning checkpoints do not restore RNG states
        trainer = _trainer(
            strategy=strategy,
            max_steps=steps,
            default_root_dir=root,
            enable_checkpointing=True,
            callbacks=list(callbacks),
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        return module

    class CheckRestored(L.Callback):
        def __init__(self, ckpt):
            self.ckpt = torch.load(ckpt, weights_only=False)

        def on_train_start(self, trainer, pl_module):
            for name, p in pl_module.named_parameters():
                torch.testing.assert_close(p, self.ckpt["state_dict"][name], rtol=0, atol=0, msg=name)
            saved = self.ckpt["optimizer_states"][0]["state"]
            for k, state in trainer.optimizers[0].state_dict()["state"].items():
                assert state["exp_avg"].device.type == "cpu"
                torch.testing.assert_close(state["exp_avg_sq"], saved[k]["exp_avg_sq"], rtol=0, atol=0)
            self.checked = True

    finals = []
    for i, strategy in enumerate(("auto", MegaTrainStrategy(cpu_adam="torch"))):
        root = tmp_path / str(i)
        fit(strategy, root, 2, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)])
        check = CheckRestored(root / "last.ckpt")
        strategy = "auto" if i == 0 else MegaTrainStrategy(cpu_adam="torch")
        finals.append(fit(strategy, root, 4, ckpt_path=str(root / "last.ckpt"), callbacks=[check]))
        assert check.checked
    # fused host AdamW against torch's for-loop AdamW: fp32 rounding differs per CPU's vector width, and Adam
    # divides by sqrt(v), so a weight whose grads are ~0 moves by up to ~3e-7 more on one machine than another
    for (name, a), b in zip(finals[1].named_parameters(), finals[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_on_cpu_tracks_plain_bf16():
    ref = run("auto", "llama_tied", precision="bf16-mixed")
    got = run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", precision="bf16-mixed")
    # bf16 weights inside the layers (plain autocast keeps fp32 norm weights): close, not equal.
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=2e-2, atol=0)

def test_schedulers_follow_replaced_optimizer(recwarn):
    ref = run("auto", "llama_tied", scheduler=True)
    got = run(MegaTrainStrategy(cpu_adam="auto"), "llama_tied", scheduler=True)
    assert got.lrs == ref.lrs and len({lr[0] for lr in got.lrs}) == 3
    assert not [w for w in recwarn if "has been overridden" in str(w.message)]


def test_package_exports():
    assert set(lightning_megatrain.__all__) == {"MegaTrainPrecision", "MegaTrainStrategy"}


def test_clipping_uses_the_engine_path():
    """gradient_clip_val goes through the engine's flat-buffer clipping, not torch's per-tensor fallback."""
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", side_effect=AssertionError("fallback used")):
        got = run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", clip=1.0, steps=2)
    ref = run("auto", "llama_tied", clip=1.0, steps=2)
    assert_records_close(got, ref)

def test_compile_layers_without_a_working_torch_compile_fails_at_setup():
    # checked before the parameters are packed into host flats: a 100B model would otherwise fail in its first step
    from torch._inductor.exc import InvalidCxxCompiler

    from lightning_megatrain.engine import streamed

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise InvalidCxxCompiler()

        return run

    module = ParityLM("llama_tied")
    storage = [p.data_ptr() for p in module.parameters()]  # packing moves every parameter into a host flat
    with mock.patch.object(streamed.torch, "compile", broken_compile):
        with pytest.raises(RuntimeError, match=r"cannot build CPU kernels here \(InvalidCxxCompiler\)(.|\n)*HINT"):
            _trainer(strategy=MegaTrainStrategy(compile_layers=True)).fit(module)
    assert [p.data_ptr() for p in module.parameters()] == storage  # refused before packing
    with mock.patch("torch.utils._triton.has_triton", lambda: False):
        with pytest.raises(RuntimeError, match=r"needs Triton for torch.compile on CUDA"):
            streamed.check_compilable(torch.device("cuda", 0))


def test_grads_read_by_hooks_sees_modules_and_callbacks():
    # what decides whether host grads may land after the optimizer step starts (engine/optimizer_step.py, [Note: late
    # grads])
    from lightning_megatrain.hooks import grads_read_by_hooks

    class Quiet(L.Callback):
        def on_train_batch_end(self, *args):
            pass

    class Reads(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    class ClipsItself(ParityLM):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

    def attached(module, callbacks):
        module.trainer = L.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
        return module

    assert not grads_read_by_hooks(attached(ParityLM("llama_tied"), [Quiet()]))
    assert grads_read_by_hooks(attached(ParityLM("llama_tied"), [Quiet(), Reads()]))
    assert grads_read_by_hooks(attached(ClipsItself("llama_tied"), []))


def test_host_memory_is_reported_by_kind_at_train_end(caplog):
    # masters and grads are 4 bytes per parameter each, AdamW's two moments 8 (plus one step scalar per tensor); the
    # resident set holds them all, and the rest is reported as "other"
    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            self.sizes = trainer.strategy.host_memory()
            self.n_params = sum(p.numel() for p in pl_module.parameters())
            self.n_tensors = sum(1 for _ in pl_module.parameters())

    check = Check()
    with caplog.at_level("INFO", logger="lightning_megatrain"):
        run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", steps=2, callbacks=[check])
    sizes, n = check.sizes, check.n_params
    assert sizes["masters"] == 4 * n and sizes["grads"] == 4 * n
    assert sizes["optimizer_states"] == 8 * n + 4 * check.n_tensors
    assert sizes["other"] == sizes["rss"] - (sizes["masters"] + sizes["grads"] + sizes["optimizer_states"]) > 0
    (message,) = [r.getMessage() for r in caplog.records if "host memory at train end" in r.getMessage()]
    assert "optimizer states" in message
    now, peak = (float(x) for x in re.search(r"at train end ([\d.]+) GiB .*peak so far ([\d.]+) GiB", message).groups())
    assert peak >= now > 0  # the high-water mark, logged beside the resident set
