"""HuggingFace causal-LM integration: the LightningModule, its chunked loss, the chunked loss for HF models called
with labels, and HF export."""

from lightning_megatrain.models.causal_lm import CausalLMModule
from lightning_megatrain.models.export import export_checkpoint
from lightning_megatrain.models.hf_loss import ChunkedHFLoss, install_chunked_hf_loss
from lightning_megatrain.models.loss import causal_lm_loss

__all__ = ["CausalLMModule", "ChunkedHFLoss", "causal_lm_loss", "export_checkpoint", "install_chunked_hf_loss"]
