"""Placement: the engine's ``"auto"`` options resolved into concrete choices, each logged with its reason.

[Note: auto placement]
``MegaTrainStrategy()`` with no arguments should train as fast as a hand-tuned run. Each ``"auto"`` option is
decided once, at setup, from what the engine can see there (the compute device and what it can build), and the log
gets one line per decision saying what was chosen and why; an explicit value is used as given:

- ``compile_layers``: on for a CUDA compute device where Triton is usable. Compiled Llama layers fuse the
  elementwise work between the matmuls and keep 31% fewer activation bytes ([Note: compiled layers]); on the H200
  they made plain GPU training of the 3B shape 1.29x faster (docs/planner.md). Off on a CPU compute device, where
  inductor's C++ build costs more than it saves for the small models one trains there, where Triton is missing, and
  for a model whose layers failed compiled on the GPU (engine/compiled.py ``compile_hazard``: gpt-oss with
  grouped_mm experts).
- ``overlap_optimizer``: on for a CUDA compute device. The host Adam step otherwise idles the GPU for its whole
  length (0.73 s for 3.2B parameters on 16 cores, longer than a 32K-token forward). What made it opt-in, hooks
  reading parameters mid-update, the strategy now covers: it waits for the step before any user hook that runs
  between the step and the next forward (hooks.py, [Note: user hooks]). Off on a CPU compute device, where
  the step and the forward would share the same cores.

- ``gpu_optimizer_groups``: decided before the first training micro-batch, whose shape the choice needs
  (:func:`choose_gpu_optimizer_groups`): the fewest groups with which the overlapped host Adam no longer outlasts
  the next forward and one micro-batch still fits, as the planner computes it for this model, micro-batch, device
  and host (``megatrain plan --overlap-optimizer --update-during-backward`` prints the same suggestion, the planner
  counting the host updates during backward where they run). Those groups then take their GPU
  memory before ``keep_layers="auto"`` measures what is left. 0 on a CPU compute device, without the overlapped step
  (the groups pay by hiding it), with a compact ``host_state`` (the hiding is planned for the fp32 host Adam; its
  device groups hold the compact layout, [Note: compact device groups]), with an optimizer other than one
  Adam/AdamW, clipping by value or the module's own
  ``configure_gradient_clipping`` (device groups clip by norm, in the engine), or where the planner cannot describe
  the model (no HF config, or one it cannot build). Where the host cannot hold every group's grads and optimizer
  states, at least the fewest groups with which it holds the rest, measured against the host memory free then
  (planner/pool.py, [Note: memory pool]); the host grads wait for that decision (setup allocates none while it is
  pending), and where no split fits, or device groups cannot run, it is refused with both memories' numbers.

- ``segment_layers``, ``sub_segment_layers`` and ``device_checkpoints``: where the layer-input checkpoints go
  (config.py), decided at the first training micro-batch, whose ``B x T`` sizes them (:func:`choose_checkpoints`), after
  ``gpu_optimizer_groups`` and before ``keep_layers="auto"`` measures what is left. Each checkpoint is the fp32 residual
  stream of one micro-batch (``4 * H * B * T`` bytes: 8 GiB for Llama-2-7B at 524,288 tokens), one per segment of
  recomputed layers, and the host's free memory and the GPU's must hold them beside everything else. In that order: one
  per layer, all in pinned host memory, where they fit there (what the engine did before these options, and what short
  sequences get); else the last ones on the GPU, the fewest with which the rest fit the host (the GPU memory beyond them
  stays with ``keep_layers="auto"`` and the allocator's slack, not filled with checkpoints), where the planned peak
  holds them; else the segments with which both fit that replay the fewest layer forwards in backward (flat ones replay
  ``k - 1`` per ``k``; nested ones, ``sub_segment_layers > 1``, more, and hold fewer inputs at once), again with the
  fewest on the GPU the host needs. Explicit ints are checked the same way. Nothing fitting is an error, raised before
  the micro-batch allocates anything, with the bytes needed and free on the host and the GPU and the longest sequence
  that fits this machine at this micro-batch. This is also the host-memory check of the checkpoints: the setup preflight
  (engine/host_store.py, ``check_host_memory``, then ``check_host_bytes_to_come`` once the optimizers exist) runs before
  any batch exists, so it checks the masters, grads, optimizer states and slabs only. ``1``, ``1`` and ``0`` on a CPU
  compute device, where a layer's input stays in host memory with its activations. ``seq_tile`` is not decided here:
  engine/tiling.py's ``tile_length`` resolves it per sequence, and the plan counts its tiles.

- ``attention_memo``: decided with the checkpoints, before them, at the first training micro-batch, where
  ``keep_layers="auto"`` then measures its budget with or without the memos, so a longer micro-batch may only switch
  them off (engine/memo_choice.py ``choose_attention_memo``; engine/first_batch.py). On where the memos fit the GPU
  beside the checkpoints placed with them and the planner's plan of this micro-batch is ``MEMO_MIN_GAIN`` faster with
  them (planner/constants.py; the rule: planner/result.py ``memo_pays``), which only long rows are: at 131,072 tokens
  the Llama-2-7B shape's attention is 73% of its layers' FLOPs and the memo saved 13% of the step on the H200, at
  4,096 it cannot save 5%. The planner decides ``"auto"`` by the same rule. Where it declines them, the log line names
  the explicit ``attention_memo=N`` whose memos fit the GPU memory the checkpoints leave, if they pay (not taken: not
  yet measured on a GPU). Off on a CPU compute device, with several ranks (engine/sharding.py) and outside training;
  ``True``, ``False`` and an int are used as given.

``keep_layers="auto"`` is decided later, from the first micro-batches' measured memory ([Note: keep or recompute]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.compiled import compile_hazard
from lightning_megatrain.engine.host_budget import fewest_host_groups, host_short
from lightning_megatrain.engine.host_store import smaller_state_hint
from lightning_megatrain.planner import Machine, place_checkpoints, plan
from lightning_megatrain.planner.pool import split_first_batch, split_options

log = logging.getLogger(__name__)


def _triton_usable() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def resolve(config: EngineConfig, device: torch.device, hf_config: PretrainedConfig | None = None) -> EngineConfig:
    """``config`` with every ``"auto"`` decided for ``device`` and the model of ``hf_config`` (its HF config, ``None``
    where it has none) (see [Note: auto placement]); logs each decision."""
    changes: dict[str, object] = {}
    on_cuda = device.type == "cuda"
    hazard = compile_hazard(hf_config) if on_cuda else None
    if config.compile_layers == "auto":
        triton = on_cuda and _triton_usable()
        compiled = changes["compile_layers"] = triton and hazard is None
        reason = (
            "CUDA with Triton: fused elementwise kernels, fewer saved activations; the first step compiles each "
            "layer class"
            if compiled
            else hazard if triton else "Triton is not usable here" if on_cuda else "CPU compute device"
        )
        log.info("MegaTrain: compile_layers=%s (auto: %s)", compiled, reason)
    elif config.compile_layers and hazard is not None:
        log.warning("MegaTrain: compile_layers=True as given, although %s (compile_layers='auto' leaves them eager)",
                    hazard)
    overlap = config.overlap_optimizer
    if overlap == "auto":
        overlap = changes["overlap_optimizer"] = on_cuda or config.update_during_backward is True
        reason = (
            "the host Adam step runs beside the next forward instead of idling the GPU; hooks that read parameters "
            "wait for it"
            if on_cuda
            else "update_during_backward=True keeps or redoes its updates in the overlapped step"
            if overlap
            else "CPU compute device: the step and the forward would share its cores"
        )
        log.info("MegaTrain: overlap_optimizer=%s (auto: %s)", overlap, reason)
    if config.update_during_backward == "auto":
        during = bool(overlap) and on_cuda and config.host_state == "fp32"
        if not during:  # else it stays "auto": the engine skips the step after one whose clipping fired
            changes["update_during_backward"] = False
        reason = (
            "each layer's host Adam starts once its grads are final, speculating that clipping does not fire"
            if during
            else "no overlapped step" if not overlap
            else "CPU compute device" if not on_cuda
            else f"host_state={config.host_state!r} steps CompactAdamW"
        )
        log.info("MegaTrain: update_during_backward=%s (auto: %s)", during, reason)
    if config.gpu_optimizer_groups == "auto" and not on_cuda:
        changes["gpu_optimizer_groups"] = 0
        log.info("MegaTrain: gpu_optimizer_groups=0 (auto: CPU compute device)")
    if config.attention_memo == "auto" and not on_cuda:
        changes["attention_memo"] = False
        log.info("MegaTrain: attention_memo=False (auto: CPU compute device; the memo's gain is planned for cuDNN's "
                 "attention on a GPU)")
    unplanned = zip(("segment_layers", "device_checkpoints", "sub_segment_layers"), config.checkpoints_unplanned())
    for name, value in unplanned:
        if getattr(config, name) == "auto" and not on_cuda:
            changes[name] = value
            log.info("MegaTrain: %s=%d (auto: CPU compute device, layer inputs stay in host memory)", name, value)
    return config.replace(**changes) if changes else config


def token_shape(batch: Any) -> tuple[int, int] | None:
    """``(B, T)`` of a training batch's token ids: ``batch["input_ids"]``, the batch itself, or its first 2-D integer
    tensor; None when there is none."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        batch = batch["input_ids"]
    candidates = [batch] if isinstance(batch, Tensor) else list(batch.values()) if isinstance(batch, Mapping) else (
        list(batch) if isinstance(batch, (list, tuple)) else [])
    for t in candidates:
        if isinstance(t, Tensor) and t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t.shape[0]), int(t.shape[1])
    return None


