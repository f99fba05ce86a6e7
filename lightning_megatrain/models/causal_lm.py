"""LightningModule that trains a HuggingFace causal LM with the chunked next-token loss."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_megatrain.models.document_spans import (
    model_attention_mask,
    transfer_binding_spans,
    without_padding_mask,
)
from lightning_megatrain.models.hf_forms import RouterAux, router_aux, router_aux_loss
from lightning_megatrain.models.loss import IGNORE_INDEX, causal_lm_loss, target_rows
from lightning_megatrain.models.packed_attention import (
    AUTO,
    apply_auto,
    hf_attn_implementation,
    is_packed,
    packed_batch_problem,
)
from lightning_megatrain.models.schedule import adamw_warmup_cosine
from lightning_megatrain.models.schedule import warmup_cosine_factor as warmup_cosine_factor  # importable from here
from lightning_megatrain.models.token_mean import TokenMean

# Lightning warns whenever a LightningModule overriding on_before_batch_transfer is fitted with a LightningDataModule,
# even one that does not override it (SFTDataModule): the module's hook is the one meant to run.
warnings.filterwarnings(
    "ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"
)

# Config attributes of heads that rescale logits beyond soft-capping; the chunked loss does
# not reproduce them, so such models are refused instead of being trained on a wrong loss.
_UNSUPPORTED_LOGIT_SCALES = {"logit_scale": None, "logits_scaling": 1.0, "output_multiplier": 1.0}


TARGET_ROWS = "target_rows"  # batch key of the loss's host-computed target positions ([N], see loss.target_rows)


def _labels(batch: dict[str, Tensor]) -> Tensor:
    """``[B, T]`` labels: the batch's own, or ``input_ids`` with padding set to ``IGNORE_INDEX``."""
    labels = batch.get("labels")
    if labels is not None:
        return labels
    attention_mask = batch.get("attention_mask")
    input_ids = batch["input_ids"]
    return input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)


