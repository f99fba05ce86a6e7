"""Which layers keep their activations on the device from forward to backward, and which are recomputed.

[Note: keep or recompute]
Recomputing a layer in backward costs one more forward of it (backward becomes ~3x forward instead of 2x). With the
weights off the GPU most of its memory is free, so the engine keeps the full autograd graph of the *first* ``k``
layers of each training micro-batch (plus a private copy of their compute-dtype weights: the slot is refilled) and
recomputes only the rest. ``k`` is:

- an ``int``: exactly that many (``0`` recomputes every layer: the least GPU memory, the paper's scheme);
- ``"auto"`` on CUDA: the first training micro-batch runs with ``k = 0`` and calibrates from the allocator's own
  counters (host-side bookkeeping, no device sync): ``A``, the bytes one layer's graph holds (measured around a
  recompute, which builds exactly the graph a kept layer keeps), per byte of the layer's input, and ``P``, the peak
  allocated bytes of that micro-batch. A kept layer then costs ``(A/x1 + 1) * x + W`` (``x`` its input bytes, kept
  too; ``W`` its weights in the compute dtype) on top of a peak that scales at most with the tokens, so later
  micro-batches keep ``k = (budget - P * max(1, x/x1)) // ((A/x1 + 1) * x + W)`` layers, ``budget`` being
  :data:`DEVICE_FRACTION` of the device. The first layers whose weights stay on the device anyway
  (``gpu_optimizer_groups``, engine/device_state.py) need no private copy and cost ``W`` less each. The first
  micro-batch that keeps layers then *tops up*: the allocator's peak *reserved* memory so far bounds its own need
  from above, fragmentation included, so ``(top-up budget - reserved) // (graph + W)`` more layers still fit where
  the estimate was pessimistic (at 3B, 64K tokens per micro-batch it left 14 GiB of the budget unallocated);
  micro-batches no larger than that one keep them too. (Topping up to the allocated peak instead ran out of memory
  at 32 x 1024 with HF's loss, whose 15.7 GiB logits gradient found no block in the fragmented rest.) Measured
  rather than estimated, the top-up may fill :data:`TOP_UP_FRACTION` of the device, but always leaves the largest
  segment the allocator has made (the size of its largest block) unreserved, so that a block of that size can
  still be made when the added layers' graphs have split the cached one: with HF's loss at 32 x 1024 that is the
  15.7 GiB logits block, and the top-up budget stays :data:`DEVICE_FRACTION`. On a CPU compute device ``"auto"``
  keeps none.
"""

from __future__ import annotations

import logging

import torch

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import KeepLayers

log = logging.getLogger(__name__)

# Share of the device's memory the auto policy plans to fill: the rest absorbs allocator fragmentation and kernels'
# workspaces that the allocated-bytes counters do not see. 0.95 kept one more 3B layer at 64K tokens per micro-batch
# on the H200 (20 instead of 19, +1.3%) but ran out of memory at 32 x 1024 tokens with HF's loss: its 15.66 GiB
# logits block found no room in 14.5 GiB free and 14.6 GiB of fragmented reserve (benchmarks/HISTORY.md).
DEVICE_FRACTION = 0.9
# The top-up's budget where the largest block is small (see the module note): at 3B and 64K tokens per micro-batch
# with the chunked loss on the H200 it keeps 20 layers where 0.9 kept 18, 26,403 tokens/s against 26,277 and 25,758
# (benchmarks/HISTORY.md), peaking at 132.8 GiB reserved.
TOP_UP_FRACTION = 0.95