def module_hf_config(module: nn.Module) -> PretrainedConfig | None:
    """The first HF config among ``module``'s submodules (the planner's model description), None without one."""
    return next((m.config for m in module.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)), None)


def choose_gpu_optimizer_groups(
    module: nn.Module,
    batch: Any,
    *,
    config: EngineConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    grad_accum: int,
    steppable: bool,
    custom_clipping: bool,
    chunked_loss: bool,
    host_free: int | None = None,
    to_come: Callable[[int], int] | None = None,
) -> tuple[int, str]:
    """``gpu_optimizer_groups="auto"`` for the first training micro-batch ``batch``: the count and why (see
    [Note: auto placement]). ``steppable``: one optimizer device groups can step (engine/host_budget.py
    ``device_steppable``: Adam/AdamW, or CompactAdamW under a compact ``host_state``); ``custom_clipping``: clipping
    by value or by the module's own ``configure_gradient_clipping``; ``chunked_loss``: the module's HF loss runs chunked
    (models/hf_loss.py), else the plan counts full logits. ``host_free``: host bytes the process may still allocate
    (None: unknown, not checked); ``to_come(n)``: host bytes its groups and optimizers still allocate with ``n``
    device groups (engine/host_budget.py ``host_bytes_to_come_split``). Where the host cannot hold them all, the
    fewest groups that let it (planner/pool.py, [Note: memory pool]).

    Raises:
        RuntimeError: the host cannot hold every group's state and no split fits (or device groups cannot run here):
            the message has both memories' numbers and the options that would fit.
    """
    short = host_free is not None and to_come is not None and to_come(0) > host_free
    shape = token_shape(batch)
    hf_config = module_hf_config(module)
    cannot = ("not one Adam/AdamW optimizer (device groups step one Adam/AdamW, or CompactAdamW under a compact "
              "host_state)" if not steppable else
              "clipping by value or by the module's configure_gradient_clipping (device groups clip by norm)"
              if custom_clipping else "no [B, T] token ids in the batch" if shape is None else
              "no HF config in the module to plan the GPU's working set with" if hf_config is None else None)
    if cannot is not None:
        if short:
            raise RuntimeError(
                f"MegaTrainStrategy: {host_short(to_come, host_free)}, and gpu_optimizer_groups='auto' cannot move "
                f"any to the GPU: {cannot}. HINT: an explicit gpu_optimizer_groups="
                f"{fewest_host_groups(to_come, host_free)} or more (Adam/AdamW, norm clipping), "
                f"{smaller_state_hint(config.host_state)}or more host RAM.")
        return 0, cannot
    if not short and not config.overlap_optimizer:
        return 0, "the host step is not overlapped (overlap_optimizer=False) and the host holds every group's state"
    if not short and config.host_state != "fp32":
        return 0, (f"the host holds every group's state (host_state={config.host_state!r}: device groups are placed "
                   "only where it cannot; hiding the host step with them is planned for the fp32 host Adam)")
    micro_batch, seq_len = shape
    tokens = f"{micro_batch} x {seq_len} tokens x {grad_accum} micro-batches"
    _, total = torch.cuda.mem_get_info(device)
    try:
        p = None if config.host_state != "fp32" else _plan_first_batch(
            hf_config, micro_batch, seq_len, grad_accum, config, compute_dtype, chunked_loss, total)
        pooled = None if not short else split_first_batch(
            hf_config, micro_batch, seq_len, config=config, gpu_limit=total, host_free=host_free, to_come=to_come,
            **run_options(hf_config, compute_dtype, chunked_loss))
    except Exception as e:  # the planner builds the model from its config (AutoModelForCausalLM.from_config)
        if short:
            raise RuntimeError(
                f"MegaTrainStrategy: {host_short(to_come, host_free)}, and the planner cannot describe this model "
                f"to split them with the GPU ({type(e).__name__}: {e}). HINT: an explicit gpu_optimizer_groups="
                f"{fewest_host_groups(to_come, host_free)} or more, {smaller_state_hint(config.host_state)}or more "
                "host RAM.") from e
        return 0, f"the planner cannot describe this model ({type(e).__name__}: {e})"
    hide = p.suggested_gpu_optimizer_groups if p is not None and config.overlap_optimizer else None
    if pooled is not None and not pooled.fits:
        options = split_options(hf_config, micro_batch, seq_len, config=config, gpu_limit=total, host_free=host_free,
                                to_come=to_come, **run_options(hf_config, compute_dtype, chunked_loss))
        raise RuntimeError(
            f"MegaTrainStrategy cannot split the state of the first training micro-batch ({tokens}) between host and "
            f"GPU: {pooled.why}. HINT: {options}; or set gpu_optimizer_groups explicitly, use more host RAM or a "
            "larger GPU.")
    if pooled is not None:
        extra = (f"; {hide} hide the host Adam behind the forward" if hide is not None and hide > pooled.groups
                 else "")
        return max(pooled.groups, hide or 0), f"both memories at {tokens}: {pooled.why}{extra} (planned)"
    if hide is None:
        return 0, f"at {tokens} no count both hides the host Adam behind the forward and fits the GPU"
    if hide == 0:
        return 0, f"at {tokens} the host Adam already hides behind the forward"
    return hide, f"the fewest that hide the host Adam behind the forward at {tokens} (planned)"


