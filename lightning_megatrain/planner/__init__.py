"""Memory and throughput model of the MegaTrain engine: what ``megatrain plan`` prints (DESIGN principle 8).

``plan(model, seq_len=..., micro_batch=..., config=EngineConfig(...), machine=Machine(...))`` builds the model on
the ``meta`` device (no allocation), splits it into the streamed layer stack and the residents exactly as the engine
does, and models host RAM and GPU memory in bytes and the time of one optimizer step in seconds. One module per job:

- ``constants.py``: every measured or assumed number, with where it comes from;
- ``shape.py``: the model shape the formulas read (:func:`describe`, :func:`load_config`);
- ``memory.py``: host and GPU bytes, and the activation formula of one recomputed layer (:func:`layer_activation`);
- ``timing.py``: seconds per step and the FLOPs counted (:func:`step_time`);
- ``machine.py``: :class:`Machine`, the limits, cores and calibrated rates a plan is for;
- ``long_context.py``: where the layer-input checkpoints go (``seq_tile``, ``segment_layers``,
  ``sub_segment_layers``, ``device_checkpoints``) and the longest sequence that fits (:class:`Placement`,
  :func:`place_checkpoints`);
- ``ranks.py``: several ranks (``devices``, ``num_nodes``): host RAM per host, GPU memory per rank, the collectives'
  time ([Note: planning several ranks]);
- ``planning.py``: :func:`plan`;
- ``result.py``: :class:`Plan`, its result, and ``memo_pays`` (the attention memo's rule of "auto");
- ``search.py``: the largest micro-batch that fits, the fewest device groups that hide the host Adam;
- ``plan_warnings.py``: a plan's warnings, each with its numbers and the fix.

The ``megatrain plan`` command line is ``lightning_megatrain.planner.command.plan_main``.
"""

from lightning_megatrain.planner.constants import (
    ACHIEVED_TFLOPS,
    COMPACT_ADAM_GPARAMS,
    COMPILED_TFLOPS,
    CPU_ADAM_GPARAMS,
    CPU_REF_CORES,
    FP32_TFLOPS,
    GPU_REF_GIB,
    GPU_RESERVE_GIB,
    HOST_COPY_GBPS,
    HOST_OS_RESERVE_FRACTION,
    HOST_OS_RESERVE_MIN_GIB,
    HOST_REF_GIB,
    INTER_HOST_GBPS,
    NVLINK_GBPS,
    OPTIMIZERS,
    PCIE_D2H_GBPS,
    PCIE_DUPLEX_GBPS,
    PCIE_H2D_GBPS,
    PEAK_TFLOPS,
    PRECISIONS,
    PROCESS_GIB,
    TORCH_ADAM_GPARAMS,
)
from lightning_megatrain.planner.long_context import Placement, longest_seq_len, place_checkpoints
from lightning_megatrain.planner.machine import Machine
from lightning_megatrain.planner.memory import HOST_STATE_BYTES, gpu_bytes, host_bytes, layer_activation
from lightning_megatrain.planner.planning import host_os_reserve, plan
from lightning_megatrain.planner.result import Plan
from lightning_megatrain.planner.shape import describe, load_config
from lightning_megatrain.planner.timing import _attn_flops, step_time

__all__ = [
    "ACHIEVED_TFLOPS",
    "COMPACT_ADAM_GPARAMS",
    "COMPILED_TFLOPS",
    "CPU_ADAM_GPARAMS",
    "CPU_REF_CORES",
    "FP32_TFLOPS",
    "GPU_REF_GIB",
    "HOST_STATE_BYTES",
    "GPU_RESERVE_GIB",
    "HOST_COPY_GBPS",
    "HOST_OS_RESERVE_FRACTION",
    "HOST_OS_RESERVE_MIN_GIB",
    "HOST_REF_GIB",
    "INTER_HOST_GBPS",
    "NVLINK_GBPS",
    "OPTIMIZERS",
    "PCIE_D2H_GBPS",
    "PCIE_DUPLEX_GBPS",
    "PCIE_H2D_GBPS",
    "PEAK_TFLOPS",
    "PRECISIONS",
    "PROCESS_GIB",
    "TORCH_ADAM_GPARAMS",
    "Machine",
    "Placement",
    "Plan",
    "_attn_flops",  # tests/planner/test_planner.py checks the token-mixer FLOPs directly
    "describe",
    "gpu_bytes",
    "host_bytes",
    "host_os_reserve",
    "layer_activation",
    "load_config",
    "longest_seq_len",
    "place_checkpoints",
    "plan",
    "step_time",
]
