"""The ready configs parse (``--print_config``), instantiate with a tiny ``model.config`` and size their batches
with the planner (no Hub access)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import transformers
import yaml

from lightning_megatrain import MegaTrainPrecision, MegaTrainStrategy, planner
from lightning_megatrain.callbacks import ThroughputLogger
from lightning_megatrain.cli import MegaTrainCLI, main, plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.data import DEMO_TOKENIZER_DIR, SFTDataModule
from lightning_megatrain.models import CausalLMModule
from lightning_megatrain.planner import Machine

from helpers.cli_paths import CONFIGS, DEMO_CONFIG, REPO

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
    "llama3-8b": ("meta-llama/Llama-3.1-8B-Instruct", "auto", {"model_type": "llama", **_TINY}),
    "llama3-8b-128k": ("meta-llama/Llama-3.1-8B-Instruct", "auto", {"model_type": "llama", **_TINY}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "auto", {"model_type": "qwen2", **_TINY}),
    "qwen3-8b": ("Qwen/Qwen3-8B", "auto", {"model_type": "qwen3", **_TINY}),
    # Sized for the README's 128 GiB host: one H200, one 80 GB GPU, one 24 GB GPU.
    "qwen2.5-3b-128g": ("Qwen/Qwen2.5-3B-Instruct", "auto", {"model_type": "qwen2", **_TINY}),
    "qwen2.5-3b-128g-80g": ("Qwen/Qwen2.5-3B-Instruct", "auto", {"model_type": "qwen2", **_TINY}),
    "qwen2.5-3b-128g-24g": ("Qwen/Qwen2.5-3B-Instruct", "auto", {"model_type": "qwen2", **_TINY}),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "auto",
        {"model_type": "mixtral", **_TINY, "num_local_experts": 4, "output_router_logits": False},
    ),
    "gpt-oss-20b": ("openai/gpt-oss-20b", "eager", {"model_type": "gpt_oss", **_TINY, "num_local_experts": 4}),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "eager", {"model_type": "gpt_oss", **_TINY, "num_local_experts": 4}),
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
    # Also multimodal on the Hub (Qwen3_5ForConditionalGeneration); AutoModelForCausalLM builds the text model.
    "qwen3.5-27b": (
        "Qwen/Qwen3.5-27B",
        "auto",
        {
            "model_type": "qwen3_5",
            "text_config": {**_TINY, "layer_types": ["linear_attention", "full_attention"],
                            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                            "linear_key_head_dim": 8, "linear_value_head_dim": 8},
            "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 32},
        },
    ),
}
# Configs of another config's model: the configs/hf/<name>.json they plan with.
_SHAPE = {"llama3-8b-128k": "llama3-8b", "qwen2.5-3b-128g": "qwen2.5-3b", "qwen2.5-3b-128g-80g": "qwen2.5-3b",
          "qwen2.5-3b-128g-24g": "qwen2.5-3b"}
# Long-context configs: one row per micro-batch and the accumulation their header argues for, not the largest
# micro-batch and fewest accumulation steps of the planner (one row already hides the weight transfers).
_LONG_CONTEXT = {"llama3-8b-128k"}
# Families that need a newer transformers than some supported releases: their tests skip there.
_NEEDS = {"qwen3_5": "Qwen3_5TextConfig"}
READY_NAMES = [
    pytest.param(name, marks=pytest.mark.skipif(not hasattr(transformers, _NEEDS[tiny["model_type"]]),
                                                 reason=f"this transformers has no {tiny['model_type']}"))
    if tiny["model_type"] in _NEEDS else name
    for name, (_, _, tiny) in sorted(READY.items())
]


def test_every_config_is_covered():
    dpo = {"dpo-demo", "dpo-qwen2.5-3b-128g"}  # `megatrain dpo` configs: tests/cli/test_cli_dpo.py
    assert {path.stem for path in CONFIGS.glob("*.yaml")} == {"demo", *READY, *dpo}


@pytest.mark.parametrize("name", READY_NAMES)
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


@pytest.mark.parametrize("name", READY_NAMES)
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
    # transformers' default experts everywhere (gpt-oss: grouped_mm, with eager layers on a GPU, docs/scale.md)
    assert cli.model.hparams.experts_implementation is None
    assert cli.model.hf_config.model_type == tiny["model_type"]
    assert cli.model.hparams.tokenizer == str(DEMO_TOKENIZER_DIR)  # linked from data.tokenizer
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MegaTrainStrategy)
    assert strategy.config.num_slots == 2 and strategy.config.cpu_adam == "auto"
    assert isinstance(strategy.precision_plugin, MegaTrainPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    assert any(isinstance(cb, ThroughputLogger) for cb in cli.trainer.callbacks)


def _flat_header(text: str) -> str:
    """A config's header comment as one line (continued command lines joined)."""
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    return re.sub(r"\s*\\?\n#\s*", " ", header)


def _header_plan(text: str) -> tuple[list[str], float, float]:
    """The ``megatrain plan`` arguments in a config's header comment and the GPU / host GiB it says they predict."""
    flat = _flat_header(text)
    found = re.search(r"megatrain plan (--model configs/hf/.*?) -> GPU peak ([\d.]+) GiB, host RAM ([\d.]+) GiB", flat)
    assert found, "the header needs the plan command, then '-> GPU peak X GiB, host RAM Y GiB'"
    return shlex.split(found.group(1)), float(found.group(2)), float(found.group(3))


