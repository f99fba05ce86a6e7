"""``megatrain plan``'s report: a :class:`~lightning_megatrain.planner.result.Plan` as a readable table, and its
one-line verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_megatrain._hardware import GIB
from lightning_megatrain.planner.constants import HOST_OS_RESERVE_FRACTION, HOST_OS_RESERVE_MIN_GIB, PEAK_TFLOPS
from lightning_megatrain.planner.long_context import SEQ_STEP

if TYPE_CHECKING:
    from lightning_megatrain.planner.result import Plan


def render(p: Plan) -> str:
    """``Plan.report``: a readable table (GiB = 2**30 bytes)."""
    g = lambda b: f"{b / GIB:9.2f} GiB"
    lines = [
        f"MegaTrain plan: {p.model}  ({p.precision}, {p.optimizer}, {p.loss} loss"
        + ("" if p.host_state == "fp32" else f", host_state {p.host_state}") + ")",
        f"  {verdict(p)}",
        (f"  params {p.n_params / 1e9:.3f}B = {p.n_layers} layers x {p.max_layer_params / 1e6:.1f}M (max)"
        f" + {p.resident_params / 1e6:.1f}M resident; active per token {p.active_params / 1e9:.3f}B"),
        (f"  tokens/step {p.tokens_per_step:,} = micro-batch {p.micro_batch} x seq {p.seq_len} x accum "
        f"{p.grad_accum}" + (f" x {p.ranks['world']} ranks" if p.ranks else "")
        + f"; activation offload {'on' if p.offload_activations else 'off'}"),
        "", "  Host RAM", *(f"    {k:<28}{g(v)}" for k, v in p.host.items()),
        (f"    {'total':<28}{g(p.host_total)}  of {p.host_usable / GIB:.1f} GiB usable  "
        f"({p.host_bytes_per_param:.2f} B/param; state {_per_param(p)} B/param)"),
        (f"    usable: the {p.host_limit / GIB:.1f} GiB limit less {p.host_reserve / GIB:.1f} GiB left to "
         f"the OS and other processes (max({HOST_OS_RESERVE_MIN_GIB:g} GiB, {HOST_OS_RESERVE_FRACTION:.0%}))"),
        "", "  GPU memory (peak = persistent + the larger phase)",
        *(f"    {k:<48}{g(v)}" for k, v in p.gpu.items()),
        f"    {'peak':<48}{g(p.gpu_total)}  of {p.gpu_limit / GIB:.1f} GiB",
        f"    largest micro-batch: {_batches(p.max_micro_batch)} by GPU memory, "
        f"{_batches(p.max_micro_batch_host)} by host RAM (at seq {p.seq_len})",
        (f"    activations of one layer: {p.activation_per_token['saved']:,.0f} B/token saved + "
        f"{p.activation_per_token['transient']:,.0f} transient"),
        "", "  Time per optimizer step",
        *(f"    {k:<36}{v * 1e3:10.1f} ms" for k, v in p.time.items()),
        f"    transfers hidden behind compute: {'yes' if p.transfers_hidden else 'NO'}"
        + (f" (needs micro-batch >= {p.min_micro_batch_to_hide})" if p.min_micro_batch_to_hide else ""),
        (f"  Throughput {p.tokens_per_s:,.0f} tokens/s, {p.model_tflops:.0f} model TFLOP/s, "
        f"MFU {p.mfu:.1%} ({p.mfu_with_attention:.1%} with attention) vs {PEAK_TFLOPS:.0f} TFLOP/s"),
    ]
    if p.long_context is not None:
        lines += _long_context_lines(p)
    if p.ranks is not None:
        lines += _ranks_lines(p)
    pool = p.memory_pool
    if pool is not None:  # planner/pool.py, [Note: memory pool]
        lines.append(f"  Both memories: gpu_optimizer_groups={pool['groups']} (auto; "
                     f"{pool['device_params'] / 1e9:.2f}B params keep their grads and Adam states on the GPU"
                     + (f", {pool['fewest']} needed for the host" if pool["fewest"] != pool["groups"] else "")
                     + f"): {pool['why'] if pool['fits'] else 'NO SPLIT FITS: ' + pool['why']}")
    suggested = p.suggested_gpu_optimizer_groups
    planned = p.assumptions.get("gpu_optimizer_groups")
    if suggested is not None and suggested != planned and not (pool is not None and suggested < planned):
        lines.append(f"  gpu_optimizer_groups={suggested} is the fewest with which the host Adam no longer "
                     "outlasts the next forward")
    lines += [f"  WARNING: {w}" for w in p.warnings]
    return "\n".join(lines)


def verdict(p: Plan) -> str:
    """One line: FITS or DOES NOT FIT, each limit's use, and the binding one (the least spare) with its margin."""
    gib = lambda b: f"{b / GIB:.1f}"
    gpu_spare, host_spare = p.gpu_limit - p.gpu_total, p.host_usable - p.host_total
    used = (f"GPU peak {gib(p.gpu_total)} of {gib(p.gpu_limit)} GiB" + (" per rank" if p.ranks else "")
            + f", host RAM {gib(p.host_total)} of {gib(p.host_usable)} GiB usable" + (" per host" if p.ranks else ""))
    if p.fits:
        binding, spare = min(("GPU memory", gpu_spare), ("host RAM", host_spare), key=lambda x: x[1])
        return f"FITS: {used}; the tighter is {binding}, {gib(spare)} GiB spare"
    over = [f"{name} by {gib(-spare)} GiB" for name, spare in (("GPU memory", gpu_spare), ("host RAM", host_spare))
            if spare < 0]
    if p.ranks is not None and p.ranks["setup_host_bytes"] > p.host_usable:
        over.append(f"host RAM at setup by {gib(p.ranks['setup_host_bytes'] - p.host_usable)} GiB")
    if p.long_context is not None and not p.long_context["fits"]:
        over.append("no placement of the layer-input checkpoints fits (Long context below)")
    if p.memory_pool is not None and not p.memory_pool["fits"]:
        over.append("no split of the state between host and GPU fits (Both memories below)")
    return f"DOES NOT FIT: {used}; over: {', '.join(over)}"


