"""Host optimizers: Adam/AdamW from ``configure_optimizers`` mapped to a fast CPU implementation."""

from lightning_megatrain.optim.host_optimizer import to_host_optimizer

__all__ = ["to_host_optimizer"]
