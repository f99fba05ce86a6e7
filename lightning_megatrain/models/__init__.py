"""HuggingFace causal-LM integration: the LightningModules (SFT, preference optimisation), their chunked losses, the
chunked loss for HF models called with labels, and HF export."""

from lightning_megatrain.models.causal_lm import CausalLMModule
from lightning_megatrain.models.dpo import DPOModule
from lightning_megatrain.models.export import export_checkpoint
from lightning_megatrain.models.hf_loss import ChunkedHFLoss, install_chunked_hf_loss
from lightning_megatrain.models.loss import causal_lm_loss
from lightning_megatrain.models.preference_loss import preference_loss
from lightning_megatrain.models.sequence_logps import sequence_logps

__all__ = [
    "CausalLMModule",
    "ChunkedHFLoss",
    "DPOModule",
    "causal_lm_loss",
    "export_checkpoint",
    "install_chunked_hf_loss",
    "preference_loss",
    "sequence_logps",
]
