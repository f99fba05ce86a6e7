"""Host optimizers: Adam/AdamW from ``configure_optimizers`` mapped to a fast CPU implementation, Muon, and
AdamW over compact host state (optim/compact_adam.py)."""

from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS, CompactAdamW
from lightning_megatrain.optim.host_optimizer import to_host_optimizer
from lightning_megatrain.optim.muon import Muon, muon_param_groups

__all__ = ["HOST_STATE_LAYOUTS", "CompactAdamW", "Muon", "muon_param_groups", "to_host_optimizer"]