def _header_machine(args: list[str]) -> Machine:
    """The machine a header's plan command names: --gpu-mem and --cpu-cores, and --host-ram where it gives one
    (else unlimited: the config states the host RAM its plan needs)."""
    value = lambda flag, default: float(args[args.index(flag) + 1]) if flag in args else default
    return Machine(gpu_mem_gib=value("--gpu-mem", None), cpu_cores=int(value("--cpu-cores", 0)) or None,
                   host_ram_gib=value("--host-ram", 1 << 20))


@pytest.mark.parametrize("name", READY_NAMES)
def test_ready_config_states_its_machine(name):
    """The first lines of every ready config say which host RAM and GPU it is sized for."""
    head = "\n".join((CONFIGS / f"{name}.yaml").read_text().splitlines()[:4])
    found = re.search(r"^# Sized for: (.*GiB of host RAM.*GPU.*)$", head, re.M)
    assert found, "the header's first lines need '# Sized for: ... GiB of host RAM ... GPU ...'"


@pytest.mark.parametrize("name", READY_NAMES)
def test_ready_config_sizes_come_from_the_planner(name, capsys):
    """micro_batch_size is the largest micro-batch the planner fits on the header's GPU (and host, where the header
    names its RAM) at the config's cutoff_len,
    accumulate_grad_batches the fewest steps that keep the host optimizer under a quarter of the step (a long-context
    config: one row that fits and hides the transfers, any accumulation the host optimizer allows), and the header
    holds the plan command for exactly these values with what it predicts."""
    text = (CONFIGS / f"{name}.yaml").read_text()
    args, gpu_gib, host_gib = _header_plan(text)
    machine = _header_machine(args)
    assert machine.gpu_mem_gib and machine.cpu_cores, "the header's plan command names --gpu-mem and --cpu-cores"
    config = yaml.safe_load(text)
    trainer, model, data = config["trainer"], config["model"], config["data"]
    micro_batch, accum = data["micro_batch_size"], trainer["accumulate_grad_batches"]
    shape = CONFIGS / "hf" / f"{_SHAPE.get(name, name)}.json"  # the numbers of the Hub's config.json
    kwargs = dict(seq_len=data["cutoff_len"], grad_accum=accum, precision=trainer["precision"],
                  loss_chunk_size=model["loss_chunk_size"], attn_implementation=model["attn_implementation"],
                  # the headers' `megatrain plan` commands give no engine flags: eager layers, serial host step, no
                  # memos
                  config=EngineConfig(num_slots=trainer["strategy"]["init_args"]["num_slots"], overlap_optimizer=False,
                                      compile_layers=False, gpu_optimizer_groups=0, attention_memo=False),
                  machine=machine)
    p = planner.plan(shape, micro_batch=micro_batch, **kwargs)
    fits = lambda q: q.gpu_total <= q.gpu_limit and q.host_total <= q.host_limit - q.host_reserve
    assert fits(p)
    cpu_bound = lambda q: any("CPU optimizer" in w for w in q.warnings)
    assert not cpu_bound(p)
    if name in _LONG_CONTEXT:
        assert micro_batch == 1 and p.transfers_hidden and p.long_context["fits"]
    else:
        assert p.max_micro_batch == micro_batch or p.max_micro_batch_host == micro_batch
        # the largest with flat recompute segments: nested ones fit a few more rows but replay more layer forwards
        # (qwen2.5-3b-128g: up to 152 x 4096, 13,502 tokens/s planned against 14,863 at 147)
        flat = kwargs | {"config": kwargs["config"].replace(sub_segment_layers=1)}
        assert not fits(planner.plan(shape, micro_batch=micro_batch + 1, **flat))
        assert accum == 1 or cpu_bound(planner.plan(shape, micro_batch=micro_batch,
                                                    **(kwargs | {"grad_accum": accum - 1})))
    # the header's Host RAM line counts the parameters the planner counts
    assert f"{p.n_params / 1e9:.3g}B parameters x 16 bytes" in text
    assert (gpu_gib, host_gib) == (round(p.gpu_total / 2**30, 1), round(p.host_total / 2**30, 1))
    # docs/cli.md's table of ready configs shows the same plan
    row = f"| {micro_batch} x {accum} at {data['cutoff_len']} | {gpu_gib:.1f} / {host_gib:.1f} GiB |"
    docs_lines = (REPO / "docs" / "cli.md").read_text().splitlines()
    docs_row = next(line for line in docs_lines if f"`configs/{name}.yaml`" in line)
    assert docs_row.endswith(row), (docs_row, row)
    args[args.index("--model") + 1] = str(REPO / args[args.index("--model") + 1])
    assert plan_main([*args, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["n_params"] == p.n_params and run["gpu_total"] == p.gpu_total and run["host_total"] == p.host_total
    assert (run["seq_len"], run["micro_batch"], run["grad_accum"], run["precision"], run["gpu_limit"]) == (
        p.seq_len, p.micro_batch, p.grad_accum, p.precision, p.gpu_limit)
    assert run["assumptions"] == p.assumptions
    if "--host-ram" in args:  # the host the header names holds the plan
        assert run["host_total"] <= run["host_limit"]
    if name in _LONG_CONTEXT:  # the header names the placement its command plans
        lc = run["long_context"]
        assert lc["fits"] and re.search(rf"seq_tile {lc['seq_tile']:,} .*segment_layers {lc['segment_layers']}\b"
                                        rf".*device_checkpoints {lc['device_checkpoints']}\b", _flat_header(text))


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
