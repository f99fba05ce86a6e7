"""``attention_memo="auto"`` decided at the first training micro-batch (see [Note: auto placement] in
engine/placement.py): the layer-input checkpoints placed with and without the attention memos ([Note: attention memo]
in engine/attention_memo.py), both placements timed by the planner, the memos taken where they fit and pay."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.placement import PlacementLimits
from lightning_megatrain.planner import Machine, Placement, place_checkpoints, plan
from lightning_megatrain.planner.constants import MEMO_MIN_GAIN
from lightning_megatrain.planner.result import Plan, memo_pays, partial_memo


def choose_attention_memo(
    hf_config: PretrainedConfig,
    micro_batch: int,
    seq_len: int,
    grad_accum: int,
    *,
    config: EngineConfig,
    limits: PlacementLimits,
) -> tuple[bool, str]:
    """``attention_memo="auto"`` for a training micro-batch of ``micro_batch x seq_len`` tokens: ``(on, why)`` (see
    [Note: auto placement]). Called by the engine where placement.py's ``choose_checkpoints`` is, just before it,
    with the same arguments (``limits``: the run and the memory, :class:`PlacementLimits`); pass the chosen value in
    ``config`` to that call, which places the checkpoints beside the memos.

    The checkpoints are placed twice (:func:`~lightning_megatrain.planner.place_checkpoints`), with and without the
    memos, against the engine's limits; each placement is then timed by the planner's plan of this micro-batch with
    exactly that placement, on this machine's host RAM and cores and in ``config.host_state`` (whether the plan fits
    is not read: the placement was judged against the memory measured), and the memos are taken where they fit and
    ``memo_pays`` says so. Off where the planner cannot describe the model."""
    if limits.compute_dtype not in (torch.float16, torch.bfloat16):
        return False, "fp32 compute: cuDNN's attention kernel, the one the memo calls, runs fp16 and bf16"
    run = limits.run_options(hf_config)
    machine = Machine(gpu_mem_gib=limits.gpu_bytes / GIB)  # this machine's host RAM and cores

    def timed(memo: bool | int, p: Placement) -> Plan:  # the plan of this micro-batch with exactly that placement
        return plan(hf_config, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, **run,
                    machine=machine, host_state=config.host_state, config=config.replace(
                        attention_memo=memo, segment_layers=p.segment_layers, sub_segment_layers=p.sub_segment_layers,
                        device_checkpoints=p.device_checkpoints))

    try:
        placed = {memo: place_checkpoints(hf_config, seq_len=seq_len, micro_batch=micro_batch,
                                          gpu_limit=limits.gpu_bytes, host_free=limits.host_bytes, **run,
                                          config=config.replace(attention_memo=memo))[0]
                  for memo in (False, True)}
        if not placed[False].fits:
            return False, "the checkpoints do not fit even without the memos"
        without = timed(False, placed[False])
        memo = timed(True, placed[True]) if placed[True].fits else None
        pays = memo is not None and memo_pays(without, memo, fits=True)  # fits: placed against the memory measured
        hint = "" if pays else _partial_memo_hint(without, lambda n: timed(n, placed[False]))
    except Exception as e:  # the planner builds the model from its config (AutoModelForCausalLM.from_config)
        return False, f"the planner cannot describe this model ({type(e).__name__}: {e})"
    if memo is None:
        return False, f"the memos do not fit beside the checkpoints: {placed[True].why}{hint}"
    if "attention memos" not in memo.gpu:
        return False, "no layer's attention is SDPA without a mask (the memo serves no layer)"
    gain = memo.tokens_per_s / without.tokens_per_s
    tokens = f"{micro_batch} x {seq_len} tokens"
    if not pays:
        return False, (f"at {tokens} the memos ({memo.gpu['attention memos'] / GIB:.1f} GiB) plan {gain - 1:+.0%} "
                       f"tokens/s, under the {MEMO_MIN_GAIN - 1:.0%} they must gain{hint}")
    return True, (f"at {tokens} the memos ({memo.gpu['attention memos'] / GIB:.1f} GiB on the GPU) plan "
                  f"{gain - 1:+.0%} tokens/s ({without.tokens_per_s:,.0f} -> {memo.tokens_per_s:,.0f}): the "
                  "recompute skips the attention forward")


def _partial_memo_hint(without: Plan, timed: Callable[[int], Plan]) -> str:
    """Where every layer's memos are declined: the explicit ``attention_memo=N`` whose memos fit the GPU memory the
    checkpoints leave (result.py ``partial_memo``) and pay, for the log line; "auto" does not take it (measured on
    the GPU at no length yet). Empty where none does."""
    part = partial_memo(without, timed, fits=True)  # fits: placed against the memory measured
    if part is None:
        return ""
    n = without.memo_fitting
    return (f"; attention_memo={n} (the last {n} layers' memos, {part.gpu['attention memos'] / GIB:.1f} GiB in the "
            f"GPU memory the checkpoints leave) plans {part.tokens_per_s / without.tokens_per_s - 1:+.0%}, not "
            "taken by 'auto'")
