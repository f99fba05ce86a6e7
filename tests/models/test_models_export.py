"""export_checkpoint: a fitted checkpoint becomes an HF directory that reproduces the logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from lightning_megatrain.models import CausalLMModule, export_checkpoint


@pytest.fixture
def tokenizer_dir(tmp_path):
    vocab = {f"t{i}": i for i in range(128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


@pytest.fixture
def fitted(request, tiny_archs, token_loader, trainer_kwargs, tmp_path, tokenizer_dir):
    """A module fitted for 2 steps and its ModelCheckpoint file; param selects the architecture."""
    config, attn = tiny_archs[request.param]
    torch.manual_seed(0)
    module = CausalLMModule(
        config=config, attn_implementation=attn, tokenizer=str(tokenizer_dir), learning_rate=1e-2
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    trainer = Trainer(max_steps=2, limit_val_batches=0, callbacks=[checkpoint], **trainer_kwargs)
    trainer.fit(module, token_loader(n=4))
    return module, checkpoint.best_model_path


@pytest.mark.parametrize("fitted", ["llama", "gemma2"], indirect=True)
def test_export_reproduces_trained_logits(fitted, tmp_path):
    module, ckpt_path = fitted
    assert torch.load(ckpt_path, weights_only=False)["tokens_trained"] == 2 * 2 * 15
    out_dir = export_checkpoint(ckpt_path, tmp_path / "hf")

    names = {p.name for p in out_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]
    assert json.loads((out_dir / "config.json").read_text())["use_cache"] is True

    exported = AutoModelForCausalLM.from_pretrained(
        out_dir, attn_implementation=module.hparams.attn_implementation
    )
    input_ids = torch.randint(0, 128, (2, 10))  # [B, T]
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids).logits, module(input_ids), rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out_dir)("t5 t7")["input_ids"] == [5, 7]


@pytest.mark.parametrize("fitted", ["qwen3"], indirect=True)
def test_export_folder_is_readable_per_the_umask(fitted, tmp_path):
    _, ckpt_path = fitted
    old = os.umask(0o022)
    try:
        out_dir = export_checkpoint(ckpt_path, tmp_path / "hf")
    finally:
        os.umask(old)
    assert out_dir.stat().st_mode & 0o777 == 0o755  # as mkdir makes it: others may read the exported model
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out_dir.iterdir()}
    assert modes == dict.fromkeys(modes, "0o644")  # model.safetensors included (safetensors writes it 0o600)


@pytest.mark.parametrize("fitted", ["qwen3"], indirect=True)
def test_sharded_export_and_overwrite(fitted, tmp_path):
    module, ckpt_path = fitted
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    (out_dir / "stale.txt").write_text("old")

    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_checkpoint(ckpt_path, out_dir)
    export_checkpoint(ckpt_path, out_dir, max_shard_size="20KB", overwrite=True)

    shards = sorted(out_dir.glob("*.safetensors"))
    assert len(shards) > 1
    assert (out_dir / "model.safetensors.index.json").is_file()
    assert not (out_dir / "stale.txt").exists()
    exported = AutoModelForCausalLM.from_pretrained(out_dir)
    input_ids = torch.randint(0, 128, (1, 8))  # [B, T]
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids).logits, module(input_ids), rtol=0, atol=1e-5)


def test_missing_checkpoint_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="ckpt_path=.*missing.ckpt"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def _chat_tokenizer(folder, template):
    """The test vocabulary with ids 126 and 127 as ChatML's special tokens, eos ``t2``, saved over ``folder``."""
    vocab = {f"t{i}": i for i in range(126)} | {"<|im_start|>": 126, "<|im_end|>": 127}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", pad_token="t0", eos_token="t2",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=template,
    ).save_pretrained(folder)


@pytest.mark.parametrize("fitted", ["llama"], indirect=True)
def test_export_stops_generation_at_the_templates_end_of_turn(fitted, tmp_path, tokenizer_dir):
    _, ckpt_path = fitted
    _chat_tokenizer(tokenizer_dir, CHATML)
    out_dir = export_checkpoint(ckpt_path, tmp_path / "hf")
    assert json.loads((out_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 127]

    # data.template (recorded in the checkpoint's datamodule hyper-parameters) is the template used: exported too
    override = tmp_path / "ends_with_im_start.jinja"
    override.write_text(CHATML.replace("+ '<|im_end|>'", "+ '<|im_start|>'"))
    checkpoint = torch.load(ckpt_path, weights_only=False)
    checkpoint["datamodule_hyper_parameters"] = {"template": str(override)}
    torch.save(checkpoint, tmp_path / "with_template.ckpt")
    out_dir = export_checkpoint(tmp_path / "with_template.ckpt", tmp_path / "hf2")
    assert json.loads((out_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 126]
    assert AutoTokenizer.from_pretrained(out_dir).chat_template == override.read_text()


@pytest.mark.parametrize("fitted", ["llama"], indirect=True)
def test_export_of_a_checkpoint_saved_by_two_ranks(fitted, tmp_path):
    """A checkpoint of 2 ranks holds the decoder layers' masters in its shard files only ([Note: checkpoints of
    several ranks]): export assembles them (it failed with the layers' keys missing from the state_dict). The files
    are written as two ranks write them, each rank's element ranges of every layer parameter."""
    from lightning_megatrain.engine.shard_states import shard_path, split_checkpoint

    module, ckpt_path = fitted
    whole = torch.load(ckpt_path, weights_only=False)
    layers = {k: v for k, v in whole["state_dict"].items() if ".layers." in k}
    assert layers
    path = tmp_path / "two.ckpt"
    for rank in range(2):
        slices = {}
        for name, value in layers.items():
            half = -(-value.numel() // 2)
            lo, hi = rank * half, min((rank + 1) * half, value.numel())
            slices[name] = [[lo, hi, {"master": value.reshape(-1)[lo:hi].clone()}]]
        params = {"world_size": 2, "shapes": {k: list(v.shape) for k, v in layers.items()}, "slices": slices}
        checkpoint = {**whole, "state_dict": {k: v for k, v in whole["state_dict"].items() if k not in layers}}
        main, shard = split_checkpoint(checkpoint, path, params)
        torch.save(shard, shard_path(path, rank, 2))
        if rank == 0:
            torch.save(main, path)

    exported = AutoModelForCausalLM.from_pretrained(
        export_checkpoint(path, tmp_path / "hf"), attn_implementation=module.hparams.attn_implementation
    )
    input_ids = torch.randint(0, 128, (2, 10))  # [B, T]
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids).logits, module(input_ids), rtol=0, atol=1e-5)
