"""The ``megatrain`` command: LightningCLI for ``CausalLMModule`` + ``SFTDataModule`` with ``strategy="megatrain"``.

Usage::

    megatrain fit --config configs/demo.yaml [--trainer.max_steps=100 --data.micro_batch_size=4 ...]
    megatrain fit --config configs/demo.yaml --ckpt_path checkpoints/demo/last.ckpt    # resume
    megatrain validate|test|predict --config X.yaml
    megatrain dpo fit|validate|test|predict --config X.yaml   # preference pairs: DPOModule + PreferenceDataModule
    megatrain fit --help                       # every option with its docstring
    megatrain fit --trainer.strategy.help MegaTrainStrategy   # the strategy's options (num_slots, cpu_adam, ...)
    megatrain fit --config X.yaml --print_config              # the full resolved config
    megatrain export CKPT OUT_DIR [--max-shard-size 5GB] [--overwrite]   # Lightning checkpoint -> HF model folder
    megatrain convert SHARDED_DIR OUT.ckpt [--overwrite]   # sharded checkpoint -> one file plain Lightning loads
    megatrain plan ...                          # memory / batch planner (see `megatrain plan --help`)

``python -m lightning_megatrain`` runs the same program.

What this CLI adds to a plain ``LightningCLI``:

- Defaults ``trainer.strategy="megatrain"`` and ``trainer.devices=1`` (the strategy trains on one device).
- ``trainer.precision`` left unset (``null``) becomes ``"bf16-mixed"`` when training on a CUDA GPU and ``"32-true"``
  otherwise (bf16 autocast on a CPU is slow and is not what a CPU smoke test wants).
- One tokenizer for model and data: ``model.tokenizer`` and ``data.tokenizer`` are set to the same folder (needed
  anyway: Lightning refuses to log differing ``tokenizer`` hyper-parameters of model and datamodule). It is the
  one given (either key), else ``model.model``, else the bundled demo tokenizer. A Hub name is resolved to a local
  folder by downloading only the tokenizer files, because ``SFTDataModule`` reads local folders only.
- A ``ThroughputLogger`` callback is always added; its options are the ``throughput:`` section. A ``FitSummary``
  says at the end of ``fit`` how the loss went and where the checkpoint and logs are; the progress bar and model
  summary (when enabled and not given as callbacks) are ``StepProgressBar`` and ``ParamSummary``, which drop
  Lightning's ``Epoch 1/-2`` of a ``max_steps`` run and its ``Total FLOPs: 0``. Lightning's ``TPU available: False``
  line, its litlogger tip and a FutureWarning from its own code are left out (``_console.py``).
- A user error (``ValueError``, ``OSError``: a bad dataset row, a missing file, an unknown ``model_type``, an offline
  Hub name) prints as one message of at most ``ERROR_MAX_CHARS`` characters and exits with status 1;
  ``MEGATRAIN_DEBUG=1`` or ``--debug`` shows the traceback. Other exceptions (bugs) keep their traceback.
- ``optimizer:`` / ``lr_scheduler:`` sections: when ``optimizer`` is given, it replaces
  ``CausalLMModule.configure_optimizers`` (AdamW with decay/no-decay groups and warmup + cosine) and is built over
  all parameters *after* ``configure_model`` created them; schedulers step every optimizer step (``interval:
  step``), except ``ReduceLROnPlateau`` (per epoch, monitoring its ``monitor``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import MethodType
from typing import Any, NoReturn

import torch
from jsonargparse import DefaultHelpFormatter, Namespace, set_parsing_settings
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, ReduceLROnPlateau, instantiate_class
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from torch.optim import Optimizer

import lightning_megatrain  # noqa: F401  (registers strategy="megatrain")
from lightning_megatrain._console import quiet_lightning
from lightning_megatrain.callbacks import FitSummary, ParamSummary, StepProgressBar, ThroughputLogger
from lightning_megatrain.data import DEMO_TOKENIZER_DIR, PreferenceDataModule, SFTDataModule
from lightning_megatrain.models import CausalLMModule, DPOModule, export_checkpoint
from lightning_megatrain.planner.command import plan_main
from lightning_megatrain.sharded_load import convert_to_file

PROG = "megatrain"

#: A user error's message is cut to this many characters (transformers' unknown ``model_type`` lists every known one:
#: ~12,000 characters); ``MEGATRAIN_DEBUG=1`` or ``--debug`` shows all of it with the traceback.
ERROR_MAX_CHARS = 600
DEBUG_ENV = "MEGATRAIN_DEBUG"
DEBUG_FLAG = "--debug"

#: Exceptions that are the user's to fix, printed as one message: bad data (``DatasetFormatError`` and
#: ``TemplateError`` are ``ValueError``), bad values, missing files, the Hub being unreachable or offline (``OSError``,
#: as transformers and huggingface_hub raise). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)

DESCRIPTION = """\
Train causal LMs larger than GPU memory on one GPU (Lightning strategy "megatrain").

