"""Export a Lightning checkpoint of a ``CausalLMModule`` (or a subclass: ``DPOModule``) as a HuggingFace model
directory."""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.initialization import no_init_weights

from lightning_megatrain._hardware import umask
from lightning_megatrain.data.templates import end_of_turn_ids, resolve_chat_template
from lightning_megatrain.engine.shard_states import load_shard_files, whole_params
from lightning_megatrain.models.causal_lm import CausalLMModule
from lightning_megatrain.models.packed_attention import hf_attn_implementation

_PREFIX = "model."


def export_checkpoint(
    ckpt_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
) -> Path:
    """Writes ``config.json``, safetensors shards, the generation config and the tokenizer.

    A ``CausalLMModule`` is rebuilt from the checkpoint's ``hyper_parameters`` that its constructor takes (a
    subclass's own, such as ``DPOModule``'s ``loss_type`` and ``beta``, are left out; the HF config is resolved from
    ``model`` or ``config`` as in training, with the model's own dropout), the architecture is created without random
    initialisation and filled with the checkpoint's ``model.*`` weights (fp32 masters). The
    tokenizer is exported when the module has ``tokenizer`` or ``model`` set, with the chat template the data was
    encoded with (the datamodule's ``template``, when the checkpoint records one), and the generation config's
    ``eos_token_id`` becomes a list: the tokenizer's eos first, then the end-of-turn tokens that template ends an
    answer with (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...), so ``generate()`` stops where the
    fine-tuned model ends its turn. The directory is
    written beside ``out_dir`` and renamed into place, so ``out_dir`` is never half-written.

    The checkpoint is unpickled with ``weights_only=False`` (it holds hyper-parameters and loop
    state); only export checkpoints you trust.

    Args:
        ckpt_path: Single-file Lightning checkpoint (``.ckpt``) of a ``CausalLMModule`` or a subclass.
        out_dir: Destination directory.
        max_shard_size: Largest safetensors shard, e.g. ``"5GB"`` or a byte count.
        overwrite: Replace a non-empty ``out_dir``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    ckpt_path, out_dir = Path(ckpt_path), Path(out_dir)
    if ckpt_path.is_dir():  # checkpoint_format="sharded" (sharded_checkpoint.py)
        raise FileNotFoundError(
            f"ckpt_path={str(ckpt_path)!r} is not a file but a directory (a sharded checkpoint). HINT: `megatrain "
            f"convert {ckpt_path} <file>.ckpt` makes it one file, then export that file."
        )
    if not ckpt_path.is_file():
        raise FileNotFoundError(
            f"ckpt_path={str(ckpt_path)!r} is not a file; pass a single-file Lightning checkpoint."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"out_dir={str(out_dir)!r} exists and is not a directory.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"out_dir={str(out_dir)!r} is not empty; pass overwrite=True to replace it."
        )

    checkpoint = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    # saved by several ranks: the decoder layers are in the shard files beside it ([Note: checkpoints of several ranks])
    checkpoint = {**checkpoint, "state_dict": {**checkpoint.get("state_dict", {}),
                                               **whole_params(load_shard_files(checkpoint, ckpt_path))}}
    if "hyper_parameters" not in checkpoint:
        raise ValueError(
            f"{ckpt_path} has no 'hyper_parameters'; it was not saved from a CausalLMModule."
        )
    # LightningCLI adds private keys such as `_class_path` and `_instantiator`; subclasses add their own arguments.
    accepted = inspect.signature(CausalLMModule.__init__).parameters
    hparams = {k: v for k, v in checkpoint["hyper_parameters"].items() if k in accepted and k != "self"}
    state_dict = {
        key[len(_PREFIX) :]: value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(_PREFIX)
    }
    if not state_dict:
        raise ValueError(f"{ckpt_path} has no '{_PREFIX}*' weights in its state_dict.")

    module = CausalLMModule(**hparams)
    config = module.hf_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch.float32,
            attn_implementation=hf_attn_implementation(hparams["attn_implementation"]),
            trust_remote_code=hparams["trust_remote_code"],
        )
    model.tie_weights()
    model.load_state_dict(state_dict, strict=True)
    config.use_cache = True
    config.get_text_config().use_cache = True
    source = hparams["model"]
    model.generation_config = _generation_config(source, config)
    tokenizer_source = hparams["tokenizer"] or source

    tokenizer = None
    if tokenizer_source is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=hparams["trust_remote_code"])
        template = checkpoint.get("datamodule_hyper_parameters", {}).get("template")
        if template is not None:
            tokenizer.chat_template = resolve_chat_template(tokenizer, template)
        model.generation_config.eos_token_id = _stop_ids(tokenizer, model.generation_config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        # transformers 5 always writes safetensors (`safe_serialization` no longer exists).
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _readable_per_umask(staging)
        if out_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, retired / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(retired)
        else:
            os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def _readable_per_umask(folder: Path) -> None:
    """Give ``folder`` and what is in it the modes ``mkdir`` and ``open`` give: ``mkdtemp`` makes the folder private,
    and safetensors writes ``model.safetensors`` private too (0o600 whatever the umask)."""
    mask = umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _generation_config(source: str | None, config: PretrainedConfig) -> GenerationConfig:
    """The pretrained model's generation config when it ships one, else one derived from config."""
    if source is not None:
        try:
            return GenerationConfig.from_pretrained(source)
        except OSError:  # no generation_config.json in the pretrained model
            pass
    return GenerationConfig.from_model_config(config)


def _stop_ids(tokenizer, generation_config: GenerationConfig) -> list[int] | int | None:
    """The tokenizer's eos, then the generation config's own, then the chat template's end-of-turn tokens."""
    own = generation_config.eos_token_id
    own = own if isinstance(own, list) else [] if own is None else [own]
    ids = [tokenizer.eos_token_id, *own, *end_of_turn_ids(tokenizer)]
    ids = list(dict.fromkeys(index for index in ids if index is not None))
    return ids if len(ids) > 1 else (ids[0] if ids else None)
