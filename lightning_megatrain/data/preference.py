"""``PreferenceDataModule``: LLaMA-Factory's pairwise (``ranking: true``) datasets for ``DPOModule``."""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import DataLoader

from lightning_megatrain.data.collate import PairCollator
from lightning_megatrain.data.datamodule import SFTDataModule
from lightning_megatrain.data.encoding import IGNORE_INDEX, PairExample, TemplateError, encode_pair
from lightning_megatrain.data.formats import PreferencePair
from lightning_megatrain.data.registry import DatasetSpec

log = logging.getLogger(__name__)


class PreferenceDataModule(SFTDataModule):
    """Preference pairs in LLaMA-Factory's formats, tokenized with a chat template, for ``DPOModule``.

    Each row holds a prompt and two responses, ``chosen`` (preferred) and ``rejected``. Datasets are registered in
    ``dataset_info.json`` with ``"ranking": true`` (or given as files whose rows have ``chosen`` and ``rejected``
    columns):

    - alpaca: ``{"instruction": ..., "input": ..., "chosen": "...", "rejected": "...", "system": ..., "history":
      [[q, a], ...]}``; columns ``prompt``, ``query``, ``chosen``, ``rejected``, ``system``, ``history``.
    - sharegpt: ``{"conversations": [... ending with a user turn], "chosen": {"from": "gpt", "value": ...},
      "rejected": {"from": "gpt", "value": ...}}``; columns ``messages``, ``chosen``, ``rejected``, ``system``,
      ``tools``, and the usual ``tags``.

    Each response is encoded after ``render(prompt, add_generation_prompt=True)``, as the template renders it when it
    is the last message; only its tokens (content and end of turn) are trained, so both sequences of a pair share
    their prompt tokens. A pair either of whose responses has no trained token left after truncation to
    ``cutoff_len`` is dropped with a warning.

    Batches (``PairCollator``): ``input_ids``, ``attention_mask``, ``labels`` ``[2B, T]``, the ``B`` chosen sequences
    first and the ``B`` rejected ones after them, so that both run in one forward, and ``pair_index`` ``[B]``, each
    pair's position in its split (the key of its reference log-probabilities). :meth:`reference_dataloaders` serves
    every split in order, for ``DPOModule`` to compute those once.

    Args:
        dataset: Preference dataset names registered in ``dataset_dir/dataset_info.json`` and/or file paths,
            comma-separated. Default ``"demo_dpo_alpaca"`` (bundled; also ``demo_dpo_sharegpt``).
        dataset_dir: Folder holding ``dataset_info.json``. Default ``None``: the bundled demo folder.
        tokenizer: Local tokenizer folder with a chat template. Default ``None``: the bundled demo tokenizer.
        template: A ``.jinja`` file or a name of the tokenizer's templates to encode with instead of its default.
        cutoff_len: Maximum tokens per sequence (prompt and one response; the tail is cut). Default 1024.
        micro_batch_size: Pairs per micro-batch; the forward runs ``2 * micro_batch_size`` rows. Default 1.
        val_size: Held-out pairs: a float in [0, 1) is a fraction, an int a count; their DPO loss and rewards are
            ``val_*`` metrics, and they are the data of ``test`` and ``predict``. Default 0.
        num_workers: DataLoader worker processes. Default 0.
        seed: Seed of ``num_samples``, of the split and of each epoch's shuffle (``seed + epoch``). Default 42.
        system: System prompt for prompts that bring none. Default ``None``.
        pad_to_multiple_of: Round each batch's padded length up to a multiple of this. Default ``None``.
        skip_bad_rows: Drop malformed rows with one warning instead of raising. Default ``False``.
    """

    def __init__(
        self,
        dataset: str = "demo_dpo_alpaca",
        dataset_dir: str | None = None,
        tokenizer: str | None = None,
        template: str | None = None,
        cutoff_len: int = 1024,
        micro_batch_size: int = 1,
        val_size: int | float = 0,
        num_workers: int = 0,
        seed: int = 42,
        system: str | None = None,
        pad_to_multiple_of: int | None = None,
        skip_bad_rows: bool = False,
    ) -> None:
        super().__init__(
            dataset=dataset, dataset_dir=dataset_dir, tokenizer=tokenizer, template=template, mode="sft",
            cutoff_len=cutoff_len, train_on_prompt=False, packing=False, micro_batch_size=micro_batch_size,
            val_size=val_size, num_workers=num_workers, seed=seed, system=system,
            pad_to_multiple_of=pad_to_multiple_of, skip_bad_rows=skip_bad_rows,
        )
        self.collator = PairCollator(self.pad_token_id, pad_to_multiple_of)

    def _kind_problem(self, spec: DatasetSpec) -> str | None:
        if spec.ranking or spec.formatting is None:  # an ad-hoc file is checked once its first row is read
            return None
        return (f"dataset={spec.name!r} is not a preference dataset: PreferenceDataModule reads rows with a prompt "
                "and 'chosen'/'rejected' responses, registered with 'ranking': true in dataset_info.json "
                "(docs/dpo.md); train an SFT dataset with `megatrain fit`")

    def _chat_template_hint(self) -> str:
        return ("which PreferenceDataModule needs to render each prompt and response; add one to "
                "tokenizer_config.json or pass template (a .jinja file)")

    def _encode(self, pairs: list[tuple[Any, str]]) -> list[PairExample]:
        """Tokenize pairs (``PairExample.index`` counts the kept ones); pairs a truncation empties are dropped."""
        examples: list[PairExample] = []
        for pair, origin in pairs:
            assert isinstance(pair, PreferencePair)
            try:
                example = encode_pair(self.tokenizer, pair, self.cutoff_len, index=len(examples))
            except TemplateError as err:
                raise TemplateError(f"{origin}: {err}") from err
            if example is not None:
                examples.append(example)
        if len(examples) < len(pairs):
            log.warning("Dropped %d pair(s) with a response left without a trained token after truncation to "
                        "cutoff_len=%d", len(pairs) - len(examples), self.cutoff_len)
        return examples

    def _finalize(self, examples: list[PairExample], split: str) -> list[PairExample]:
        tokens = sum(len(example) for example in examples)
        trained = sum(label != IGNORE_INDEX for example in examples
                      for sequence in (example.chosen, example.rejected) for label in sequence.labels[1:])
        log.info("%s: %d pairs, %d tokens (%d trained)", split, len(examples), tokens, trained)
        return examples

    def reference_dataloaders(self) -> dict[str, DataLoader]:
        """Every split's pairs in order (``"train"``, and ``"val"`` when pairs are held out), for reference
        log-probabilities computed once before training (``DPOModule``)."""
        if self.train_dataset is None:
            raise RuntimeError("PreferenceDataModule.setup() must run before reference_dataloaders()")
        splits = {"train": self.train_dataset, "val": self.val_dataset}
        return {split: self._loader(pairs, shuffle=False) for split, pairs in splits.items() if pairs}