Commands:
  fit|validate|test|predict --config X.yaml   LightningCLI (CausalLMModule + SFTDataModule); `megatrain fit --help`
  dpo fit|validate|test|predict ...           the same for preference pairs (DPOModule + PreferenceDataModule)
  export CKPT OUT_DIR                         Lightning checkpoint -> HuggingFace model folder
  convert SHARDED_DIR OUT.ckpt                sharded checkpoint directory -> one Lightning .ckpt file
  plan ...                                    memory / batch planner

Defaults beyond Lightning's: trainer.strategy=megatrain, trainer.devices=1, trainer.precision=null meaning
bf16-mixed on a CUDA GPU and 32-true otherwise, a ThroughputLogger callback (section `throughput:`), one tokenizer
shared by model and data. Strategy options: `megatrain fit --trainer.strategy.help MegaTrainStrategy`.
"""

#: Files of a Hub repository that a tokenizer can need (``*.py`` is added with ``trust_remote_code``).
TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
    "config.json",
    "generation_config.json",
]


def default_precision(accelerator: Any) -> str:
    """``"bf16-mixed"`` when the run will use a CUDA GPU, else ``"32-true"``."""
    if not torch.cuda.is_available():
        return "32-true"
    if isinstance(accelerator, str):
        return "bf16-mixed" if accelerator.lower() in ("auto", "gpu", "cuda") else "32-true"
    class_path = str(getattr(accelerator, "class_path", type(accelerator).__name__))
    return "bf16-mixed" if "cuda" in class_path.lower() else "32-true"


def local_tokenizer_dir(name: str, trust_remote_code: bool = False) -> str:
    """``name`` if it is a local folder; a Hub repository name is downloaded (tokenizer files only) to the HF cache.

    Honours ``HF_HUB_OFFLINE=1`` (then only the cache is used) and ``HF_TOKEN`` for gated repositories.
    """
    if Path(name).expanduser().is_dir():
        return name
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"tokenizer={name!r} is neither a local folder nor a Hub repository name")
    from huggingface_hub import snapshot_download

    patterns = TOKENIZER_FILES + (["*.py"] if trust_remote_code else [])
    rank_zero_info(f"megatrain: fetching the tokenizer files of {name!r} (data.tokenizer must be a local folder)")
    return snapshot_download(name, allow_patterns=patterns)


def resolve_tokenizer(model: Namespace, data: Namespace) -> str:
    """Sets ``model.tokenizer`` and ``data.tokenizer`` to one local folder and returns it (see the module docstring)."""
    given = {key: value for key, value in (("model", model.tokenizer), ("data", data.tokenizer)) if value is not None}
    if len({str(value) for value in given.values()}) > 1:
        raise ValueError(
            f"model.tokenizer={model.tokenizer!r} and data.tokenizer={data.tokenizer!r} differ; the model is exported "
            "with the tokenizer the data was encoded with, so set only one of them."
        )
    source = next(iter(given.values()), None) or model.model or str(DEMO_TOKENIZER_DIR)
    folder = local_tokenizer_dir(str(source), trust_remote_code=bool(model.trust_remote_code))
    model.tokenizer = data.tokenizer = folder
    return folder


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help with the description printed as written (keeps the command list readable)."""


#: ``DPOModule``'s own arguments (``loss_type``, ``beta``, ...), named in the error of a CLI that does not take them.
_DPO_ONLY = sorted(set(inspect.signature(DPOModule.__init__).parameters)
                   - set(inspect.signature(CausalLMModule.__init__).parameters) - {"kwargs"})
_DPO_OPTION = re.compile(rf"'model\.({'|'.join(_DPO_ONLY)})'")


class _ArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose error about a ``DPOModule`` option (a DPO config given to ``megatrain fit``)
    says to run ``megatrain dpo``."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if found := _DPO_OPTION.search(message):
            message += (f"; {found.group(1)} is an option of DPOModule: run preference optimisation with "
                        f"`{PROG} dpo fit|validate|test|predict ...` (docs/dpo.md)")
        super().error(message, ex)


