"""The engine's options: declared, documented and validated once, then shared by the strategy, engine and planner.

A new option is a field here (with its docstring); ``MegaTrainStrategy`` takes each field as a keyword argument of
the same name, the engine reads it from :class:`EngineConfig`, and ``megatrain plan`` plans with the same object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

KeepLayers = int | Literal["auto"]
Auto = Literal["auto"]
CpuAdamMode = Literal["auto", "deepspeed", "torch"]
CPU_ADAM_MODES = ("auto", "deepspeed", "torch")
NonFiniteMode = Literal["skip", "raise"]
NONFINITE_MODES = ("skip", "raise")
HostState = Literal["fp32", "int8_moments", "compact_kahan", "compact"]
HOST_STATES = ("fp32", "int8_moments", "compact_kahan", "compact")  # optim/compact_adam.py HOST_STATE_LAYOUTS
CheckpointFormat = Literal["file", "sharded"]
CHECKPOINT_FORMATS = ("file", "sharded")


def memo_layers(attention_memo: bool | int | str, n_layers: int) -> int:
    """How many of ``n_layers`` layers, the last ones, keep their attention memos under the option
    ``attention_memo``: all for ``True``, none for ``False`` and an undecided ``"auto"``, at most ``n_layers`` for an
    int. The one reading of the option (the engine's layers, the planner's memory and time)."""
    if isinstance(attention_memo, bool) or attention_memo == "auto":
        return n_layers if attention_memo is True else 0
    return min(int(attention_memo), n_layers)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine places and moves state. Every field is a ``MegaTrainStrategy`` argument of the same name."""

    layers: str | None = None
    """Dotted path of the decoder-layer ``nn.ModuleList``/``nn.Sequential`` (e.g. ``"model.model.layers"``); ``None``
    discovers it."""

    num_slots: int = 2
    """Device buffers for layer weights, >= 2: one computes while the next uploads. Each costs one layer of GPU
    memory and only helps when layer sizes vary."""

    keep_layers: KeepLayers = "auto"
    """Layers per training micro-batch whose activations stay on the GPU instead of being recomputed: ``"auto"`` =
    as many as fit (engine/recompute.py), an int = exactly that many (the first ones), ``0`` = recompute every layer
    (the least GPU memory)."""

    overlap_optimizer: bool | Auto = "auto"
    """Run step N's host Adam layer by layer on a worker thread while step N+1's forward starts
    (engine/overlap.py). ``"auto"``: on where the compute device is a GPU (the host step would otherwise idle it),
    off on a CPU compute device (the step and the forward would share its cores) (engine/placement.py)."""

    gpu_optimizer_groups: int | Auto = "auto"
    """How many groups, in the order the forward reads them (the residents, then layers 0, 1, ...), keep their
    master, grad and Adam states on the GPU and step there (engine/device_state.py); the host keeps their masters.
    GPU bytes per layer parameter: 18 with fp32 host state, 6.03 with ``host_state="compact"`` (its layout on the
    GPU); CUDA and Adam/AdamW only. ``"auto"``: the fewest that hide the overlapped host Adam behind the
    forward (fp32 host state only), planned for the first training micro-batch, and at least the fewest with which
    the host holds the other groups' state (planner/pool.py, [Note: memory pool]) (engine/placement.py)."""

    compile_layers: bool | Auto = "auto"
    """Run every decoder layer's forward through ``torch.compile`` (engine/streamed.py, [Note: compiled layers]).
    ``"auto"``: on where the compute device is a GPU and Triton is usable, else off, and off for a model whose layers
    failed compiled there (engine/compiled.py ``compile_hazard``) (engine/placement.py)."""

    seq_tile: int | Auto | None = "auto"
    """Sequence positions per tile for the position-wise block of every decoder layer (its MLP or MoE block), in
    forward and in the recompute: that block's transient memory is then set by a tile, not by the sequence
    (engine/tiling.py, [Note: sequence tiles]). ``None``: untiled; an int: tiles of that many positions;
    ``"auto"``: tiled only for long sequences (engine/tiling.py says where)."""

    segment_layers: int | Auto = "auto"
    """Layers per recompute segment. ``1``: every recomputed layer saves its input (one layer-input checkpoint per
    layer). ``k > 1``: only the first layer of every ``k`` saves its input; backward replays the segment's forward
    from it (one more forward of ``k - 1`` layers per ``k``) so the checkpoints take ``k`` times less memory
    (engine/segments.py, [Note: recompute segments]). ``"auto"``: ``1`` unless the checkpoints fit neither GPU nor
    host memory, then the segments, flat or nested (``sub_segment_layers``), that fit with the fewest replayed
    layer forwards (engine/placement.py)."""

    sub_segment_layers: int | Auto = "auto"
    """Nested recompute inside a segment of ``segment_layers``: a replay keeps only every ``m``-th regenerated layer
    input (and those of the sub-segment it replays into), each lower sub-segment replayed again from its
    sub-checkpoint, so a segment holds fewer inputs at once for more replayed forwards (engine/segments.py, [Note:
    recompute segments]). ``1``: keep them all (flat segments). ``"auto"``: ``1`` unless no flat placement fits, then
    the one of fewest replayed forwards that fits (engine/placement.py)."""

    device_checkpoints: int | Auto = "auto"
    """Layer-input checkpoints kept in GPU memory instead of offloaded to pinned host memory, the last layers' first
    (backward restores them first). ``"auto"``: 0 unless the host cannot hold them all, then the fewest with which
    the rest fit the host, the GPU memory beyond them left to ``keep_layers`` (engine/placement.py)."""

    attention_memo: bool | int | Auto = "auto"
    """Keep each recomputed layer's attention outputs (and log-sum-exp) from its forward for its recompute, which
    then skips the attention kernel: one attention forward less per recomputed layer and step, for ``B x T x heads x
    head_dim`` compute-dtype values per layer on the GPU until its backward (engine/attention_memo.py, [Note:
    attention memo]); the same gradients (bitwise for eager layers on the CPU in fp32, within rounding compiled).
    SDPA attention without mask or dropout only (on CUDA where SDPA could use cuDNN). On the H200 the Llama-2-7B
    shape at 131,072 tokens steps in 43.1 s with it against 49.3 s (docs/long-context.md). ``True``: every layer's
    memos; an int ``N`` (``1`` is the last layer alone, not ``True``): the last ``N`` layers' only, for the GPU
    memory the layer-input checkpoints leave where all of them do not fit beside the checkpoints (``megatrain plan``
    names such an ``N`` where it pays; not decided by "auto"). ``"auto"``: decided at the first training
    micro-batch (a longer one may switch it off) on a CUDA device with one rank: on where the planner's plan of that
    micro-batch with the memos fits the GPU beside the layer-input checkpoints and is at least ``MEMO_MIN_GAIN``
    faster than without (planner/constants.py: long rows), the checkpoints then placed with them
    (engine/memo_choice.py ``choose_attention_memo``); off on a CPU compute device, with several ranks and outside
    training."""

    chunked_hf_loss: bool = True
    """HF causal LMs called with ``labels`` compute HF's loss with the chunked cross-entropy, without ``[B, T, V]``
    logits, and return ``logits=None`` (models/hf_loss.py, [Note: HF loss]: same loss and gradients, and when HF's
    own forward runs instead). ``False`` leaves HF's forward untouched, for modules that read ``logits`` together
    with ``labels``."""

    update_during_backward: bool | Auto = "auto"
    """Start each layer's host Adam/AdamW update during the optimizer step's backward, as soon as its grads are
    final, speculating that clipping does not fire and the step is not skipped; a step where either happens is
    undone from snapshots and redone, so results are unchanged bitwise (engine/backward_updates.py, [Note: updates
    during backward]). Costs 12 bytes of host memory per parameter of a speculated layer, within what the host has
    free. ``"auto"``: on with ``overlap_optimizer`` on a GPU, except in the step after one whose clipping fired;
    ``True``: every step (needs ``overlap_optimizer``); ``False``: off."""

    cpu_adam: CpuAdamMode = "auto"
    """Host Adam/AdamW implementation: ``"auto"`` (DeepSpeedCPUAdam when it builds, else torch fused AdamW; torch
    fused AdamW when the step is overlapped), ``"deepspeed"`` or ``"torch"`` (optim/host_optimizer.py)."""

    nonfinite: NonFiniteMode = "skip"
    """An optimizer step whose loss or global gradient norm is inf or NaN: ``"skip"`` leaves every master, Adam
    state and step count as it was, logs a warning with the step index and counts it (``skipped_steps``);
    ``"raise"`` stops training with an error, nothing updated (engine/optimizer_step.py, [Note: all-or-nothing
    steps]). The learning-rate schedule and ``global_step`` advance either way, as under AMP's skipped steps."""

    host_state: HostState = "fp32"
    """How each parameter's host state is stored (optim/compact_adam.py, [Note: compact host state]; bytes per
    parameter in docs/compact-state.md): ``"fp32"`` (fp32 master, grad and Adam moments: 16 B), ``"int8_moments"``
    (fp32 master and grad, 8-bit moments: 10.03 B), ``"compact_kahan"`` (bf16 master with a bf16 Kahan compensation,
    bf16 grad, 8-bit moments: 8.03 B) or ``"compact"`` (bf16 master rounded stochastically, bf16 grad, 8-bit
    moments: 6.03 B). Other than ``"fp32"``: Adam/AdamW run as ``CompactAdamW`` on the host (optim/compact_update.py),
    and the ``gpu_optimizer_groups`` hold the same layout on the GPU (engine/device_state.py, [Note: compact device
    groups]); the bf16 layouts need ``precision="bf16-mixed"``."""
    checkpoint_format: CheckpointFormat = "file"
    """How local checkpoints are saved: ``"file"``, one ``torch.save`` archive (checkpoint_io.py, [Note: atomic
    checkpoints]); ``"sharded"``, a directory of one safetensors file per decoder layer plus the residents', for
    models whose checkpoint is large (sharded_checkpoint.py, [Note: sharded checkpoints]). Both load either."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("Invalid MegaTrainStrategy arguments:\n- " + "\n- ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid field, one line each with the value found and what is allowed."""
        out = []
        if self.layers is not None and not isinstance(self.layers, str):
            out.append(f"layers={self.layers!r}: need a dotted path such as 'model.model.layers', or None")
        if type(self.num_slots) is not int or self.num_slots < 2:
            out.append(f"num_slots={self.num_slots!r}: need an int >= 2 (one slot computes while the next uploads)")
        if not (self.keep_layers == "auto" or (type(self.keep_layers) is int and self.keep_layers >= 0)):
            out.append(f"keep_layers={self.keep_layers!r}: need 'auto' or an int >= 0 (layers not recomputed)")
        if not isinstance(self.overlap_optimizer, bool) and self.overlap_optimizer != "auto":
            out.append(f"overlap_optimizer={self.overlap_optimizer!r}: need 'auto', True or False")
        groups = self.gpu_optimizer_groups
        if groups != "auto" and (type(groups) is not int or groups < 0):
            out.append(f"gpu_optimizer_groups={groups!r}: need 'auto' or an int >= 0")
        if not isinstance(self.compile_layers, bool) and self.compile_layers != "auto":
            out.append(f"compile_layers={self.compile_layers!r}: need 'auto', True or False")
        tile = self.seq_tile
        if not (tile is None or tile == "auto" or (type(tile) is int and tile >= 1)):
            out.append(f"seq_tile={tile!r}: need 'auto', None (untiled) or an int >= 1 (positions per tile)")
        if not (self.segment_layers == "auto" or (type(self.segment_layers) is int and self.segment_layers >= 1)):
            out.append(f"segment_layers={self.segment_layers!r}: need 'auto' or an int >= 1 (layers per segment)")
        sub = self.sub_segment_layers
        if not (sub == "auto" or (type(sub) is int and sub >= 1)):
            out.append(f"sub_segment_layers={sub!r}: need 'auto' or an int >= 1 (layers per sub-segment; 1: flat)")
        checkpoints = self.device_checkpoints
        if not (checkpoints == "auto" or (type(checkpoints) is int and checkpoints >= 0)):
            out.append(f"device_checkpoints={checkpoints!r}: need 'auto' or an int >= 0")
        if not isinstance(self.update_during_backward, bool) and self.update_during_backward != "auto":
            out.append(f"update_during_backward={self.update_during_backward!r}: need 'auto', True or False")
        if self.update_during_backward is True and self.overlap_optimizer is False:
            out.append("update_during_backward=True with overlap_optimizer=False: the speculated updates are kept or "
                       "redone by the overlapped step; use overlap_optimizer=True (or 'auto' on a GPU)")
        memo = self.attention_memo
        if not (isinstance(memo, bool) or memo == "auto" or (type(memo) is int and memo >= 0)):
            out.append(f"attention_memo={memo!r}: need 'auto', True, False or an int >= 0 (the last layers')")
        if not isinstance(self.chunked_hf_loss, bool):
            out.append(f"chunked_hf_loss={self.chunked_hf_loss!r}: need True or False")
        if self.cpu_adam not in CPU_ADAM_MODES:
            out.append(f"cpu_adam={self.cpu_adam!r}: choose one of {CPU_ADAM_MODES}")
        if self.nonfinite not in NONFINITE_MODES:
            out.append(f"nonfinite={self.nonfinite!r}: choose one of {NONFINITE_MODES}")
        if self.host_state not in HOST_STATES:
            out.append(f"host_state={self.host_state!r}: choose one of {HOST_STATES}")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            out.append(f"checkpoint_format={self.checkpoint_format!r}: choose one of {CHECKPOINT_FORMATS}")
        return out

    def for_stage(self, fitting: bool, gradient_clip_algorithm: object) -> EngineConfig:
        """The options a Trainer stage runs with (``MegaTrainStrategy.setup``): ``gpu_optimizer_groups`` hold
        optimizer states, so none without an optimizer step (``fitting=False``), and ``attention_memo="auto"`` is off
        there (nothing is recomputed without a backward).

        Raises:
            ValueError: ``gpu_optimizer_groups`` > 0 with the Trainer's ``gradient_clip_algorithm="value"``.
        """
        groups = self.gpu_optimizer_groups
        if groups != "auto" and groups > 0 and fitting and gradient_clip_algorithm == "value":
            raise ValueError(
                "MegaTrainStrategy(gpu_optimizer_groups>0) clips by norm only (those groups' grads live on the GPU), "
                "got gradient_clip_algorithm='value'. "
                "HINT: use gradient_clip_algorithm='norm' or gpu_optimizer_groups=0."
            )
        # gpu_optimizer_groups hold optimizer states: none without an optimizer step; no recompute, no memo
        memo = {"attention_memo": False} if self.attention_memo == "auto" else {}
        return self if fitting else self.replace(gpu_optimizer_groups=0, **memo)

    def memo_layers(self, n_layers: int) -> int:
        """How many of ``n_layers`` layers keep their attention memos (:func:`memo_layers`)."""
        return memo_layers(self.attention_memo, n_layers)

    def checkpoints_unplanned(self) -> tuple[int, int, int]:
        """``(segment_layers, device_checkpoints, sub_segment_layers)`` where nothing plans them: each ``"auto"`` as
        the engine runs without a plan (one checkpoint per layer, none on the GPU, flat segments: 1, 0, 1), explicit
        values as given. The one home of that rule (a CPU device, several ranks, a batch or module the planner cannot
        read, a plan that fits nothing)."""
        k, n, m = self.segment_layers, self.device_checkpoints, self.sub_segment_layers
        return 1 if k == "auto" else k, 0 if n == "auto" else n, 1 if m == "auto" else m

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
