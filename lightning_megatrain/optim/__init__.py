"""Host optimizers: Adam/AdamW from ``configure_optimizers`` mapped to a fast CPU implementation, and Muon."""

from lightning_megatrain.optim.host_optimizer import to_host_optimizer
from lightning_megatrain.optim.muon import Muon, muon_param_groups

__all__ = ["Muon", "muon_param_groups", "to_host_optimizer"]
