"""HuggingFace causal-LM integration: the LightningModule, its chunked loss and HF export."""

from lightning_megatrain.models.causal_lm import CausalLMModule
from lightning_megatrain.models.export import export_checkpoint
from lightning_megatrain.models.loss import causal_lm_loss

__all__ = ["CausalLMModule", "causal_lm_loss", "export_checkpoint"]
