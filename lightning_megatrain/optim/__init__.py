"""Host optimizers: Adam/AdamW from ``configure_optimizers`` mapped to a fast CPU implementation, and AdamW over
compact host state (optim/compact_adam.py)."""

from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS, CompactAdamW
from lightning_megatrain.optim.host_optimizer import to_host_optimizer

__all__ = ["HOST_STATE_LAYOUTS", "CompactAdamW", "to_host_optimizer"]