def run_options(hf_config: PretrainedConfig, compute_dtype: torch.dtype, chunked_loss: bool) -> dict[str, Any]:
    """The planner's precision, loss and attention arguments for the engine's run."""
    return {
        "precision": "bf16-mixed" if compute_dtype == torch.bfloat16 else "32-true",
        "loss": "chunked" if chunked_loss else "naive",
        "attn_implementation": getattr(hf_config, "_attn_implementation", None),
    }


def _plan_first_batch(hf_config: PretrainedConfig, micro_batch: int, seq_len: int, grad_accum: int,
                      config: EngineConfig, compute_dtype: torch.dtype, chunked_loss: bool, gpu_bytes: int):
    """The planner's plan of this run without device groups, on a GPU of ``gpu_bytes``."""
    return plan(
        hf_config,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        **run_options(hf_config, compute_dtype, chunked_loss),
        config=config.replace(gpu_optimizer_groups=0),
        machine=Machine(gpu_mem_gib=gpu_bytes / GIB),
    )


@dataclass(frozen=True)
class PlacementLimits:
    """The run and the memory the first training micro-batch's placement decisions are taken on
    (:func:`choose_checkpoints`, engine/memo_choice.py ``choose_attention_memo``).

    Args:
        compute_dtype: ``torch.bfloat16`` plans bf16-mixed, anything else 32-true.
        chunked_loss: the loss runs chunked (models/hf_loss.py, models/loss.py), else the plan counts full logits.
        gpu_bytes: the device's total memory (``torch.cuda.mem_get_info(device)[1]``): the plan counts the slots,
            residents, device groups and reserve itself.
        host_bytes: host memory free for the offloaded checkpoints: ``_hardware.available_host_bytes()[0]`` read
            now, after setup allocated the masters, grads and slabs, less the host memory still to be allocated
            before this micro-batch's backward ends and kept through it: the optimizer states the first step has not
            yet allocated (engine/host_budget.py ``host_bytes_to_come``: 8 bytes per Adam parameter not in a device
            group, 4 per Muon matrix, about 2 with 8-bit moments; 0 once they exist, as on resume). Where
            ``available_host_bytes()`` is None, pass a huge number (nothing to check against).
    """

    compute_dtype: torch.dtype
    chunked_loss: bool
    gpu_bytes: int
    host_bytes: int

    def run_options(self, hf_config: PretrainedConfig) -> dict[str, Any]:
        """:func:`run_options` of this run."""
        return run_options(hf_config, self.compute_dtype, self.chunked_loss)