class CausalLMModule(LightningModule):
    """Causal language model (any ``AutoModelForCausalLM``) trained on next-token prediction.

    The HuggingFace model is created in ``configure_model`` so that the strategy's
    initialisation context applies; master weights are always fp32. The loss runs the decoder
    body for the last hidden states and applies the LM head chunk by chunk, so ``[B, T, V]``
    logits are never materialised. Batches are dicts with ``input_ids`` ``[B, T]`` and optional
    ``attention_mask``, ``labels`` (default: ``input_ids`` with padding set to -100) and
    ``position_ids``; label -100 is ignored. ``tokens_trained`` counts the target tokens of all
    training steps (saved in checkpoints) and is logged as ``train_tokens``.

    MoE router loss: with ``output_router_logits`` on in the config (e.g. ``config={"model_type":
    "mixtral", ..., "output_router_logits": True}``) training adds the router auxiliary loss as
    the model's own forward adds it with labels (HF's load-balancing loss of the router logits,
    times ``router_aux_loss_coef``; see ``models/hf_loss.py``), with its gradient through the
    routers under any strategy. ``train_loss`` is that sum; the unweighted router loss is logged
    as ``train_aux_loss``. Evaluation and prediction report the next-token NLL alone.

    Evaluation: ``validate`` logs ``val_loss`` / ``val_ppl`` and ``test`` logs ``test_loss`` /
    ``test_ppl``, the target-token-weighted mean NLL over the whole dataloader and its ``exp``.
    ``predict`` returns, per batch, ``{"loss": [B], "tokens": [B]}``: each row's mean NLL over
    its target tokens (labels other than -100 after the first position; 0 for a row without
    any) and that token count. With packed rows a row holds several sequences.

    Args:
        model: Local directory or Hub name of a pretrained model loaded with
            ``from_pretrained``. Exactly one of ``model`` and ``config`` is required.
        config: Architecture for random initialisation, e.g. ``{"model_type": "llama",
            "hidden_size": 64, "num_hidden_layers": 2}``; keys other than ``model_type`` are
            config attributes. Exactly one of ``model`` and ``config`` is required.
        tokenizer: Tokenizer directory or Hub name saved with exported checkpoints; defaults to
            ``model``. With only ``config`` and no tokenizer, exports contain no tokenizer.
        attn_implementation: HuggingFace attention backend. ``"auto"`` (default): transformers'
            own choice ("sdpa", or "eager" for architectures without it, e.g. Gemma 2 and
            gpt-oss in 5.24), with "sdpa" replaced by ``"packed_sdpa"``: the same SDPA kernels,
            run per document on packed rows instead of over a dense ``[B, 1, T, T]`` mask (see
            [Note: packed attention] in ``packed_attention.py``). Or any transformers name
            ("sdpa", "eager", "flex_attention", "flash_attention_2", ...); packed rows whose
            dense mask would take 1 GiB or more (T >= 32K at one row) are refused under "sdpa"
            and "eager", and packed batches of several rows under "flash_attention_*", which
            would let their documents attend to each other.
        experts_implementation: MoE models' experts backend in transformers 5 (``"eager"``: a loop over the experts
            that have tokens; ``"grouped_mm"``, ``"batched_mm"``, ...). Default ``None``: transformers' choice
            (``grouped_mm`` where torch has it). gpt-oss with ``grouped_mm`` in compiled layers ended in a
            device-side assert through the strategy on the H200, so ``compile_layers="auto"`` leaves it uncompiled,
            where it trains 2x faster than ``"eager"`` experts (docs/scale.md, "Against the truncated runs").
        trust_remote_code: Allow custom modelling code from the model repository.
        loss_chunk_size: Target tokens per chunk of the LM-head loss; bounds the loss's extra
            memory to a few ``[loss_chunk_size, vocab_size]`` fp32 buffers.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay for matrices; biases and 1-D parameters get none.
        betas: AdamW beta coefficients.
        eps: AdamW epsilon.
        warmup_steps: Optimizer steps of linear warmup before the cosine decay.
        min_lr_ratio: Final learning rate of the cosine decay, as a fraction of
            ``learning_rate``.
    """

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        tokenizer: str | None = None,
        attn_implementation: str = AUTO,
        experts_implementation: str | None = None,
        trust_remote_code: bool = False,
        loss_chunk_size: int = 4096,
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if (model is None) == (config is None):
            raise ValueError(
                "CausalLMModule needs exactly one of `model` (pretrained path or Hub name) and "
                f"`config` (architecture dict for random init); got model={model!r}, "
                f"config={config!r}. Pass one of them."
            )
        if loss_chunk_size < 1:
            raise ValueError(
                f"loss_chunk_size must be a positive integer, got {loss_chunk_size}; "
                "use e.g. 4096."
            )
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}.")
        self.save_hyperparameters()
        self.hf_config = self._resolve_config()
        self.model: PreTrainedModel | None = None
        self.router_aux: RouterAux | None = None  # the MoE router loss training adds, set by configure_model
        self.val_loss_mean = TokenMean()
        self.test_loss_mean = TokenMean()
        self.tokens_trained = 0

    def _resolve_config(self) -> PretrainedConfig:
        """Loads or builds the HF config, disables the KV cache and rejects unsupported heads."""
        hp = self.hparams
        if hp.model is not None:
            config = AutoConfig.from_pretrained(hp.model, trust_remote_code=hp.trust_remote_code)
        else:
            if "model_type" not in hp.config:
                raise ValueError(
                    f"config needs a 'model_type' key (e.g. 'llama'), got keys {sorted(hp.config)}."
                )
            kwargs = dict(hp.config)
            config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        text_config = config.get_text_config()
        config.use_cache = False
        text_config.use_cache = False
        for name, neutral in _UNSUPPORTED_LOGIT_SCALES.items():
            value = getattr(text_config, name, neutral)
            if value != neutral:
                raise ValueError(
                    f"{config.model_type} rescales its logits ({name}={value}), which the chunked "
                    "loss does not reproduce; only plain and soft-capped LM heads are supported."
                )
        return config

    def configure_model(self) -> None:
        """Creates the HF model (fp32 masters) once, inside the strategy's init context.

        Raises:
            ValueError: ``output_router_logits`` is on and the model's forward adds its router auxiliary loss in a
                form this module does not reproduce (see ``models/hf_loss.py``, [Note: HF loss]).
        """
        if self.model is not None:
            return
        hp = self.hparams
        kwargs = {
            "dtype": torch.float32,
            "attn_implementation": hf_attn_implementation(hp.attn_implementation),
            "trust_remote_code": hp.trust_remote_code,
        }
        if hp.experts_implementation is not None:  # else transformers' own choice, as before the option
            kwargs["experts_implementation"] = hp.experts_implementation
        if hp.model is not None:
            self.model = AutoModelForCausalLM.from_pretrained(
                hp.model, config=self.hf_config, **kwargs
            )
        else:
            self.model = AutoModelForCausalLM.from_config(self.hf_config, **kwargs)
        apply_auto(self.model, hp.attn_implementation)
        if getattr(self.hf_config.get_text_config(), "output_router_logits", False):
            aux = router_aux(type(self.model))
            if isinstance(aux, str):
                raise ValueError(
                    f"output_router_logits=True in the {self.hf_config.model_type} config: CausalLMModule adds the "
                    f"MoE router auxiliary loss as {type(self.model).__name__}.forward does, but cannot read which "
                    f"loss that forward adds: {aux}. HINT: set output_router_logits to false (config={{..., "
                    "'output_router_logits': False} or in the model's config.json), or train with a LightningModule "
                    "that calls the model with labels."
                )
            self.router_aux = aux

    def _decoder(self) -> nn.Module:
        """The base model under the LM head; returns last hidden states (after the final norm)."""
        decoder = self.model.get_decoder()
        if decoder is self.model:
            raise ValueError(
                f"{type(self.model).__name__}.get_decoder() returned the model itself, so its "
                "body cannot be run without the LM head; this architecture is not supported."
            )
        return decoder

    def _lm_head_weight(self) -> Tensor:
        """The ``[V, H]`` LM head weight, looked up per call (strategies may swap it)."""
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(
                f"{type(self.model).__name__} has an LM head bias, which the chunked loss does "
                "not support."
            )
        return head.weight

    def _loss(
        self, batch: dict[str, Tensor], reduction: Literal["mean", "none"] = "mean"
    ) -> tuple[Tensor, Tensor | int]:
        """Next-token loss of a batch and its number of target tokens.

        ``"mean"``: the mean loss ``[]`` and the token count (``[]``, or an ``int`` from the batch's
        host-computed ``target_rows``); ``"none"`` (no gradients):
        the per-token losses ``[B, T]`` (see ``causal_lm_loss``) and the counts per row ``[B]``.
        """
        loss, n_tokens, _ = self._loss_terms(batch, reduction)
        return loss, n_tokens

    def _loss_terms(
        self, batch: dict[str, Tensor], reduction: Literal["mean", "none"] = "mean", router_aux: bool = False
    ) -> tuple[Tensor, Tensor | int, Tensor | None]:
        """:meth:`_loss`, and with ``router_aux`` the MoE router auxiliary loss ``[]`` (unweighted, computed from the
        router logits as the model's forward computes it), or None where the model adds none."""
        input_ids = batch["input_ids"]  # [B, T]
        attention_mask = batch.get("attention_mask")  # [B, T] or None
        labels = _labels(batch)  # [B, T]
        rows = batch.get(TARGET_ROWS)  # [N] from on_before_batch_transfer, or None
        # MoE with the router loss on: only training asks for the router logits (evaluation reports the plain NLL)
        router = {"output_router_logits": router_aux} if self.router_aux is not None else {}
        out = self._decoder()(
            input_ids=input_ids,
            attention_mask=model_attention_mask(batch),
            position_ids=batch.get("position_ids"),
            use_cache=False,
            **router,
        )
        hidden = out.last_hidden_state  # [B, T, H]
        loss = causal_lm_loss(
            hidden,
            self._lm_head_weight(),
            labels,
            chunk_size=self.hparams.loss_chunk_size,
            softcap=getattr(self.model.config.get_text_config(), "final_logit_softcapping", None),
            reduction=reduction,
            rows=rows,
        )  # [] or [B, T]
        aux = None
        if router_aux and self.router_aux is not None:  # the logits lead back into the routers under any strategy
            aux = router_aux_loss(self.model, self.router_aux, out.router_logits, attention_mask)  # []
        targets = labels[:, 1:] != IGNORE_INDEX  # [B, T-1]
        if reduction == "none":
            return loss, targets.sum(1), aux  # [B]
        return loss, targets.sum() if rows is None else rows.numel(), aux  # [] (an int when counted on the host)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Adds the loss's target positions (``target_rows``), computed on the host: on a GPU the loss then
        selects them without a device sync, and the token count is known without one. A right-padded batch without
        ``position_ids`` runs without its mask, with host ``position_ids`` bound at transfer (``CAUSAL_ONLY``: the
        same outputs for every real token, no dense mask, no read of the device; [Note: host document spans]),
        unless its labels train a target after padding.

        Raises:
            ValueError: The batch is packed (restarting ``position_ids``, no ``attention_mask``) and the model's
                attention would build a dense mask of 1 GiB or more, or mix documents (see ``packed_batch_problem``).
        """
        if not (isinstance(batch, dict) and "input_ids" in batch):
            return batch
        self._check_packed(batch)
        if TARGET_ROWS not in batch:
            batch = {**batch, TARGET_ROWS: target_rows(_labels(batch))}
        batch = without_padding_mask(batch)  # the router loss still reads the batch's mask
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's transfer, with the documents of packed rows read from the host ``position_ids`` and bound to
        the moved tensor: the packed attention then reads nothing back from the device (see [Note: host document
        spans] in ``models/document_spans.py``)."""
        return transfer_binding_spans(
            batch, partial(super().transfer_batch_to_device, device=device, dataloader_idx=dataloader_idx)
        )

    def _check_packed(self, batch: dict[str, Tensor]) -> None:
        """Refuses a packed batch the model's attention implementation cannot take (see ``packed_batch_problem``)."""
        position_ids = batch.get("position_ids")
        if self.model is None or position_ids is None or batch.get("attention_mask") is not None:
            return
        attn = self.model.config.get_text_config()._attn_implementation
        batch_size, length = batch["input_ids"].shape
        problem = packed_batch_problem(attn, batch_size, length) if is_packed(position_ids) else None
        if problem is not None:
            raise ValueError(f"Packed batch: {problem}")

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Full HF forward; returns logits ``[B, T, V]`` (for prediction and export checks)."""
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).logits

    def training_step(self, batch: dict[str, Tensor]) -> Tensor:
        loss, n_tokens, aux = self._loss_terms(batch, router_aux=True)
        self.tokens_trained += int(n_tokens)
        batch_size = batch["input_ids"].shape[0]
        if aux is not None:  # as HF's forward: ``loss += coef * aux_loss``
            loss = loss + getattr(self.model, self.router_aux.coef) * aux.to(loss.device)
            self.log("train_aux_loss", aux, batch_size=batch_size)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch_size)
        # float64 keeps the count exact (float32 would round it above 2**24 tokens).
        tokens = torch.tensor(self.tokens_trained, dtype=torch.float64)  # []
        self.log("train_tokens", tokens, batch_size=batch_size)
        return loss

    def _eval_step(self, batch: dict[str, Tensor], metric: TokenMean) -> None:
        """Adds a batch's mean loss to ``metric``, weighted by its target tokens."""
        loss, n_tokens = self._loss(batch)
        metric.update(loss, n_tokens)

    def _log_eval_epoch(self, metric: TokenMean, prefix: str) -> None:
        """Logs ``{prefix}_loss`` (token-weighted mean over the epoch) and ``{prefix}_ppl``."""
        loss = metric.compute()
        metric.reset()
        self.log(f"{prefix}_loss", loss, prog_bar=True)
        self.log(f"{prefix}_ppl", torch.exp(loss))

    def validation_step(self, batch: dict[str, Tensor]) -> None:
        self._eval_step(batch, self.val_loss_mean)

    def on_validation_epoch_end(self) -> None:
        self._log_eval_epoch(self.val_loss_mean, "val")

    def test_step(self, batch: dict[str, Tensor]) -> None:
        self._eval_step(batch, self.test_loss_mean)

    def on_test_epoch_end(self) -> None:
        self._log_eval_epoch(self.test_loss_mean, "test")

    def predict_step(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-row scores: ``{"loss": [B], "tokens": [B]}``, mean NLL over target tokens and count.

        Computed with the chunked loss (no ``[B, T, V]`` logits); ``trainer.predict`` returns
        one such dict per batch, in dataloader order. Runs without gradients.
        """
        with torch.no_grad():
            token_loss, tokens = self._loss(batch, reduction="none")  # [B, T], [B]
        return {"loss": token_loss.sum(1) / tokens.clamp(min=1), "tokens": tokens}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_trained"] = self.tokens_trained

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_trained = checkpoint.get("tokens_trained", 0)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with decay / no-decay groups and a per-step warmup + cosine schedule (models/schedule.py)."""
        hp = self.hparams
        return adamw_warmup_cosine(
            self.named_parameters(), self.trainer.estimated_stepping_batches, learning_rate=hp.learning_rate,
            weight_decay=hp.weight_decay, betas=tuple(hp.betas), eps=hp.eps, warmup_steps=hp.warmup_steps,
            min_lr_ratio=hp.min_lr_ratio,
        )