def _per_param(p: Plan) -> str:
    """Host state bytes per parameter: whole bytes for fp32 state (16), two decimals for a compact host_state's."""
    return f"{p.host_state_bytes_per_param:.0f}" if p.host_state == "fp32" else f"{p.host_state_bytes_per_param:.2f}"


def _batches(n: int) -> str:
    return str(n) if n else "none (not even 1)"


def _long_context_lines(p: Plan) -> list[str]:
    lc, g = p.long_context, lambda b: f"{b / GIB:.2f} GiB"
    asked = ", ".join(f"{k}={v!r}" for k, v in lc["requested"].items())
    tile = (f"{lc['seq_tile']:,} positions per tile of the MLP/MoE block" if lc["seq_tile"] is not None
            else "untiled")
    longest = lc["longest_seq_len"]
    return [
        "", f"  Long context ({asked})",
        f"    seq_tile: {tile}; segment_layers {lc['segment_layers']}; sub_segment_layers "
        f"{lc['sub_segment_layers']}; device_checkpoints {lc['device_checkpoints']}",
        (f"    layer-input checkpoints: {lc['checkpoints']} x {g(lc['checkpoint_bytes'])}: "
         + (f"{lc['device_checkpoints']} on the GPU, {lc['checkpoints'] - lc['device_checkpoints']} in pinned host "
            f"memory ({g(lc['checkpoints_host_bytes'])})" if p.offload_activations else "all on the GPU (no offload)")),
        f"    {'chosen' if lc['fits'] else 'NOTHING FITS'}: {lc['why']}",
        f"    predicted: host RAM {g(p.host_total)} of {g(p.host_usable)} usable; GPU peak {g(p.gpu_total)} of "
        f"{g(p.gpu_limit)}",
        (f"    longest sequence that fits this machine at micro-batch {p.micro_batch}: {longest:,} tokens" if longest
         else f"    no sequence of {SEQ_STEP:,} tokens or more fits this machine at micro-batch {p.micro_batch}"),
    ]


def _ranks_lines(p: Plan) -> list[str]:
    """The several-ranks section (planner/ranks.py, [Note: planning several ranks])."""
    rk, g = p.ranks, lambda b: f"{b / GIB:.2f} GiB"
    a = rk["assumptions"]
    hosts = f"{rk['num_nodes']} hosts" if rk["num_nodes"] > 1 else "one host"
    return [
        "", f"  Ranks: {rk['world']} ({rk['devices']} per host, {hosts}); Host RAM above is per host, GPU memory per "
        "rank, time per step of one rank",
        "    host RAM per rank: " + ", ".join(f"{k} {g(v)}" for k, v in rk["host_per_rank"].items() if v),
        f"    host RAM at setup: {g(rk['setup_host_bytes'])} per host (each rank packs the whole model in fp32 "
        "before cutting its share)",
        f"    collectives per step: layer all-gathers {rk['gathers_s'] * 1e3:.1f} ms (on the H2D stream, behind "
        f"compute), layer reduce-scatters {rk['reduce_scatters_s'] * 1e3:.1f} ms (serial), "
        f"residents through the GPUs {rk['residents_s'] * 1e3:.1f} ms (serial)",
        f"    host Adam on {rk['cores_per_rank']} cores per rank; throughput above is the whole job's, MFU per GPU",
        f"    assumed: NVLink {a['nvlink_gbps']:g} GB/s" + (f", inter-host {a['inter_host_gbps']:g} GB/s" if
        rk["num_nodes"] > 1 else "") + f" per GPU and direction (ring busbw), "
        f"{a['collective_latency_s'] * 1e6:.0f} us per small collective, NCCL {a['nccl_gpu_gib']:g} GiB of GPU "
        "memory; not modelled: NCCL's SMs taken from compute, shared PCIe or host memory bandwidth",
    ]
