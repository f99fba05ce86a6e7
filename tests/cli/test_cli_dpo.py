"""``megatrain dpo``: the DPO demo config fits and validates end to end on the CPU; the 3B DPO config parses,
instantiates with a tiny model and sizes its pairs with the planner."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from lightning_megatrain import MegaTrainStrategy, planner
from lightning_megatrain.cli import MegaTrainCLI, main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.data import DEMO_TOKENIZER_DIR, PreferenceDataModule
from lightning_megatrain.models import DPOModule
from lightning_megatrain.planner import Machine

from helpers.cli_paths import CONFIGS, QUIET

DEMO = CONFIGS / "dpo-demo.yaml"
QWEN = CONFIGS / "dpo-qwen2.5-3b-128g.yaml"
pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*")


def test_dpo_demo_config_fits_then_validates(in_tmp):
    short = [*QUIET, "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.num_sanity_val_steps=0",
             "--data.val_size=4", "--data.micro_batch_size=16", "--trainer.log_every_n_steps=1"]
    assert main(["dpo", "fit", "--config", str(DEMO), *short]) == 0
    last = in_tmp / "checkpoints" / "dpo-demo" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    tables = checkpoint["reference_logps"]
    assert tables["train"].shape == (176, 2) and tables["val"].shape == (4, 2)
    assert checkpoint["hyper_parameters"]["loss_type"] == "sigmoid"
    (log_dir,) = (in_tmp / "lightning_logs" / "dpo-demo").iterdir()
    with open(log_dir / "metrics.csv") as file:
        columns = set(next(csv.reader(file)))
    assert {"train_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "val_loss", "val_rewards/accuracies"} <= columns
    cli = MegaTrainCLI(args=["validate", "--config", str(DEMO), *short, "--ckpt_path", str(last)],
                       model_class=DPOModule, datamodule_class=PreferenceDataModule)
    assert torch.equal(cli.model.reference_logps["val"], tables["val"])  # from the checkpoint, not recomputed
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])
    assert main(["export", str(last), str(in_tmp / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(in_tmp / "hf")
    assert torch.equal(exported.lm_head.weight, checkpoint["state_dict"]["model.lm_head.weight"])


def test_a_dpo_config_given_to_megatrain_fit_points_to_megatrain_dpo(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(DEMO)])
    assert ("does not accept option 'model.loss_type'; loss_type is an option of DPOModule: run preference "
            "optimisation with `megatrain dpo fit|validate|test|predict ...`") in capsys.readouterr().err


def test_dpo_3b_config_instantiates_with_a_tiny_model(in_tmp):
    tiny = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 128}
    cli = MegaTrainCLI(args=["--config", str(QWEN), "--model.model=null", f"--model.config={json.dumps(tiny)}",
                             f"--data.tokenizer={DEMO_TOKENIZER_DIR}", "--trainer.accelerator=cpu"],
                       run=False, model_class=DPOModule, datamodule_class=PreferenceDataModule)
    assert isinstance(cli.model, DPOModule) and isinstance(cli.datamodule, PreferenceDataModule)
    assert cli.model.hparams.loss_type == "sigmoid" and cli.model.hparams.reference_cache.endswith("reference.pt")
    assert isinstance(cli.trainer.strategy, MegaTrainStrategy)
    assert cli.trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_dpo_3b_config_sizes_come_from_the_planner():
    """2 x micro_batch_size rows is the largest even micro-batch the planner fits, and the header quotes its plan."""
    text = QWEN.read_text()
    config = yaml.safe_load(text)
    trainer, model, data = config["trainer"], config["model"], config["data"]
    pairs = data["micro_batch_size"]
    machine = Machine(gpu_mem_gib=139, cpu_cores=16, host_ram_gib=128)
    kwargs = dict(seq_len=data["cutoff_len"], grad_accum=trainer["accumulate_grad_batches"],
                  precision=trainer["precision"], loss_chunk_size=model["loss_chunk_size"],
                  attn_implementation=model["attn_implementation"], machine=machine,
                  config=EngineConfig(num_slots=2, overlap_optimizer=False, compile_layers=False,
                                      gpu_optimizer_groups=0))
    shape = CONFIGS / "hf" / "qwen2.5-3b.json"
    fits = lambda q: q.gpu_total <= q.gpu_limit and q.host_total <= q.host_limit - q.host_reserve
    p = planner.plan(shape, micro_batch=2 * pairs, **kwargs)
    # with flat recompute segments, as the SFT configs (tests/cli/test_cli_configs.py): nested ones fit more, slower
    flat_segments = kwargs | {"config": kwargs["config"].replace(sub_segment_layers=1)}
    assert fits(p) and not fits(planner.plan(shape, micro_batch=2 * pairs + 2, **flat_segments))
    assert not any("CPU optimizer" in warning for warning in p.warnings)
    flat = " ".join(line.lstrip("# ").rstrip("\\ ") for line in text.splitlines() if line.startswith("#"))
    assert f"--seq-len {data['cutoff_len']} --micro-batch {2 * pairs} --grad-accum 1" in flat
    assert f"-> GPU peak {p.gpu_total / 2**30:.1f} GiB, host RAM {p.host_total / 2**30:.1f} GiB" in flat
    assert f"{p.n_params / 1e9:.3g}B parameters x 16 bytes" in flat
    assert text.splitlines()[1].startswith("# Sized for: 128 GiB of host RAM") and "H200" in text.splitlines()[1]
