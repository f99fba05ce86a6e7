"""MegaTrainStrategy's Lightning contract at setup: registration, the compute device, the options' one config, the
host-resident layout after setup and the package's exports."""

from __future__ import annotations

import textwrap

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import lightning_megatrain
from lightning_megatrain import MegaTrainStrategy

from helpers.parity import ParityLM, make_data
from helpers.trainers import cpu_trainer


def test_registered_by_name_and_instance():
    assert "megatrain" in StrategyRegistry
    assert isinstance(cpu_trainer(strategy="megatrain").strategy, MegaTrainStrategy)
    strategy = MegaTrainStrategy(num_slots=3)
    assert cpu_trainer(strategy=strategy).strategy is strategy


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
    cpu_trainer(strategy=strategy, callbacks=[check]).validate(WithVal("llama_tied"), DataLoader(make_data()[:2]))
    # a CPU device refuses 1 when fitting; the "auto" options resolved for a CPU compute device
    assert check.config == strategy.config.replace(
        gpu_optimizer_groups=0, overlap_optimizer=False, compile_layers=False, segment_layers=1, device_checkpoints=0,
        sub_segment_layers=1, update_during_backward=False, attention_memo=False,
    )


def test_checkpoints_unplanned_is_one_checkpoint_per_layer_unless_given():
    # the one home of "auto" where nothing plans the checkpoints (a CPU device, several ranks, no HF config, a plan
    # that fits nothing): one per layer, none on the GPU, flat segments; explicit values kept
    from lightning_megatrain.config import EngineConfig

    assert EngineConfig().checkpoints_unplanned() == (1, 0, 1)
    given = EngineConfig(segment_layers=6, device_checkpoints=4, sub_segment_layers=2)
    assert given.checkpoints_unplanned() == (6, 4, 2)
    assert EngineConfig(segment_layers=3).checkpoints_unplanned() == (3, 0, 1)


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
    cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch"), callbacks=[check]).fit(module)
    assert check.checked
    assert "forward" not in module.model.model.layers[0].__dict__  # teardown restored the layers' own forward


def test_package_exports():
    exports = {"MegaTrainPrecision", "MegaTrainStrategy", "NonFiniteError", "StepFailed"}
    assert set(lightning_megatrain.__all__) == exports