class MegaTrainCLI(LightningCLI):
    """``LightningCLI`` for ``CausalLMModule`` + ``SFTDataModule`` with the megatrain defaults (module docstring).

    Args:
        args: Command-line arguments (without the program name); ``None`` reads ``sys.argv``.
        run: Run the subcommand (``False``: only parse and instantiate, with no subcommand in ``args``).
        **kwargs: Further ``LightningCLI`` arguments; ``trainer_defaults`` are merged over the megatrain defaults.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        # Option help comes from the classes' docstrings (Google style "Args:"; attribute docstrings too).
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
        trainer_defaults = {"strategy": "megatrain", "devices": 1, **kwargs.pop("trainer_defaults", {})}
        parser_kwargs = {
            "prog": PROG,
            "description": DESCRIPTION,
            "formatter_class": _HelpFormatter,
            **kwargs.pop("parser_kwargs", {}),
        }
        self.fit_summary = FitSummary()
        trainer_defaults["callbacks"] = [self.fit_summary, *_as_list(trainer_defaults.get("callbacks"))]
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # a resumed run may log into the same folder
        super().__init__(
            model_class=kwargs.pop("model_class", CausalLMModule),
            parser_class=_ArgumentParser,
            datamodule_class=kwargs.pop("datamodule_class", SFTDataModule),
            subclass_mode_model=False,
            subclass_mode_data=False,
            trainer_defaults=trainer_defaults,
            parser_kwargs=parser_kwargs,
            # The optimizer sections are added below and applied lazily in after_instantiate_classes: LightningCLI's
            # own mechanism builds the optimizer before configure_model has created any parameter.
            auto_configure_optimizers=False,
            args=None if args is None else list(args),
            run=run,
            **kwargs,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ThroughputLogger, "throughput")
        parser.add_optimizer_args((Optimizer,))
        parser.add_lr_scheduler_args()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.trainer.precision is None:
            config.trainer.precision = default_precision(config.trainer.accelerator)
        resolve_tokenizer(config.model, config.data)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's, with ``StepProgressBar`` and ``ParamSummary`` in place of its default progress bar and model
        summary when those are enabled and the config names none."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = _as_list(kwargs.get("callbacks", config.get("callbacks")))
        extra = []
        if config.get("enable_progress_bar") is not False and _RICH_AVAILABLE:
            if not any(isinstance(cb, ProgressBar) for cb in callbacks):
                extra.append(StepProgressBar())
        if config.get("enable_model_summary") is not False:
            if not any(isinstance(cb, ModelSummary) for cb in callbacks):
                extra.append(ParamSummary())
                kwargs["enable_model_summary"] = False  # else Lightning logs that it skips its own default summary
        if extra:
            kwargs["callbacks"] = [*callbacks, *extra]
        return super().instantiate_trainer(**kwargs)

    def after_instantiate_classes(self) -> None:
        optimizer_init = self._get(self.config_init, "optimizer")
        scheduler_init = self._get(self.config_init, "lr_scheduler")
        if optimizer_init is None:
            if scheduler_init is not None:
                raise ValueError(
                    "lr_scheduler is set but optimizer is not: give both (the CLI sections replace "
                    "CausalLMModule.configure_optimizers together), or neither and use the model's learning_rate, "
                    "warmup_steps and min_lr_ratio."
                )
            return
        optimizer_init = _as_dict(optimizer_init)
        scheduler_init = _as_dict(scheduler_init) if scheduler_init is not None else None
        rank_zero_info(
            f"megatrain: optimizer {optimizer_init['class_path']}"
            + (f" and lr_scheduler {scheduler_init['class_path']}" if scheduler_init else "")
            + f" from the CLI replace {type(self.model).__name__}.configure_optimizers"
        )
        make = type(self).configure_optimizers

        def configure_optimizers(module: LightningModule) -> Any:
            optimizer = instantiate_class(module.parameters(), optimizer_init)
            scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
            return make(module, optimizer, scheduler)

        self.model.configure_optimizers = MethodType(configure_optimizers, self.model)

    def after_fit(self) -> None:
        """Logs where the checkpoint and the logs are, and how the loss went (``FitSummary.lines``)."""
        for line in self.fit_summary.lines(self.trainer):
            rank_zero_info(line)

    @staticmethod
    def configure_optimizers(lightning_module: LightningModule, optimizer: Optimizer, lr_scheduler: Any = None) -> Any:
        """The CLI optimizer with its scheduler stepped every optimizer step (``ReduceLROnPlateau``: every epoch)."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            scheduler_config = {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor}
            return {"optimizer": optimizer, "lr_scheduler": scheduler_config}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}


