"""``DPOModule``: preference optimisation (DPO, IPO, SimPO, ORPO) of a HuggingFace causal LM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.data import DataLoader
from transformers import PretrainedConfig

from lightning_megatrain.models.causal_lm import TARGET_ROWS, CausalLMModule, _labels
from lightning_megatrain.models.document_spans import model_attention_mask
from lightning_megatrain.models.loss import IGNORE_INDEX
from lightning_megatrain.models.preference_loss import (
    LOSS_TYPES,
    REFERENCE_FREE,
    PreferenceLoss,
    default_beta,
    preference_loss,
)
from lightning_megatrain.models.reference import (
    PAIR_INDEX,
    REFERENCE_LOGPS,
    compute_reference,
    fingerprint,
    load_cache,
    save_cache,
)
from lightning_megatrain.models.sequence_logps import sequence_logps

REFERENCE_FINGERPRINTS = "reference_fingerprints"  # checkpoint key: split -> fingerprint() of the pairs of its table


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _zero_dropout(config: PretrainedConfig) -> None:
    """Set every dropout probability of ``config`` and of its text config (``attention_dropout``,
    ``hidden_dropout``, ``resid_pdrop``, ``embd_pdrop``, ...: numbers named ``*dropout*`` or ``*pdrop``) to 0."""
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        for name, value in part.to_dict().items():
            if ("dropout" in name or name.endswith("pdrop")) and _is_number(value) and value > 0:
                setattr(part, name, 0.0)


class DPOModule(CausalLMModule):
    """A causal LM trained on preference pairs: DPO (``loss_type="sigmoid"``), IPO, SimPO or ORPO.

    Batches are ``PreferenceDataModule``'s: ``input_ids``, ``attention_mask``, ``labels`` ``[2B, T]`` with the ``B``
    chosen sequences first and the ``B`` rejected ones after them (one forward for both), labels ``-100`` outside
    the responses, and ``pair_index`` ``[B]``. A right-padded batch runs without its attention mask (causal attention
    keeps real tokens from the padding after them, as in ``CausalLMModule``). The decoder runs once over the ``2B`` rows
    and each sequence's summed response log-probability comes from the chunked LM head (``models/sequence_logps.py``:
    no ``[2B, T, V]`` logits, the head's matmul once more than in SFT). The losses are in
    ``models/preference_loss.py``.

    The reference model of ``"sigmoid"`` and ``"ipo"`` is the policy's initial weights, with no second copy of them:
    its log-probabilities are computed once per run, before the first optimizer step, for every split of the
    datamodule's ``reference_dataloaders()``, through the strategy (MegaTrain streams the layers), and kept per pair
    (8 bytes each) in memory and in checkpoints ([Note: reference log-probabilities] in ``models/reference.py``).
    Batches that bring their own ``reference_logps`` ``[B, 2]`` (chosen, rejected) use those instead. ``"simpo"`` and
    ``"orpo"`` read no reference.

    Logged: ``train_loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``
    (means over the micro-batch's pairs), ``logps/chosen``, ``logps/rejected`` and ``train_tokens`` while training;
    ``val_loss`` and ``val_rewards/...`` (``test_...`` in ``test``) averaged over the held-out pairs. ``predict``
    returns per batch ``{"chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens", "pair_index"}``.

    Dropout is off by default (``disable_dropout``): the reference's log-probabilities are computed in eval mode, so
    a policy trained with dropout would differ from its reference before its first update, and dropout's noise
    enters both log-probabilities of every pair.

    Args:
        loss_type: ``"sigmoid"`` (DPO), ``"ipo"``, ``"simpo"`` or ``"orpo"`` (formulas in
            ``models/preference_loss.py``). Default ``"sigmoid"``.
        beta: DPO's and SimPO's inverse temperature, IPO's ``tau``, ORPO's weight of the odds-ratio term. Larger
            keeps DPO closer to the reference. Default ``None``: 2.0 for ``"simpo"``, 0.1 for the others
            (``preference_loss.default_beta``).
        label_smoothing: ``"sigmoid"``/``"simpo"``: the assumed probability that a pair's labels are flipped
            (conservative DPO), in [0, 0.5). Default 0.
        simpo_gamma: ``"simpo"``: the target reward margin ``gamma``. Default 0.5.
        reference_cache: ``"sigmoid"``/``"ipo"``: a file for the reference log-probabilities: read when it exists and
            matches the run's model (and the seed of a ``config`` model), precision and data (a mismatch is
            refused), else computed and written there (by global rank zero).
            Default ``None``: computed in every run (and kept in checkpoints).
        disable_dropout: Set every dropout probability of the model's config (``attention_dropout``,
            ``hidden_dropout``, ``resid_pdrop``, ...) and every ``nn.Dropout`` to 0, as TRL does. ``False`` keeps
            the model's dropout in training (the reference is still computed without it). Default ``True``.
        model, config, tokenizer, attn_implementation, experts_implementation, trust_remote_code, loss_chunk_size,
            learning_rate, weight_decay, betas, eps, warmup_steps, min_lr_ratio: as ``CausalLMModule``
            (``loss_chunk_size``: target tokens per chunk of the LM head).
    """

    def __init__(
        self,
        loss_type: str = "sigmoid",
        beta: float | None = None,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        reference_cache: str | None = None,
        disable_dropout: bool = True,
        **kwargs: Any,
    ) -> None:
        problems = []
        if loss_type not in LOSS_TYPES:
            problems.append(f"loss_type={loss_type!r}: must be one of {list(LOSS_TYPES)}")
        if not (beta is None or (_is_number(beta) and beta > 0)):
            problems.append(f"beta={beta!r}: must be a number > 0 (e.g. 0.1), or None for the loss's default")
        if not _is_number(simpo_gamma):
            problems.append(f"simpo_gamma={simpo_gamma!r}: must be a number (e.g. 0.5)")
        if not (reference_cache is None or isinstance(reference_cache, str)):
            problems.append(f"reference_cache={reference_cache!r}: must be a file path (a string) or None")
        if not isinstance(disable_dropout, bool):
            problems.append(f"disable_dropout={disable_dropout!r}: must be True or False")
        if not (_is_number(label_smoothing) and 0 <= label_smoothing < 0.5):
            problems.append(f"label_smoothing={label_smoothing!r}: must be in [0, 0.5) (0 disables it)")
        elif label_smoothing and loss_type not in ("sigmoid", "simpo"):
            problems.append(f"label_smoothing={label_smoothing!r}: applies to loss_type 'sigmoid' and 'simpo' only, "
                            f"not {loss_type!r}; set it to 0")
        if reference_cache is not None and loss_type in REFERENCE_FREE:
            problems.append(f"reference_cache={reference_cache!r}: loss_type={loss_type!r} reads no reference; "
                            "leave reference_cache unset")
        if problems:
            raise ValueError("DPOModule: invalid argument(s):\n  - " + "\n  - ".join(problems))
        super().__init__(**kwargs)
        self.beta = default_beta(loss_type) if beta is None else float(beta)
        self.reference_logps: dict[str, Tensor] = {}  # split -> [N, 2] (chosen, rejected), fp32 on the host
        self.reference_fingerprints: dict[str, str] = {}  # split -> reference.fingerprint() of its table's pairs
        self._checked_data: dict[str, Any] = {}  # split -> the dataset its table was checked against or computed on
        self._init_seed: int | None = None  # torch's seed when configure_model initialised a config= model
        self._computing_reference = False

    @property
    def needs_reference(self) -> bool:
        return self.hparams.loss_type not in REFERENCE_FREE

    def _resolve_config(self) -> PretrainedConfig:
        """:meth:`CausalLMModule._resolve_config`, with the dropout probabilities set to 0 (``disable_dropout``).

        Raises:
            ValueError: ``output_router_logits`` is on: the preference losses add no MoE router auxiliary loss.
        """
        config = super()._resolve_config()
        if getattr(config.get_text_config(), "output_router_logits", False):
            raise ValueError(
                f"DPOModule: output_router_logits=True in the {config.model_type} config, but the preference losses "
                "add no MoE router auxiliary loss (CausalLMModule's SFT loss does). HINT: set output_router_logits to "
                "false (config={..., 'output_router_logits': False} or in the model's config.json)."
            )
        if self.hparams.disable_dropout:
            _zero_dropout(config)
        return config

    def configure_model(self) -> None:
        """:meth:`CausalLMModule.configure_model`, recording the seed of a random init (a ``reference_cache`` key)
        and setting every ``nn.Dropout``'s ``p`` to 0 (``disable_dropout``)."""
        if self.model is None and self.hparams.config is not None:
            self._init_seed = torch.initial_seed()
        super().configure_model()
        if self.hparams.disable_dropout:
            for module in self.model.modules():
                if isinstance(module, _DropoutNd):
                    module.p = 0.0

    # -- the forward and the loss ---------------------------------------------------------------------------------

    def _sequence_logps(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Each row's summed response log-probability ``[2B]`` (fp32) and its target count ``[2B]``."""
        hidden = self._decoder()(
            input_ids=batch["input_ids"],
            attention_mask=model_attention_mask(batch),
            position_ids=batch.get("position_ids"),
            use_cache=False,
        ).last_hidden_state  # [2B, T, H]
        return sequence_logps(
            hidden,
            self._lm_head_weight(),
            _labels(batch),
            rows=batch.get(TARGET_ROWS),
            chunk_size=self.hparams.loss_chunk_size,
            softcap=getattr(self.model.config.get_text_config(), "final_logit_softcapping", None),
        )  # [2B], [2B]

    def _preference(self, batch: dict[str, Tensor]) -> tuple[PreferenceLoss, Tensor]:
        """The micro-batch's loss and rewards, and the policy's ``[B, 2]`` (chosen, rejected) log-probabilities."""
        rows = batch["input_ids"].shape[0]
        if rows % 2:
            raise ValueError(f"DPOModule: a batch has {rows} rows; it needs 2B (the B chosen sequences, then the B "
                             "rejected ones), as PreferenceDataModule's PairCollator makes them")
        logps, tokens = self._sequence_logps(batch)  # [2B], [2B]
        pairs = rows // 2
        reference = batch.get(REFERENCE_LOGPS)  # [B, 2] or None
        result = preference_loss(
            logps[:pairs], logps[pairs:], tokens[:pairs], tokens[pairs:],
            None if reference is None else reference[:, 0], None if reference is None else reference[:, 1],
            loss_type=self.hparams.loss_type, beta=self.beta,
            label_smoothing=self.hparams.label_smoothing, simpo_gamma=self.hparams.simpo_gamma,
        )
        return result, torch.stack([logps[:pairs], logps[pairs:]], dim=1).detach()

    def training_step(self, batch: dict[str, Tensor]) -> Tensor:
        result, logps = self._preference(batch)
        pairs = logps.shape[0]
        rows = batch.get(TARGET_ROWS)  # [N] from on_before_batch_transfer: counted without a device sync
        targets = rows.numel() if rows is not None else (_labels(batch)[:, 1:] != IGNORE_INDEX).sum()
        self.tokens_trained += int(targets)
        self.log("train_loss", result.loss, prog_bar=True, batch_size=pairs)
        self.log_dict(result.metrics(), batch_size=pairs)
        self.log_dict({"logps/chosen": logps[:, 0].mean(), "logps/rejected": logps[:, 1].mean()}, batch_size=pairs)
        self.log("train_tokens", torch.tensor(self.tokens_trained, dtype=torch.float64), batch_size=pairs)
        return result.loss

    def _eval_pairs(self, batch: dict[str, Tensor], prefix: str) -> None:
        result, logps = self._preference(batch)
        metrics = {f"{prefix}_loss": result.loss, **{f"{prefix}_{k}": v for k, v in result.metrics().items()}}
        self.log_dict(metrics, batch_size=logps.shape[0], on_epoch=True, prog_bar=False)

    def validation_step(self, batch: dict[str, Tensor]) -> None:
        self._eval_pairs(batch, "val")

    def on_validation_epoch_end(self) -> None:
        pass  # logged per step with on_epoch=True (a pair-weighted mean), not CausalLMModule's token-weighted NLL

    def test_step(self, batch: dict[str, Tensor]) -> None:
        self._eval_pairs(batch, "test")

    def on_test_epoch_end(self) -> None:
        pass

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Per pair: the policy's summed response log-probabilities and token counts, and ``pair_index``."""
        with torch.no_grad():
            logps, tokens = self._sequence_logps(batch)  # [2B], [2B]
        pairs = logps.shape[0] // 2
        output = {"chosen_logps": logps[:pairs], "rejected_logps": logps[pairs:], "chosen_tokens": tokens[:pairs],
                  "rejected_tokens": tokens[pairs:]}
        if PAIR_INDEX in batch:
            output[PAIR_INDEX] = batch[PAIR_INDEX]
        return output

    # -- the reference log-probabilities (see [Note: reference log-probabilities]) -------------------------------

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """:meth:`CausalLMModule.on_before_batch_transfer`, and each pair's reference log-probabilities looked up on
        the host (``reference_logps`` ``[B, 2]``) for ``"sigmoid"``/``"ipo"``.

        Raises:
            ValueError: The batch has no ``pair_index`` to look up, or no table exists for its split.
        """
        batch = super().on_before_batch_transfer(batch, dataloader_idx)
        trainer = self._trainer
        if (not self.needs_reference or self._computing_reference or not isinstance(batch, dict)
                or REFERENCE_LOGPS in batch or (trainer is not None and trainer.predicting)):
            return batch
        split = "train" if trainer is not None and trainer.training else "val"
        table = self.reference_logps.get(split)
        if table is None or PAIR_INDEX not in batch:
            raise ValueError(
                f"DPOModule(loss_type={self.hparams.loss_type!r}) has no reference log-probabilities for this "
                f"{split} batch: use a datamodule with reference_dataloaders() whose batches carry {PAIR_INDEX!r} "
                f"(PreferenceDataModule), give batches {REFERENCE_LOGPS!r} [B, 2], or use a loss_type that needs no "
                f"reference ({', '.join(REFERENCE_FREE)})"
            )
        return {**batch, REFERENCE_LOGPS: table[batch[PAIR_INDEX]]}

    def on_train_start(self) -> None:
        self._ensure_reference(every_split=True)

    def on_validation_start(self) -> None:
        # during fit: the sanity check runs before on_train_start, and every split is computed before any step
        self._ensure_reference(every_split=self.trainer.state.fn == TrainerFn.FITTING)

    def on_test_start(self) -> None:
        self._ensure_reference(every_split=False)

    def _ensure_reference(self, every_split: bool) -> None:
        """Fills the missing tables of the datamodule's splits (``every_split``, else ``"val"`` only) before the
        weights change: from ``reference_cache`` when it holds them, else by one pass through the strategy. A table
        restored from a checkpoint is first checked against its split's data (:meth:`_check_restored`).

        Raises:
            ValueError: A restored table was computed on other pairs than its split's.
        """
        datamodule = getattr(self.trainer, "datamodule", None)
        if not self.needs_reference or not hasattr(datamodule, "reference_dataloaders"):
            return  # batches must then bring reference_logps (on_before_batch_transfer says so)
        loaders = {split: loader for split, loader in datamodule.reference_dataloaders().items()
                   if every_split or split == "val"}
        fingerprints = {}
        for split, loader in loaders.items():
            if self._checked_data.get(split) is not loader.dataset:  # each split's pairs are hashed once per run
                fingerprints[split] = fingerprint(loader)
                self._check_restored(split, loader, fingerprints[split])
        loaders = {split: loader for split, loader in loaders.items() if split not in self.reference_logps}
        if not loaders:
            return
        path = Path(self.hparams.reference_cache).expanduser() if self.hparams.reference_cache else None
        key = {"model": self.hparams.model or json.dumps(self.hparams.config, sort_keys=True), "seed": self._init_seed,
               "precision": str(self.trainer.precision),
               "fingerprints": {split: fingerprints[split] for split in loaders}}
        missing = loaders
        if path is not None:
            cached = load_cache(path, key)
            self.reference_logps.update(cached)
            missing = {split: loader for split, loader in loaders.items() if split not in cached}
        if missing:
            self._computing_reference = True
            try:
                self.reference_logps.update(compute_reference(self, missing))
            finally:
                self._computing_reference = False
            if path is not None and self.trainer.is_global_zero:  # one writer; every rank computed the same tables
                save_cache(path, key, self.reference_logps)
        for split, loader in loaders.items():
            self.reference_fingerprints[split] = key["fingerprints"][split]
            self._checked_data[split] = loader.dataset

    def _check_restored(self, split: str, loader: DataLoader, data_fingerprint: str) -> None:
        """Refuse a table of ``split`` restored from a checkpoint whose pairs are not ``loader``'s, by count and by
        the fingerprint stored beside it; remember ``loader``'s dataset as checked."""
        table = self.reference_logps.get(split)
        if table is None:
            return
        if len(table) != len(loader.dataset):
            raise ValueError(
                f"DPOModule: the reference log-probabilities restored for the {split!r} split cover {len(table)} "
                f"pairs, the datamodule's {split!r} split has {len(loader.dataset)}: the data changed since the "
                "checkpoint was written; resume with the data it was trained on, or start a new run"
            )
        restored = self.reference_fingerprints.get(split)
        if restored is not None and restored != data_fingerprint:
            raise ValueError(
                f"DPOModule: the reference log-probabilities restored for the {split!r} split were computed on other "
                f"pairs (data fingerprint {restored[:12]}..., the datamodule's {data_fingerprint[:12]}...): the "
                "dataset, its seed or split, the tokenizer or cutoff_len changed since the checkpoint was written; "
                "resume with the data it was trained on, or start a new run"
            )
        self.reference_fingerprints[split] = data_fingerprint
        self._checked_data[split] = loader.dataset

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[REFERENCE_LOGPS] = dict(self.reference_logps)
        checkpoint[REFERENCE_FINGERPRINTS] = dict(self.reference_fingerprints)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference_logps = dict(checkpoint.get(REFERENCE_LOGPS, {}))
        self.reference_fingerprints = dict(checkpoint.get(REFERENCE_FINGERPRINTS, {}))
        self._checked_data = {}  # restored tables are checked against the data before use