class RecomputePolicy:
    """Decides per layer forward whether to keep its graph (see [Note: keep or recompute])."""

    def __init__(
        self, keep_layers: KeepLayers, device: torch.device, layer_weight_bytes: int, persistent_layers: int = 0
    ) -> None:
        self.fixed = keep_layers if isinstance(keep_layers, int) else None
        self.device = device
        self.weight_bytes = layer_weight_bytes  # W: the largest layer's weights in the compute dtype
        self.persistent_layers = persistent_layers  # the first layers, whose weights a kept graph uses in place
        self.calibrating = self.fixed is None and device.type == "cuda"
        # read once: limit() runs at every layer's forward
        self.budget = DEVICE_FRACTION * torch.cuda.get_device_properties(device).total_memory if self.calibrating else 0
        self._peak_before = 0
        self.graph_bytes_per_input_byte: float | None = None  # A / x1, set when calibration ends
        self.peak_bytes = 0  # P
        self.input_bytes = 0  # x1
        self._ratio = 0.0  # largest A / x measured so far
        self._kept = 0  # kept so far in the current micro-batch's forward
        self._input_bytes = 0  # the current micro-batch's layer input
        self._topping_up = False  # the current micro-batch is the first after calibration
        self.extra = 0  # layers the top-up added, for micro-batches with inputs of at most ``extra_input_bytes``
        self.extra_input_bytes = 0

    def start_forward(self) -> None:
        """The first layer of a training micro-batch's forward is about to run."""
        self._kept = 0
        if self.calibrating and self.graph_bytes_per_input_byte is None:
            self._peak_before = torch.cuda.max_memory_allocated(self.device)

    def keep(self, input_bytes: int) -> bool:
        """Whether the next layer (input of ``input_bytes`` on the activation path) keeps its graph."""
        self._input_bytes = input_bytes
        if self._kept < self.limit(input_bytes):
            self._kept += 1
            return True
        return False

    def limit(self, input_bytes: int) -> int:
        """Layers to keep in a micro-batch whose layer inputs are ``input_bytes`` each."""
        if self.fixed is not None:
            return self.fixed
        if self.graph_bytes_per_input_byte is None or input_bytes <= 0:
            # CPU, or CUDA before calibration; or a layer with no input on the activation path (frozen embeddings
            # before it), which the per-input-byte model cannot size: recomputed
            return 0
        scale = max(1.0, input_bytes / self.input_bytes)
        free = self.budget - self.peak_bytes * scale
        # the graph and the input it saves (not offloaded when kept), plus a private weight copy past the persistent
        graph = (self.graph_bytes_per_input_byte + 1) * input_bytes
        in_place = min(self.persistent_layers, max(0, int(free // graph)))
        planned = in_place + max(0, int((free - in_place * graph) // (graph + self.weight_bytes)))
        return planned + (self.extra if input_bytes <= self.extra_input_bytes else 0)

    def measure_recompute(self, graph_bytes: int, input_bytes: int) -> None:
        """A recompute of a layer with ``input_bytes`` of input held ``graph_bytes`` (calibration only)."""
        if self.calibrating and input_bytes:
            self.input_bytes = max(self.input_bytes, input_bytes)
            self._ratio = max(self._ratio, graph_bytes / input_bytes)

    def end_backward(self) -> bool:
        """The first layer's backward finished: the micro-batch's peak is known. True when calibration ends here."""
        if self._topping_up:
            self._top_up()
        if not self.calibrating or not self.input_bytes:
            return False
        self.peak_bytes = max(torch.cuda.max_memory_allocated(self.device), self._peak_before)
        self.graph_bytes_per_input_byte = self._ratio
        self.calibrating = False
        self._topping_up = True
        log.info(
            "MegaTrain: a layer's graph holds %.2f GiB at this micro-batch size, the recompute-all peak is %.1f GiB: "
            "keeping the graphs of up to %d layers per micro-batch from the next one on, recomputing the rest",
            self._ratio * self.input_bytes / GIB,
            self.peak_bytes / GIB,
            self.limit(self.input_bytes),
        )
        return True

    def _top_up(self) -> None:
        """The first micro-batch with kept layers ended: keep more where its peak left room (see the module note)."""
        self._topping_up = False
        assert self.graph_bytes_per_input_byte is not None
        x = self._input_bytes
        peak = torch.cuda.max_memory_reserved(self.device)  # >= this micro-batch's own need, fragmentation included
        cost = (self.graph_bytes_per_input_byte + 1) * x + self.weight_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = max(self.budget, min(TOP_UP_FRACTION * total, total - self._largest_segment()))
        extra = max(0, int((budget - peak) // cost)) if x and self._kept == self.limit(x) else 0
        if extra:
            self.extra, self.extra_input_bytes = extra, x
            log.info(
                "MegaTrain: keeping %d layers reserved a peak of %.1f GiB of a %.1f GiB top-up budget: keeping %d more "
                "per micro-batch of this size",
                self._kept,
                peak / GIB,
                budget / GIB,
                extra,
            )

    def _largest_segment(self) -> int:
        """Bytes of the largest segment the caching allocator holds on this device (once per run: it walks them)."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return max((s["total_size"] for s in torch.cuda.memory_snapshot() if s["device"] == index), default=0)
