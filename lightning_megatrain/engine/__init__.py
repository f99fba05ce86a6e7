"""The MegaTrain engine: host-resident state, layer streaming, recompute and gradient drain.

[Note: tensor roles] (the only words code and logs use for them)
- *master*: a parameter's fp32 value in host RAM, a view into its layer's flat buffer (pinned on CUDA). It is the
  LightningModule's parameter; optimizers, checkpoints and ``state_dict()`` see it.
- *grad*: the fp32 host gradient of a master (``p.grad``), a view into the layer's flat grad buffer.
- *slot*: a device buffer that holds one layer's weights at a time (S >= 2 slots, see engine/transfer.py).
- *compute view*: a slot (or master, on the CPU backend) sliced and shaped like one parameter and bound into the
  layer's module for one forward or recompute.
- *grad slab*: a pinned host buffer that receives one layer's packed gradients from the D2H stream (engine/drain.py).
- *resident*: a parameter or buffer outside the layer stack; its *compute copy* lives on the device for a step.

Modules: discovery (find the stack and residents), host_store (flat masters and grads), transfer (the two backends,
slots and streams), offload (saved layer inputs to host and back) and drain (grads to host): the only
device-specific code; streamed (the streamed autograd Function), tiling (sequence tiles of each layer's MLP or MoE
block), residents, optimizer_step (gradient finalization, clipping and the update; optimizer_setup, its base: the
host optimizers and their zero_grad), overlap (its worker thread), engine (the facade).
"""

from lightning_megatrain.engine.discovery import find_layer_stack
from lightning_megatrain.engine.engine import MegaTrainEngine

__all__ = ["MegaTrainEngine", "find_layer_stack"]
