"""The warnings of a plan: what limits the run (PCIe left exposed, host RAM or GPU memory too small, the host
optimizer outlasting the step, HF's naive loss, no checkpoint placement) and what the plan cannot model, each with
its numbers and the fix. :func:`~lightning_megatrain.planner.planning.plan` fills ``Plan.warnings`` with them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_megatrain._hardware import GIB
from lightning_megatrain.planner.long_context import SEQ_STEP
from lightning_megatrain.planner.memory import transfer_bytes
from lightning_megatrain.planner.shape import _Shape

if TYPE_CHECKING:
    from lightning_megatrain.planner.result import Plan


def plan_warnings(p: Plan, s: _Shape, overlapped_step: float | None) -> list[str]:
    """``Plan.warnings`` of ``p`` for the shape ``s``; ``overlapped_step``: the step planned with
    ``overlap_optimizer=True`` (None: the plan has it)."""
    out, t = [], p.time
    if not p.transfers_hidden:
        need = f"micro-batch >= {p.min_micro_batch_to_hide}" if p.min_micro_batch_to_hide else "no micro-batch"
        upload = transfer_bytes(p.host_state)["weight_bytes"] * p.max_layer_params / p.assumptions["pcie_h2d_gbps"]
        out.append(f"too few tokens per micro-batch ({p.micro_batch * p.seq_len:,}) to hide PCIe: "
                   f"{t['transfers exposed'] * 1e3:.0f} ms of transfers exposed per step (uploading the largest "
                   f"layer takes {upload / 1e6:.1f} ms); {need} hides them at seq {p.seq_len}")
    if p.host_total > p.host_usable:
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.host.items() if v >= 0.05 * p.host_total)
        out.append(f"host RAM too small: needs {p.host_total / GIB:.1f} GiB ({top} GiB; "
                   f"{p.host_bytes_per_param:.1f} B/param) but {p.host_usable / GIB:.1f} GiB of the "
                   f"{p.host_limit / GIB:.1f} GiB limit are usable ({p.host_reserve / GIB:.1f} GiB left to the OS)")
    if p.ranks is not None and p.ranks["setup_host_bytes"] > p.host_usable:
        out.append(f"host RAM too small at setup: each of the {p.ranks['devices']} ranks of a host packs the whole "
                   f"model in fp32 before cutting its share, {p.ranks['setup_host_bytes'] / GIB:.1f} GiB with their "
                   f"processes, over the {p.host_usable / GIB:.1f} GiB usable: fewer ranks per host")
    if p.gpu_total > p.gpu_limit:
        fix = (f"largest micro-batch that fits: {p.max_micro_batch}" if p.max_micro_batch else
               "not even micro-batch 1 fits: shorten the sequence, use loss='chunked' or a larger GPU")
        out.append(f"GPU memory too small: micro-batch {p.micro_batch} x {p.seq_len} needs "
                   f"{p.gpu_total / GIB:.1f} GiB but the limit is {p.gpu_limit / GIB:.1f} GiB; {fix}")
    if t.get("CPU optimizer (serial)", 0.0) > 0.25 * t["step total"]:
        step, cpu = t["step total"], t["CPU optimizer (serial)"]
        how = (f"overlap_optimizer=True lets the next forward hide it: {overlapped_step:.2f} s per step planned "
               f"instead of {step:.2f}; or raise" if overlapped_step < step else
               f"overlap_optimizer=True does not help here: {overlapped_step:.2f} s per step planned with it instead "
               f"of {step:.2f}, its host step outlasting the next forward; raise")
        cores = p.assumptions["cpu_cores"] if p.ranks is None else f"{p.ranks['cores_per_rank']} of the host's"
        out.append(f"the CPU optimizer ({cpu:.2f} s on {cores} cores) is {cpu / step:.0%} of "
                   f"the step: it does not overlap the GPU ({how} tokens per step to amortise it)")
    if p.loss == "naive" and p.gpu["phase loss: head + loss"] > 0.25 * p.gpu_limit:
        out.append(f"HF's loss materialises [B, T, V] logits ({p.gpu['phase loss: head + loss'] / GIB:.1f} GiB): "
                   "use CausalLMModule's chunked loss")
    lc = p.long_context
    if lc is not None and not lc["fits"]:
        longest = (f"the longest that fits at micro-batch {p.micro_batch} is {lc['longest_seq_len']:,} tokens"
                   if lc["longest_seq_len"] else
                   f"none of {SEQ_STEP:,} tokens or more fits at micro-batch {p.micro_batch}")
        out.append(f"no placement of the layer-input checkpoints fits this machine at {p.seq_len:,} tokens (Long "
                   f"context above; the tables show one per layer, offloaded): {longest}")
    if s.attn == "eager":
        out.append("eager attention keeps [heads, T, T] probabilities per layer: activations grow with seq_len^2")
    if any(ly.linear for ly in s.layers):
        out.append(f"{sum(ly.linear for ly in s.layers)} linear-attention (Gated DeltaNet) layers are modelled as "
                   "transformers' PyTorch fallback of the chunked delta rule (used when flash-linear-attention is not "
                   "installed): fla's kernels save fewer activations; the time assumes fused kernels throughout")
    return out
