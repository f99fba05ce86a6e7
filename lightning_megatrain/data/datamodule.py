"""``SFTDataModule``: LLaMA-Factory-compatible SFT / pretraining data for Lightning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from lightning import LightningDataModule
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_megatrain.data.collate import PackedCollator, PadCollator, pack_examples
from lightning_megatrain.data.demo import DEMO_DIR, DEMO_TOKENIZER_DIR
from lightning_megatrain.data.encoding import (
    IGNORE_INDEX,
    Example,
    TemplateError,
    encode_pretrain_text,
    encode_sft,
)
from lightning_megatrain.data.formats import Conversation, convert_rows
from lightning_megatrain.data.readers import dataset_files, read_rows
from lightning_megatrain.data.registry import DatasetSpec, infer_spec, resolve_datasets
from lightning_megatrain.data.sampling import EpochShuffleSampler, ResumableLoader, sample_indices, split_indices
from lightning_megatrain.data.templates import resolve_chat_template

log = logging.getLogger(__name__)

MODES = ("sft", "pt")
MAX_REPORTED_SKIPS = 5  # reasons shown in the skip_bad_rows warning


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SFTDataModule(LightningDataModule):
    """Supervised fine-tuning (or pretraining) data in LLaMA-Factory's formats, tokenized with a chat template.

    ``setup()`` reads every file, converts rows to canonical ``{"role", "content"}`` conversations (raising one
    error that lists all malformed rows), splits train/val, tokenizes with the tokenizer's chat template and,
    with ``packing``, packs examples into rows. All of it happens before the first training step.

    Batches are dicts of ``LongTensor [B, T]``: ``input_ids``, ``labels`` (aligned with ``input_ids``, ``-100``
    where untrained; the model's loss shifts them) and either ``attention_mask`` (``packing=False``) or
    ``position_ids`` restarting at 0 for each packed sequence (``packing=True``, no ``attention_mask``: the
    model must then be called with ``use_cache=False`` so transformers isolates the sequences).

    Evaluation data: as in LLaMA-Factory, where ``val_size`` carves the one evaluation split out of the training data
    and ``do_predict`` runs on it, there is no separate test split. ``val_dataloader``, ``test_dataloader`` and
    ``predict_dataloader`` all serve the held-out ``val_size`` rows, in a fixed order (no shuffling), so ``validate``
    and ``test`` of the same checkpoint give the same loss. ``test``/``predict`` with no held-out rows raise a
    ``ValueError`` in ``setup``.

    Args:
        dataset: Dataset name registered in ``dataset_dir/dataset_info.json``, a path to a local
            json/jsonl/csv/parquet file (format inferred from its columns), or several of either separated by
            commas (concatenated). Default ``"demo_alpaca"`` (bundled). Other demo sets: ``demo_sharegpt``,
            ``demo_messages``.
        dataset_dir: Folder holding ``dataset_info.json`` (LLaMA-Factory layout; ``file_name`` entries are
            relative to it). Default ``None``: the bundled demo folder. Only read for registered names.
        tokenizer: Local tokenizer folder loadable by ``AutoTokenizer.from_pretrained`` (no hub access). Must have
            a chat template for ``mode="sft"``. Default ``None``: the bundled demo tokenizer (vocab 1024).
        template: The chat template to encode with instead of the tokenizer's default: a path to a Jinja file
            (e.g. ``my_template.jinja``) or the name of one of the tokenizer's named templates. Templates that
            rewrite earlier turns (Qwen3, DeepSeek-R1, gpt-oss) are handled: each assistant turn becomes its own
            sequence (see docs/data.md#chat-templates). Default ``None``: the tokenizer's template.
        mode: ``"sft"`` trains on assistant turns of chat conversations; ``"pt"`` (pretraining) tokenizes the
            prompt / first message of each row as ``bos + text + eos``, trains every token and splits long texts
            into ``cutoff_len`` chunks instead of truncating. Default ``"sft"``.
        cutoff_len: Maximum tokens per example (SFT examples are truncated at the end; with ``packing`` it is
            also the packed row length). Larger keeps more context but costs activation memory. Default 1024.
        train_on_prompt: Also train on system/user/template tokens instead of only assistant turns. More
            tokens contribute to the loss, but the model also learns to imitate prompts. Default ``False``.
        packing: Pack several examples into each row of ``cutoff_len`` tokens (best-fit decreasing) with
            per-sequence ``position_ids`` and no ``attention_mask``. Removes padding waste (faster); the model's
            attention keeps the sequences apart: ``CausalLMModule``'s default ``packed_sdpa`` per sequence without a
            mask, ``sdpa``/``eager`` over a dense ``[B, 1, T, T]`` mask (refused from 1 GiB), flash-attention
            kernels only with ``micro_batch_size=1`` (see docs/data.md#packing). Default ``False``.
        micro_batch_size: Rows per batch (per optimizer micro-step). Larger uses more activation memory.
            Default 1.
        val_size: Held-out validation share: a float in [0, 1) is a fraction of the rows, an int >= 0 a row
            count. 0 disables validation (``val_dataloader`` returns an empty list). The same rows are the test and
            predict data, so ``test``/``predict`` need it > 0. Default 0.
        num_workers: DataLoader worker processes (0: collate in the main process). Collation is cheap, so 0-2
            is usually enough. Default 0.
        seed: Seed of the ``num_samples`` row choice, of the train/val split and of the per-epoch shuffle (the
            order of epoch ``e`` is seeded by ``seed + e``, so it is reproducible and survives resuming). Default 42.
        system: System prompt inserted into conversations that bring none of their own (a system message in the
            row, or the dataset's system column, wins). Default ``None``: no system prompt.
        pad_to_multiple_of: Round each batch's padded length up to a multiple of this (e.g. 8 or 64 for
            tensor-core-friendly shapes, at the cost of a few padding tokens). Default ``None``: pad to the
            longest row of the batch.
        skip_bad_rows: Drop malformed rows (rows that do not convert to a conversation, non-object rows, .jsonl
            lines that are not JSON) instead of raising; one warning gives the count and the first reasons.
            A file that cannot be parsed at all still raises. Default ``False``: any malformed row is an error.
    """

    def __init__(
        self,
        dataset: str = "demo_alpaca",
        dataset_dir: str | None = None,
        tokenizer: str | None = None,
        template: str | None = None,
        mode: Literal["sft", "pt"] = "sft",
        cutoff_len: int = 1024,
        train_on_prompt: bool = False,
        packing: bool = False,
        micro_batch_size: int = 1,
        val_size: int | float = 0,
        num_workers: int = 0,
        seed: int = 42,
        system: str | None = None,
        pad_to_multiple_of: int | None = None,
        skip_bad_rows: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.dataset_dir = Path(dataset_dir).expanduser() if dataset_dir is not None else DEMO_DIR
        self.tokenizer_path = Path(tokenizer).expanduser() if tokenizer is not None else DEMO_TOKENIZER_DIR
        self.template = template
        self.mode = mode
        self.cutoff_len = cutoff_len
        self.train_on_prompt = train_on_prompt
        self.packing = packing
        self.micro_batch_size = micro_batch_size
        self.val_size = val_size
        self.num_workers = num_workers
        self.seed = seed
        self.system = system
        self.pad_to_multiple_of = pad_to_multiple_of
        self.skip_bad_rows = skip_bad_rows

        problems = self._argument_problems()
        specs: list[DatasetSpec] = []
        if isinstance(dataset, str):
            specs, dataset_problems = resolve_datasets(dataset, self.dataset_dir)
            problems += dataset_problems + [problem for problem in map(self._kind_problem, specs) if problem]
        else:
            problems.append(f"dataset={dataset!r}: must be a string (names and/or file paths, comma-separated)")
        self.tokenizer: PreTrainedTokenizerBase | None = self._load_tokenizer(problems)
        _raise_problems(problems, type(self).__name__)
        self.specs = specs
        self.pad_token_id: int = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )
        collator = PackedCollator if packing else PadCollator
        self.collator = collator(self.pad_token_id, pad_to_multiple_of)
        self.train_dataset: list[Example] | list[list[Example]] | None = None
        self._logged_per_turn = False  # the per-turn fallback is logged once, with its first reason
        self.val_dataset: list[Example] | list[list[Example]] | None = None

    def _kind_problem(self, spec: DatasetSpec) -> str | None:
        """Why ``spec`` cannot be trained by this datamodule (a preference dataset here), else ``None``."""
        if not spec.ranking:
            return None
        return (f"dataset={spec.name!r} is a preference dataset ('ranking': true, chosen/rejected responses), which "
                "SFTDataModule does not read; train it with `megatrain dpo` (PreferenceDataModule and DPOModule, "
                "docs/dpo.md), or register it without 'ranking' and with a response column")

    def _chat_template_hint(self) -> str:
        """Who needs a chat template and how to give one, for a tokenizer without it."""
        return ("which mode='sft' needs; add one to tokenizer_config.json, pass template (a .jinja file), or use "
                "mode='pt'")

    def _argument_problems(self) -> list[str]:
        """Every problem with the scalar arguments (``dataset``/``tokenizer`` are checked separately)."""
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode={self.mode!r}: must be one of {list(MODES)}")
        if not _is_int(self.cutoff_len) or self.cutoff_len < 2:
            problems.append(f"cutoff_len={self.cutoff_len!r}: must be an int >= 2 (e.g. 1024)")
        for name in ("train_on_prompt", "packing", "skip_bad_rows"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r}: must be True or False")
        if not _is_int(self.micro_batch_size) or self.micro_batch_size < 1:
            problems.append(f"micro_batch_size={self.micro_batch_size!r}: must be an int >= 1")
        if isinstance(self.val_size, float):
            if not 0.0 <= self.val_size < 1.0:
                problems.append(f"val_size={self.val_size!r}: a float is a fraction and must be in [0, 1); "
                                "pass an int for a row count")
        elif not _is_int(self.val_size) or self.val_size < 0:
            problems.append(f"val_size={self.val_size!r}: must be a float fraction in [0, 1) or an int count >= 0")
        if not _is_int(self.num_workers) or self.num_workers < 0:
            problems.append(f"num_workers={self.num_workers!r}: must be an int >= 0")
        if not _is_int(self.seed):
            problems.append(f"seed={self.seed!r}: must be an int")
        if self.system is not None and not isinstance(self.system, str):
            problems.append(f"system={self.system!r}: must be a string or None")
        multiple = self.pad_to_multiple_of
        if multiple is not None and (not _is_int(multiple) or multiple < 1):
            problems.append(f"pad_to_multiple_of={self.pad_to_multiple_of!r}: must be None or an int >= 1 (e.g. 8)")
        return problems

    def _load_tokenizer(self, problems: list[str]) -> PreTrainedTokenizerBase | None:
        """Load the tokenizer offline, appending any problem (unloadable, no chat template, no pad/eos token)."""
        where = f"tokenizer={str(self.tokenizer_path)!r}"
        if not self.tokenizer_path.is_dir():
            problems.append(f"{where}: not a folder; pass a local tokenizer folder (hub names are not fetched)")
            return None
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        except Exception as err:  # transformers raises OSError/ValueError/KeyError depending on what is missing
            problems.append(f"{where}: AutoTokenizer.from_pretrained failed ({err})")
            return None
        if self.template is not None and not isinstance(self.template, str):
            problems.append(f"template={self.template!r}: must be a path to a .jinja file or a template name")
        elif self.template is not None:
            try:
                tokenizer.chat_template = resolve_chat_template(tokenizer, self.template)
            except ValueError as err:
                problems.append(str(err))
        if self.mode == "sft" and not tokenizer.chat_template:
            problems.append(f"{where}: has no chat_template, {self._chat_template_hint()}")
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
            problems.append(f"{where}: defines neither a pad nor an eos token to pad with; set pad_token")
        return tokenizer

    def _conversations(self) -> list[tuple[Conversation, str]]:
        """Read and convert every dataset file; each conversation comes with its origin for error messages."""
        conversations = []
        skipped: list[str] | None = [] if self.skip_bad_rows else None
        kept = 0
        for spec in self.specs:
            dataset_conversations = []
            for file in dataset_files(spec.path):
                rows = read_rows(file, skipped)
                if not rows:
                    log.warning("Dataset '%s': %s has no rows", spec.name, file)
                    continue
                file_spec = spec if spec.formatting is not None else infer_spec(spec, rows[0])
                if (problem := self._kind_problem(file_spec)) is not None:
                    raise ValueError(f"{problem} (file {file})")
                converted = convert_rows(
                    rows, file_spec, file, default_system=self.system, mode=self.mode, skipped=skipped
                )
                kept += len(converted)
                origin = f"dataset '{spec.name}', file {file}"
                dataset_conversations += [(conv, f"{origin}, row {index}") for index, conv in enumerate(converted)]
                log.info("Dataset '%s': %d rows from %s", spec.name, len(rows), file)
            if spec.num_samples is not None and dataset_conversations:
                indices = sample_indices(len(dataset_conversations), spec.num_samples, self.seed)
                log.info("Dataset '%s': num_samples=%d of %d rows (seed=%d)", spec.name, spec.num_samples,
                         len(dataset_conversations), self.seed)
                dataset_conversations = [dataset_conversations[index] for index in indices]
            conversations += dataset_conversations
        if skipped:
            shown = "\n  ".join(skipped[:MAX_REPORTED_SKIPS])
            log.warning("skip_bad_rows=True: skipped %d malformed row(s) (%d kept); the first %d:\n  %s",
                        len(skipped), kept, min(len(skipped), MAX_REPORTED_SKIPS), shown)
        return conversations

    def _encode(self, conversations: list[tuple[Conversation, str]]) -> list[Example]:
        """Tokenize conversations; SFT examples left with nothing to train after truncation are dropped."""
        examples: list[Example] = []
        dropped = 0
        for conversation, origin in conversations:
            if self.mode == "pt":
                examples += encode_pretrain_text(self.tokenizer, conversation.messages[0]["content"], self.cutoff_len)
                continue
            try:
                encoded, per_turn = encode_sft(self.tokenizer, conversation, self.cutoff_len, self.train_on_prompt)
            except TemplateError as err:
                raise TemplateError(f"{origin}: {err}") from err
            if per_turn is not None and not self._logged_per_turn:
                self._logged_per_turn = True
                log.info("Encoding each assistant turn as its own sequence (in the context the template gives it "
                         "at inference) where a conversation needs it; first at %s: %s", origin, per_turn)
            turns = max(1, sum(m["role"] == "assistant" for m in conversation.messages)) if per_turn else 1
            dropped += turns - len(encoded)
            examples += encoded
        if self.mode == "sft" and dropped:
            log.warning("Dropped %d example(s) with no trained token left after truncation to cutoff_len=%d",
                        dropped, self.cutoff_len)
        return examples

    def _finalize(self, examples: list[Example], split: str) -> list[Example] | list[list[Example]]:
        """Pack (if enabled) and log token statistics for one split."""
        tokens = sum(len(example) for example in examples)
        trained = sum(label != IGNORE_INDEX for example in examples for label in example.labels[1:])  # targets
        if not self.packing:
            log.info("%s: %d examples, %d tokens (%d trained)", split, len(examples), tokens, trained)
            return examples
        rows = pack_examples(examples, self.cutoff_len)
        log.info("%s: %d examples packed into %d rows of %d tokens (%.1f%% filled), %d trained tokens",
                 split, len(examples), len(rows), self.cutoff_len,
                 100.0 * tokens / max(1, len(rows) * self.cutoff_len), trained)
        return rows

    def setup(self, stage: str | None = None) -> None:
        """Read, validate, split, tokenize and (optionally) pack all data. Idempotent.

        Args:
            stage: Lightning stage (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``); all stages share the same
                data.

        Raises:
            DatasetFormatError: A file has malformed rows (all listed, with file and row index).
            TemplateError: The chat template cannot be masked exactly (names the dataset row).
            ValueError: A file cannot be read, its format cannot be inferred, ``val_size`` leaves no
                training data, or ``stage`` is ``"test"``/``"predict"`` and no row is held out.
        """
        if self.train_dataset is None:
            self._prepare()
        stage = getattr(stage, "value", stage)  # Lightning passes a str-valued TrainerFn
        if stage in ("test", "predict"):
            self._check_held_out(stage)

    def _prepare(self) -> None:
        """Build ``train_dataset`` and ``val_dataset`` (the body of ``setup``)."""
        conversations = self._conversations()
        if not conversations:
            raise ValueError(f"dataset={self.hparams.dataset!r}: no rows found")
        train_index, val_index = split_indices(len(conversations), self.val_size, self.seed)
        log.info("Split %d rows into %d train / %d val (val_size=%r, seed=%d)", len(conversations),
                 len(train_index), len(val_index), self.val_size, self.seed)
        train = self._encode([conversations[index] for index in train_index])
        if not train:
            raise ValueError(f"cutoff_len={self.cutoff_len}: every training example was dropped by truncation; "
                             "raise cutoff_len")
        val = self._encode([conversations[index] for index in val_index])
        self.train_dataset = self._finalize(train, "train")
        self.val_dataset = self._finalize(val, "val")

    def _loader(self, items: list[Any], shuffle: bool) -> DataLoader:
        return (ResumableLoader if shuffle else DataLoader)(
            items,
            batch_size=self.micro_batch_size,
            sampler=EpochShuffleSampler(len(items), self.seed) if shuffle else None,
            collate_fn=self.collator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (order seeded by ``seed + epoch``), resumable mid-epoch (``ResumableLoader``)."""
        if self.train_dataset is None:
            raise RuntimeError("SFTDataModule.setup() must run before train_dataloader()")
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in fixed order, or an empty list when ``val_size`` held nothing out."""
        if self.val_dataset is None:
            raise RuntimeError("SFTDataModule.setup() must run before val_dataloader()")
        return self._loader(self.val_dataset, shuffle=False) if self.val_dataset else []

    def test_dataloader(self) -> DataLoader:
        """The held-out (``val_size``) batches in fixed order, as ``val_dataloader``."""
        return self._held_out_loader("test")

    def predict_dataloader(self) -> DataLoader:
        """The held-out (``val_size``) batches in fixed order (row ``i`` of the output is ``val_dataset[i]``)."""
        return self._held_out_loader("predict")

    def _held_out_loader(self, stage: str) -> DataLoader:
        if self.val_dataset is None:
            raise RuntimeError(f"SFTDataModule.setup() must run before {stage}_dataloader()")
        self._check_held_out(stage)
        return self._loader(self.val_dataset, shuffle=False)

    def _check_held_out(self, stage: str) -> None:
        """``test``/``predict`` run on the held-out rows; refuse an empty split with the usual argument error."""
        if not self.val_dataset:
            problem = (f"val_size={self.val_size!r}: {stage} runs on the held-out rows, but none are held out (or all "
                       "were dropped by truncation); set val_size > 0, e.g. 0.05 or 200")
            _raise_problems([problem], type(self).__name__)


def _raise_problems(problems: list[str], owner: str = "SFTDataModule") -> None:
    """One ``ValueError`` listing every problem (no-op without problems)."""
    if problems:
        listing = "\n  - ".join(problems)
        raise ValueError(f"{owner}: {len(problems)} invalid argument(s):\n  - {listing}")