def _as_dict(value: Any) -> dict[str, Any]:
    return value.as_dict() if isinstance(value, Namespace) else dict(value)


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def user_error_message(err: BaseException, max_chars: int = ERROR_MAX_CHARS) -> str:
    """``err`` as one short message: ``Type: message``, cut to ``max_chars`` with the number of characters left out,
    and how to see everything."""
    text = f"{type(err).__name__}: {err}".strip()
    if len(text) > max_chars:
        text = f"{text[:max_chars].rstrip()} ... [{len(text) - max_chars:,} more characters]"
    return f"{PROG}: error: {text}\n({DEBUG_ENV}=1 or {DEBUG_FLAG} shows the full message and traceback)"


def export_main(argv: Sequence[str]) -> int:
    """``megatrain export CKPT OUT_DIR [--max-shard-size 5GB] [--overwrite]``."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} export",
        description="Export a Lightning checkpoint of a CausalLMModule or DPOModule as a HuggingFace model folder "
        "(config.json, safetensors shards, generation config, tokenizer), loadable with "
        "AutoModelForCausalLM.from_pretrained(OUT_DIR). Only export checkpoints you trust (they are unpickled).",
    )
    parser.add_argument("ckpt", help="single-file Lightning checkpoint (.ckpt), e.g. checkpoints/demo/last.ckpt")
    parser.add_argument("out_dir", help="destination folder")
    parser.add_argument("--max-shard-size", default="5GB", help='largest safetensors shard, e.g. "5GB" or bytes')
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    ns = parser.parse_args(list(argv))
    shard = int(ns.max_shard_size) if ns.max_shard_size.isdigit() else ns.max_shard_size
    try:
        out = export_checkpoint(ns.ckpt, ns.out_dir, max_shard_size=shard, overwrite=ns.overwrite)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, ValueError) as err:
        parser.error(str(err))
    print(f"Exported {ns.ckpt} to {out}")
    return 0


def convert_main(argv: Sequence[str]) -> int:
    """``megatrain convert SHARDED_DIR OUT.ckpt [--overwrite]`` (sharded_checkpoint.py, [Note: sharded
    checkpoints])."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} convert",
        description="Write a sharded checkpoint (a directory saved with MegaTrainStrategy(checkpoint_format="
        "'sharded')) as one Lightning .ckpt file, which plain Lightning (any strategy) loads. The tensors are "
        "streamed from the shards: no copy of the checkpoint in host RAM.",
    )
    parser.add_argument("src", help="sharded checkpoint directory, e.g. checkpoints/run/last.ckpt")
    parser.add_argument("out", help="the .ckpt file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    ns = parser.parse_args(list(argv))
    try:
        out = convert_to_file(ns.src, ns.out, overwrite=ns.overwrite)
    except (FileExistsError, ValueError) as err:
        parser.error(str(err))
    print(f"Converted {ns.src} to {out}")
    return 0


def main(args: Sequence[str] | None = None) -> int:
    """Entry point of the ``megatrain`` console script and of ``python -m lightning_megatrain``.

    Args:
        args: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status (0 on success).
    """
    argv = sys.argv[1:] if args is None else list(args)
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0") or DEBUG_FLAG in argv
    if DEBUG_FLAG in argv:
        argv = [arg for arg in argv if arg != DEBUG_FLAG]
        if args is None:  # LightningCLI warns when given args while sys.argv holds some: read sys.argv without it
            sys.argv = [sys.argv[0], *argv]
    quiet_lightning()
    try:
        if argv and argv[0] == "export":
            return export_main(argv[1:])
        if argv and argv[0] == "convert":
            return convert_main(argv[1:])
        if argv and argv[0] == "plan":
            return plan_main(argv[1:], prog=f"{PROG} plan")
        if argv and argv[0] == "dpo":  # preference optimisation: the same CLI over other classes
            argv = argv[1:]
            if args is None:
                sys.argv = [sys.argv[0], *argv]
            MegaTrainCLI(args=None if args is None else argv, model_class=DPOModule,
                         datamodule_class=PreferenceDataModule)
            return 0
        MegaTrainCLI(args=None if args is None else argv)
    except USER_ERRORS as err:
        if debug:
            raise
        print(user_error_message(err), file=sys.stderr)
        return 1
    return 0