def choose_checkpoints(
    hf_config: PretrainedConfig,
    micro_batch: int,
    seq_len: int,
    grad_accum: int,
    *,
    config: EngineConfig,
    limits: PlacementLimits,
) -> tuple[int, int, int, str]:
    """``segment_layers``, ``device_checkpoints`` and ``sub_segment_layers`` for the first training micro-batch:
    ``(segment_layers, device_checkpoints, sub_segment_layers, why)``, ``"auto"`` decided and explicit ints checked
    (see [Note: auto placement]; the rule and the memory it counts: planner/long_context.py).

    Call it on a CUDA compute device, once, at the first training micro-batch, before its forward: after
    ``gpu_optimizer_groups`` is decided (pass ``config`` with that int: the plan counts those groups' GPU memory) and
    before ``keep_layers="auto"`` measures the GPU. Log ``why`` as the other decisions are logged.

    Args:
        hf_config: the module's HF config (the one :func:`choose_gpu_optimizer_groups` finds).
        micro_batch, seq_len: ``B x T`` of the micro-batch's token ids (:func:`token_shape`); the engine places again
            at any micro-batch with more tokens (``MegaTrainEngine.checkpoints_outgrown``).
        grad_accum: micro-batches per step; not in the decision (each checkpoint lives for one micro-batch and the
            pinned buffers are reused by the next), named in ``why``.
        config: the strategy's options after :func:`resolve`: ``seq_tile`` (its tiles lower the planned peak),
            ``segment_layers``, ``sub_segment_layers``, ``device_checkpoints``, ``num_slots`` and
            ``gpu_optimizer_groups`` are read.
        limits: the run and the memory (:class:`PlacementLimits`).

    Returns:
        ``(segment_layers, device_checkpoints, sub_segment_layers, why)``: ints for the engine
        (``device_checkpoints`` at most the number of checkpoints), and the reason with the bytes. Where the planner
        cannot build the model from ``hf_config``, the engine as before these options for ``"auto"`` (``1``, ``0``,
        ``1``) and explicit ints as given,
        unchecked, with that reason.

    Raises:
        RuntimeError: no placement fits: the message has the checkpoints' size and count, host bytes needed and free,
            the GPU peak and limit of the closest placement, and a HINT with the longest sequence that fits this
            machine at this micro-batch (a multiple of 1024).
    """
    k, n, m = config.checkpoints_unplanned()
    try:
        placed, longest = place_checkpoints(
            hf_config,
            seq_len=seq_len,
            micro_batch=micro_batch,
            gpu_limit=limits.gpu_bytes,
            host_free=limits.host_bytes,
            **limits.run_options(hf_config),
            config=config,
        )
    except Exception as e:  # the planner builds the model from its config (AutoModelForCausalLM.from_config)
        return k, n, m, f"the planner cannot describe this model ({type(e).__name__}: {e}): placed unchecked"
    tokens = f"{micro_batch} x {seq_len} tokens"
    if not placed.fits:
        hint = (f"the longest sequence that fits this machine at micro-batch {micro_batch} is {longest:,} tokens"
                if longest else f"not even {1024:,} tokens fit this machine at micro-batch {micro_batch}")
        raise RuntimeError(
            f"MegaTrainStrategy cannot place the first training micro-batch ({tokens}): {placed.why}. HINT: {hint} "
            f"(planned with seq_tile={config.seq_tile!r}, segment_layers={config.segment_layers!r}, "
            f"sub_segment_layers={config.sub_segment_layers!r}, "
            f"device_checkpoints={config.device_checkpoints!r}; `megatrain plan --seq-len N` prints the placement); "
            "else shorten the sequences, lower the micro-batch, or use more host RAM or a larger GPU."
        )
    why = f"{placed.why}; planned for {tokens} x {grad_accum} micro-batches"
    return placed.segment_layers, placed.device_checkpoints, placed.sub_segment_layers, why
