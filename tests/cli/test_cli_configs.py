"""The ready configs parse (``--print_config``) and instantiate with a tiny ``model.config`` (no Hub access)."""

from __future__ import annotations

import json

import pytest
import yaml
from cli_paths import CONFIGS, DEMO_CONFIG

from lightning_megatrain import MegaTrainPrecision, MegaTrainStrategy
from lightning_megatrain.callbacks import ThroughputLogger
from lightning_megatrain.cli import MegaTrainCLI, main
from lightning_megatrain.data import DEMO_TOKENIZER_DIR, SFTDataModule
from lightning_megatrain.models import CausalLMModule

_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 128,
}
# config file -> (Hub id it names, attn_implementation, tiny model.config of the same architecture)
READY = {
    "llama3-8b": ("meta-llama/Llama-3.1-8B-Instruct", "sdpa", {"model_type": "llama", **_TINY}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "sdpa", {"model_type": "qwen2", **_TINY}),
    "qwen3-8b": ("Qwen/Qwen3-8B", "sdpa", {"model_type": "qwen3", **_TINY}),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "sdpa",
        {"model_type": "mixtral", **_TINY, "num_local_experts": 4, "output_router_logits": False},
    ),
    "gpt-oss-20b": ("openai/gpt-oss-20b", "eager", {"model_type": "gpt_oss", **_TINY, "num_local_experts": 4}),
    # The Hub checkpoint is the multimodal Gemma3ForConditionalGeneration (text_config + vision_config).
    "gemma3-27b": (
        "google/gemma-3-27b-it",
        "eager",
        {
            "model_type": "gemma3",
            "text_config": dict(_TINY),
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            "mm_tokens_per_image": 4,
            "boi_token_index": 1020,
            "eoi_token_index": 1021,
            "image_token_index": 1022,
        },
    ),
}


def test_every_config_is_covered():
    assert {path.stem for path in CONFIGS.glob("*.yaml")} == {"demo", *READY}


@pytest.mark.parametrize("name", sorted(READY))
def test_ready_config_parses(name, capsys):
    hub_id, attn, _ = READY[name]
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert done.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["model"] == hub_id and config["model"]["config"] is None
    assert config["model"]["attn_implementation"] == attn
    assert config["trainer"]["precision"] == "bf16-mixed"
    assert config["trainer"]["devices"] == 1
    assert config["trainer"]["strategy"]["class_path"] == "lightning_megatrain.MegaTrainStrategy"
    assert config["data"]["micro_batch_size"] >= 1 and config["data"]["cutoff_len"] >= 1024


@pytest.mark.parametrize("name", sorted(READY))
def test_ready_config_instantiates_with_tiny_model(name, in_tmp):
    _, attn, tiny = READY[name]
    cli = MegaTrainCLI(
        args=[
            "--config", str(CONFIGS / f"{name}.yaml"),
            "--model.model=null",
            f"--model.config={json.dumps(tiny)}",
            f"--data.tokenizer={DEMO_TOKENIZER_DIR}",
            "--trainer.accelerator=cpu",  # the configs say cuda
        ],
        run=False,
    )
    assert isinstance(cli.model, CausalLMModule) and isinstance(cli.datamodule, SFTDataModule)
    assert cli.model.hparams.attn_implementation == attn
    assert cli.model.hf_config.model_type == tiny["model_type"]
    assert cli.model.hparams.tokenizer == str(DEMO_TOKENIZER_DIR)  # linked from data.tokenizer
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MegaTrainStrategy) and strategy.num_slots == 2 and strategy.cpu_adam == "auto"
    assert isinstance(strategy.precision_plugin, MegaTrainPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    assert any(isinstance(cb, ThroughputLogger) for cb in cli.trainer.callbacks)


def test_demo_config_parses(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(DEMO_CONFIG), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"] == "megatrain"
    assert config["model"]["config"]["vocab_size"] == 1024
    assert config["data"]["dataset"] == "demo_alpaca,demo_sharegpt,demo_messages"


def test_hub_tokenizer_is_fetched_once_for_model_and_data(in_tmp, monkeypatch):
    """With model.model a Hub id and no tokenizer, only the tokenizer files are fetched, for both model and data."""
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(DEMO_TOKENIZER_DIR)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    from lightning_megatrain import cli as cli_module

    model = cli_module.Namespace(model="org/some-model", tokenizer=None, trust_remote_code=False)
    data = cli_module.Namespace(tokenizer=None)
    assert cli_module.resolve_tokenizer(model, data) == str(DEMO_TOKENIZER_DIR)
    assert model.tokenizer == data.tokenizer == str(DEMO_TOKENIZER_DIR)
    ((repo_id, patterns),) = calls
    assert repo_id == "org/some-model" and "tokenizer*" in patterns and "*.safetensors" not in patterns
