"""The plan: :func:`plan` models one model and batch shape with memory.py and timing.py, searches the largest
micro-batch that fits (search.py), and warns about what limits the run (plan_warnings.py); :class:`Plan` holds and
prints the result.

MFU follows shared/BENCHMARKS.md: 6 * (non-embedding active params incl. the LM head matmul) * tokens / time / the
dense bf16 peak ``PEAK_TFLOPS`` (constants.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_megatrain._hardware import GIB, cpu_cores, gpu_mem_gib, host_os_reserve, host_ram_gib
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.compiled import compile_hazard
from lightning_megatrain.engine.host_store import check_layout_compute
from lightning_megatrain.engine.recompute import DEVICE_FRACTION
from lightning_megatrain.engine.sharding import sharded_config
from lightning_megatrain.engine.tiling import AUTO_MIN_POSITIONS
from lightning_megatrain.planner.constants import (
    ACHIEVED_TFLOPS,
    ATTN_BWD_TFLOPS,
    ATTN_FWD_TFLOPS,
    ATTN_RATES_FROM_SEQ,
    COMPACT_ADAM_GPARAMS,
    COMPILED_TFLOPS,
    CPU_REF_CORES,
    FP32_TFLOPS,
    GPU_REF_GIB,
    HOST_COPY_GBPS,
    HOST_REF_GIB,
    OPTIMIZERS,
    PEAK_TFLOPS,
    PRECISIONS,
    TORCH_ADAM_GPARAMS,
)
from lightning_megatrain.planner.long_context import longest_placeable, planned_placement
from lightning_megatrain.planner.machine import Machine
from lightning_megatrain.planner.memory import (
    HOST_STATE_BYTES,
    SNAPSHOT_BYTES,
    _gpu_peak,
    checkpoints,
    gpu_bytes,
    gpu_keywords,
    host_bytes,
    memo_layers_fitting,
    speculated_layers,
    transfer_bytes,
)
from lightning_megatrain.planner.plan_warnings import plan_warnings
from lightning_megatrain.planner.pool import auto_split
from lightning_megatrain.planner.ranks import (
    rank_gpu_items,
    rank_host_items,
    rank_setup_bytes,
    rank_summary,
    rank_timing,
)
from lightning_megatrain.planner.result import Plan, memo_may_pay, memo_pays
from lightning_megatrain.planner.search import groups_to_hide_optimizer, largest
from lightning_megatrain.planner.shape import describe, load_config
from lightning_megatrain.planner.timing import _attn_flops, memo_saved_s, step_time


def plan(model: Any, *, seq_len: int, micro_batch: int = 1, grad_accum: int = 1, precision: str = "bf16-mixed",
         optimizer: str = "adamw", loss: str = "chunked", loss_chunk_size: int = 4096,
         attn_implementation: str | None = None, offload_activations: bool = True,
         config: EngineConfig = EngineConfig(), machine: Machine = Machine(), host_state: str = "fp32",
         devices: int = 1, num_nodes: int = 1) -> Plan:
    """Plan host RAM, GPU memory and throughput of ``Trainer(strategy="megatrain")`` for one model and batch shape.

    Args:
        model: HF config, dict for ``AutoConfig.for_model``, inline JSON, .json file, local dir or hub name.
        seq_len, micro_batch, grad_accum: tokens per micro-batch = ``micro_batch * seq_len``; per step x grad_accum.
        precision: "bf16-mixed" or "32-true".
        optimizer: "adamw", "adam", "sgd", "sgd_momentum". loss: "chunked" (CausalLMModule) or "naive" (HF).
        loss_chunk_size: tokens per chunk of the chunked loss, as ``CausalLMModule(loss_chunk_size=...)``.
        attn_implementation: "auto", "sdpa", "eager", ... as ``CausalLMModule(attn_implementation=...)``; default
            (and "auto") the config's (transformers picks sdpa where the model supports it).
        offload_activations: layer inputs go to pinned host memory (the engine's CUDA path) instead of staying
            (then every layer-input checkpoint stays on the GPU: ``device_checkpoints`` is not read).
        config: the ``MegaTrainStrategy`` options, planned as the engine runs them:

            - ``num_slots``: that many slots of the largest layer on the GPU.
            - ``overlap_optimizer``: Adam (torch fused) runs beside the next step's forward and only the part that
              outlasts it counts; the plan then suggests the fewest ``gpu_optimizer_groups`` that hide it.
            - ``update_during_backward`` (``"auto"`` or True, with ``overlap_optimizer``, the fp32 host Adam/AdamW
              and one rank): the last layers whose snapshots fit the host memory the plan leaves free, less 4 GiB,
              start their update during backward (timing.py ``host_after_backward``); host item "backward snapshots".
            - ``gpu_optimizer_groups``: the residents and the first ``gpu_optimizer_groups - 1`` layers keep their
              optimizer state on the GPU (engine/device_state.py).
            - ``compile_layers``: the bf16 rate becomes ``COMPILED_TFLOPS``. Memory stays planned for eager layers
              (compiled ones save less).
            - ``attention_memo``: True plans the memos (memory.py ``attention_memo_bytes``) and the attention forward
              they save (timing.py), an int ``N`` those of the last ``N`` layers; ``"auto"`` as the engine decides
              it (engine/memo_choice.py ``choose_attention_memo``): the plan with every layer's where
              :func:`memo_pays`, else the plan without (only that one is made where ``Plan.memo_bound`` says they
              cannot gain ``MEMO_MIN_GAIN``).
            - ``keep_layers`` is not modelled: the plan recomputes every layer (``keep_layers=0``), so its GPU peak
              is the floor that must fit. ``"auto"`` keeps the graphs of as many layers as fill the GPU memory left
              above that floor (engine/recompute.py); a fixed count needs more than the plan shows.
            - ``layers`` and ``cpu_adam`` are not read: the stack is discovered as the engine discovers it, and the
              host Adam runs at DeepSpeedCPUAdam's measured rate (torch fused AdamW's when overlapped).
            - ``seq_tile``, ``segment_layers``, ``device_checkpoints``: planned as the engine places them
              (planner/long_context.py): ``seq_tile`` through engine/tiling.py's ``tile_length``; ``"auto"``
              segments and device checkpoints as ``choose_checkpoints`` decides them, with the host memory the
              plan's other items leave free; where nothing fits, one checkpoint per layer, offloaded, and a warning.
              The plan's ``long_context`` (and its report's "Long context" section) gives the placement, its reason
              and the longest sequence that fits this machine at this micro-batch; it is None for a plan those
              options leave as the engine was before them (a sequence up to ``AUTO_MIN_POSITIONS``, ``"auto"``
              resolving to untiled, one checkpoint per layer, all offloaded).
            - ``"auto"`` is planned as the engine decides it on a CUDA device (engine/placement.py, [Note: auto
              placement]): ``overlap_optimizer`` on, ``compile_layers`` on except for a model
              engine/compiled.py's ``compile_hazard`` names (gpt-oss with grouped_mm experts);
              ``gpu_optimizer_groups`` the suggested count (0 where none hides the host Adam and fits; none under a
              compact ``host_state``), or, where the host cannot hold every group's state, at least the fewest of the
              split (planner/pool.py, ``memory_pool``).
        machine: limits, cores and calibrated rates (:class:`Machine`; ``None`` fields read this machine). Host RAM
            fits where it is at most the limit less :func:`host_os_reserve` (``Plan.host_usable``); the long-context
            placement and the largest micro-batch by host RAM are judged against that too.
        host_state: the host state layout (planner/memory.py ``HOST_STATE_BYTES``, optim/compact_adam.py [Note:
            compact host state]): ``"fp32"`` (16 B/param with AdamW), ``"int8_moments"`` (10.03; CompactAdamW with
            fp32 weights, the user's optimizer, today), ``"compact"`` (6.03) or ``"compact_kahan"`` (8.03), the last
            two with bf16 weights and grads on the host (docs/compact-state.md). Any but ``"fp32"`` is planned as
            the engine runs CompactAdamW: Adam/AdamW only, the host step at ``COMPACT_ADAM_GPARAMS`` (constants.py),
            overlapped where ``overlap_optimizer`` says so, and with bf16 weights the uploads and grad drains move 2
            bytes per parameter instead of 4. Device groups hold the same layout on the GPU (engine/device_state.py,
            [Note: compact device groups]; the host keeps their master only); ``"auto"`` plans them only where the
            host cannot hold every group's state ([Note: memory pool]), not to hide the host step (the suggestion is
            planned for the fp32 host Adam).
        devices, num_nodes: ranks per host and hosts, as ``Trainer(devices=..., num_nodes=...)``, planned as
            planner/ranks.py says ([Note: planning several ranks]): host RAM per host (its ``devices`` ranks, and
            the setup peak), GPU memory per rank, the step of one rank, tokens/s of the whole job (tokens per step
            = ``devices * num_nodes`` micro-batches x accumulation) and MFU per GPU. ``machine`` is one host:
            ``host_ram_gib`` and ``cpu_cores`` are the host's, shared by its ranks. One rank plans exactly as before.

    Raises:
        ValueError: an unknown precision, optimizer, loss or host_state; a seq_len, micro_batch or grad_accum below
            1; ``config.gpu_optimizer_groups`` above the groups the model has, or with an optimizer other than
            Adam/AdamW; a host_state other than "fp32" with an optimizer other than Adam/AdamW; ``devices`` or
            ``num_nodes`` not an int >= 1; with several ranks, ``update_during_backward=True``,
            ``gpu_optimizer_groups`` > 0 or a host_state other than "fp32" (refused as the strategy refuses them,
            engine/sharding.py ``sharded_config``).
    """
    m = machine
    if not all(type(v) is int and v >= 1 for v in (devices, num_nodes)):
        raise ValueError(f"devices and num_nodes must be ints >= 1; got devices={devices!r}, num_nodes={num_nodes!r}")
    if host_state not in HOST_STATE_BYTES:
        raise ValueError(f"host_state={host_state!r}: choose one of {list(HOST_STATE_BYTES)}")
    world = devices * num_nodes
    if world > 1:  # what the strategy runs with several ranks: the refusals, and some "auto" options settled
        config = sharded_config(config.replace(host_state=host_state), world).replace(host_state="fp32")
    if host_state != "fp32" and optimizer not in ("adamw", "adam"):
        raise ValueError(f"host_state={host_state!r} is planned for CompactAdamW (Adam/AdamW); got "
                         f"optimizer={optimizer!r}. HINT: optimizer='adamw', or host_state='fp32'.")
    if precision == "32-true":  # the engine's refusal of bf16 masters under fp32 compute
        check_layout_compute(host_state, torch.float32)
    # as the engine resolves them on a GPU (engine/placement.py); the plans below get them resolved
    config = config.replace(
        **({"overlap_optimizer": True} if config.overlap_optimizer == "auto" else {}),
        **({"compile_layers": compile_hazard(load_config(model)) is None} if config.compile_layers == "auto" else {}),
    )
    kwargs = dict(seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision,
                  optimizer=optimizer, loss=loss, loss_chunk_size=loss_chunk_size,
                  attn_implementation=attn_implementation, offload_activations=offload_activations, machine=m,
                  host_state=host_state, devices=devices, num_nodes=num_nodes)
    if config.gpu_optimizer_groups == "auto":
        alone = plan(model, config=config.replace(gpu_optimizer_groups=0), **kwargs)
        groups, pooled = alone.suggested_gpu_optimizer_groups or 0, None
        if alone.host_total > alone.host_usable and optimizer in ("adamw", "adam"):
            pooled = auto_split(  # both memories as one pool ([Note: memory pool]), in the host_state layout
                model, alone.host, alone.host_usable, alone.gpu_limit, micro_batch=micro_batch, seq_len=seq_len,
                host_state=host_state, attn_implementation=attn_implementation, config=config,
                gkw=gpu_keywords(config, precision=precision, loss=loss, loss_chunk=loss_chunk_size,
                                 reserve_gib=m.gpu_reserve_gib, offload=offload_activations, host_state=host_state))
            groups = max(groups, pooled.groups) if pooled.fits else pooled.groups
        p = plan(model, config=config.replace(gpu_optimizer_groups=groups), **kwargs)
        if pooled is not None:
            p.memory_pool = {"groups": groups, "fewest": pooled.groups, "device_params": sum(pooled.numels[:groups]),
                             "fits": pooled.fits, "why": pooled.why}
        return p
    if config.attention_memo == "auto":  # as the engine decides it (engine/memo_choice.py choose_attention_memo)
        without = plan(model, config=config.replace(attention_memo=False), **kwargs)
        if not memo_may_pay(without):
            return without
        memo = plan(model, config=config.replace(attention_memo=True), **kwargs)
        return memo if memo_pays(without, memo) else without
    if precision not in PRECISIONS or optimizer not in OPTIMIZERS or loss not in ("chunked", "naive"):
        raise ValueError(f"precision in {list(PRECISIONS)}, optimizer in {list(OPTIMIZERS)}, loss in "
                         f"['chunked', 'naive']; got {precision!r}, {optimizer!r}, {loss!r}")
    if seq_len < 1 or micro_batch < 1 or grad_accum < 1:
        raise ValueError(f"seq_len, micro_batch, grad_accum must be >= 1; got {seq_len}, {micro_batch}, {grad_accum}")
    s = describe(model, "" if not isinstance(model, (str, Path)) or str(model).lstrip().startswith("{") else str(model),
                 attn_implementation)
    if not 0 <= config.gpu_optimizer_groups <= 1 + len(s.layers):
        raise ValueError(f"gpu_optimizer_groups must be in [0, {1 + len(s.layers)}] (the residents and {len(s.layers)} "
                         f"layers); got {config.gpu_optimizer_groups}")
    if config.gpu_optimizer_groups and optimizer not in ("adamw", "adam"):
        raise ValueError(f"gpu_optimizer_groups steps Adam/AdamW on the GPU; got optimizer={optimizer!r}")
    c = PRECISIONS[precision]
    tflops = m.achieved_tflops or (
        FP32_TFLOPS if c >= 4 else COMPILED_TFLOPS if config.compile_layers else ACHIEVED_TFLOPS)
    cores = m.cpu_cores or cpu_cores()
    rank_cores = max(1, cores // devices)  # Lightning's launcher: OMP_NUM_THREADS = cores // ranks per host
    host_limit = int((m.host_ram_gib or host_ram_gib() or HOST_REF_GIB) * GIB)
    host_usable = host_limit - host_os_reserve(host_limit)
    gpu_limit = int((m.gpu_mem_gib or gpu_mem_gib() or GPU_REF_GIB) * GIB)
    groups, overlap = config.gpu_optimizer_groups, config.overlap_optimizer
    gkw = {**gpu_keywords(config, precision=precision, loss=loss, loss_chunk=loss_chunk_size,
                          reserve_gib=m.gpu_reserve_gib, offload=offload_activations, host_state=host_state),
           "gpu_groups": groups}
    opt_rate = host_update_gparams(optimizer, host_state, overlap)
    tkw = {"c": c, "grad_accum": grad_accum, "offload": offload_activations, "tflops": tflops, "h2d": m.pcie_h2d_gbps,
           "d2h": m.pcie_d2h_gbps, "duplex": m.pcie_duplex_gbps, "num_slots": config.num_slots,
           "opt_rate": opt_rate * rank_cores / CPU_REF_CORES, "overlap_optimizer": overlap, "gpu_groups": groups,
           "attention_memo": gkw["attention_memo"], **transfer_bytes(host_state),
           # the attention kernel's measured rates, where measured: long rows, bf16, no rate named by the machine
           "attn_tflops": (ATTN_FWD_TFLOPS, ATTN_BWD_TFLOPS)
           if seq_len >= ATTN_RATES_FROM_SEQ and not m.achieved_tflops and c < 4 else None}
    hkw = {"c": c, "optimizer": optimizer, "offload": offload_activations, "process_gib": m.process_gib,
           "pinned_pow2": m.pinned_pow2_rounding, "gpu_groups": groups, "host_state": host_state}
    gpu_extra: dict[str, int] = {}  # several ranks: the GPU items beyond one rank's (planner/ranks.py)

    def host_of(b: int) -> dict[str, int]:  # per host: its ``devices`` ranks
        one = host_bytes(s, b, seq_len, **hkw)
        return one if world == 1 else rank_host_items(s, one, world=world, devices=devices, optimizer=optimizer)

    if world > 1:
        gpu_extra = rank_gpu_items(s, world=world)
        tkw["ranks"] = rank_timing(s, devices=devices, num_nodes=num_nodes, nvlink_gbps=m.nvlink_gbps,
                                   inter_host_gbps=m.inter_host_gbps, h2d_gbps=m.pcie_h2d_gbps,
                                   d2h_gbps=m.pcie_d2h_gbps)
    # the long-context options (planner/long_context.py): host memory free for the checkpoints is the limit less
    # every other host item, which no sequence length changes (per rank: a host's ranks share it evenly)
    host_free = (host_usable - sum(v for k, v in host_of(micro_batch).items() if k != "activation offload")) // devices
    placed = planned_placement(s, micro_batch, seq_len, config, gkw, host_free, gpu_limit - sum(gpu_extra.values()),
                               offload_activations)
    long_kw = {"segment": placed.segment_layers, "device_checkpoints": placed.device_checkpoints}
    gkw.update(tile=placed.seq_tile, sub=placed.sub_segment_layers, **long_kw)
    hkw.update(long_kw)
    tkw.update(tile=placed.seq_tile, sub=placed.sub_segment_layers, **long_kw)
    gpu, act = gpu_bytes(s, micro_batch, seq_len, **gkw)
    gpu = {**gpu, **gpu_extra} if gpu_extra else gpu
    host = host_of(micro_batch)
    # update_during_backward, as the engine runs it (the overlapped fp32 host Adam/AdamW of one rank): the snapshots
    # of the last layers in the host memory the other items leave free with g groups (memory.py speculated_layers)
    speculating = (config.update_during_backward is not False and host_state == "fp32" and world == 1
                   and optimizer in ("adamw", "adam"))
    speculated = speculated_layers(
        s, host_usable - sum(host_bytes(s, micro_batch, seq_len, **{**hkw, "gpu_groups": groups}).values()), groups
    ) if speculating else 0
    tkw["speculated_layers"] = speculated if overlap else 0
    tkw["copy_gbps"] = HOST_COPY_GBPS * min(1.0, rank_cores / CPU_REF_CORES)  # the snapshots' copy on these cores
    if overlap and speculated:
        host["backward snapshots"] = SNAPSHOT_BYTES * sum(ly.numel for ly in s.layers[len(s.layers) - speculated:])
    t = step_time(s, micro_batch, seq_len, **tkw)
    max_host = largest(lambda b: sum(host_of(b).values()) <= host_usable)
    max_mb = largest(lambda b: _gpu_peak({**gpu_bytes(s, b, seq_len, **gkw)[0], **gpu_extra}) <= gpu_limit)
    exposed = lambda tb: tb["transfers exposed"] > 0.01 * tb["GPU compute"]
    min_hide = None
    if exposed(t):  # the smallest micro-batch whose transfers hide (None: none up to 2**16)
        last = largest(lambda b: exposed(step_time(s, b, seq_len, **tkw)), 1 << 16)
        min_hide = last + 1 if last < 1 << 16 else None
    step = t["step total"] = _step_total(t)
    overlapped_step = None  # the step with overlap_optimizer=True: the CPU optimizer warning recommends it if faster
    if not overlap:
        overlapped_step = _step_total(step_time(s, micro_batch, seq_len, **{
            **tkw, "overlap_optimizer": True,
            "opt_rate": host_update_gparams(optimizer, host_state, True) * rank_cores / CPU_REF_CORES,
            "speculated_layers": speculated}))
    tokens = micro_batch * seq_len * grad_accum * world
    active = sum(ly.active for ly in s.layers) + s.resident_params
    model_flops = 6 * (active - s.embedding_params + (s.vocab * s.hidden if s.tied else 0))  # non-embedding + head
    attn = 3 * sum(_attn_flops(s, ly, seq_len) for ly in s.layers)  # fwd + bwd, no recompute
    p = Plan(
        model=s.name, precision=precision, optimizer=optimizer, loss=loss, seq_len=seq_len, micro_batch=micro_batch,
        grad_accum=grad_accum, offload_activations=offload_activations, n_params=s.n_params, n_layers=len(s.layers),
        layer_params=sum(ly.numel for ly in s.layers), max_layer_params=max(ly.numel for ly in s.layers),
        resident_params=s.resident_params, active_params=active, host=host, host_limit=host_limit,
        host_reserve=host_limit - host_usable, gpu=gpu,
        gpu_limit=gpu_limit, max_micro_batch=max_mb, max_micro_batch_host=max_host,
        activation_per_token={"saved": act[0], "transient": act[1]}, time=t,
        transfers_hidden=not exposed(t), min_micro_batch_to_hide=min_hide, tokens_per_step=tokens,
        tokens_per_s=tokens / step, model_tflops=model_flops * tokens / step / 1e12,
        mfu=model_flops * tokens / step / (world * PEAK_TFLOPS * 1e12),
        mfu_with_attention=(model_flops + attn) * tokens / step / (world * PEAK_TFLOPS * 1e12),
        assumptions={"achieved_tflops": tflops, "attention_tflops": list(tkw["attn_tflops"] or []) or None,
                     "pcie_h2d_gbps": m.pcie_h2d_gbps, "pcie_d2h_gbps": m.pcie_d2h_gbps,
                     "pcie_duplex_gbps": m.pcie_duplex_gbps, "cpu_cores": cores, "num_slots": config.num_slots,
                     "loss_chunk_size": loss_chunk_size, "attn_implementation": s.attn,
                     "optimizer_overlaps_gpu": overlap, "pinned_pow2_rounding": m.pinned_pow2_rounding,
                     "gpu_optimizer_groups": groups, "compile_layers": config.compile_layers,
                     **({"layers_updated_during_backward": speculated} if overlap and speculating else {})})
    requested = {k: getattr(config, k) for k in ("seq_tile", "segment_layers", "sub_segment_layers",
                                                 "device_checkpoints")}
    if (seq_len > AUTO_MIN_POSITIONS or placed.seq_tile is not None or placed.segment_layers > 1
            or placed.device_checkpoints > 0 or any(v != "auto" for v in requested.values())):
        base = {k: v for k, v in gkw.items() if k not in ("tile", "segment", "device_checkpoints", "sub")}
        p.long_context = {
            "requested": requested, "seq_tile": placed.seq_tile, "segment_layers": placed.segment_layers,
            "sub_segment_layers": placed.sub_segment_layers,
            "device_checkpoints": placed.device_checkpoints, "checkpoints": checkpoints(s, placed.segment_layers),
            "checkpoint_bytes": placed.checkpoint_bytes, "checkpoints_host_bytes": host["activation offload"],
            "host_free_for_checkpoints": host_free, "fits": placed.fits, "why": placed.why,
            "longest_seq_len": longest_placeable(s, micro_batch, config=config, gkw=base, host_free=host_free,
                                                 gpu_limit=gpu_limit) if offload_activations else None,
        }
    p.host_state = host_state
    if c < 4:  # fp32: the memo's kernel (cuDNN's) runs fp16/bf16 only
        p.memo_bound = memo_saved_s(s, micro_batch, seq_len, grad_accum=grad_accum, tflops=tflops,
                                    attn_tflops=tkw["attn_tflops"])
        # the partial memos' room: the share of the GPU keep_layers="auto" fills too, the rest for fragmentation
        p.memo_fitting = memo_layers_fitting(s, micro_batch, seq_len, c, int(DEVICE_FRACTION * gpu_limit)
                                             - p.gpu_total + gpu.get("attention memos", 0))
    if world > 1:
        setup = rank_setup_bytes(s, devices=devices, process_bytes=int(m.process_gib * GIB))
        p.ranks = rank_summary(s, devices=devices, num_nodes=num_nodes, host=host, setup=setup, time=t,
                               nvlink_gbps=m.nvlink_gbps, inter_host_gbps=m.inter_host_gbps, cores=cores)
    p.warnings = plan_warnings(p, s, overlapped_step)
    if overlap and optimizer in ("adamw", "adam") and host_state == "fp32":  # planned for the fp32 host Adam only
        # counted without the updates during backward: the groups are placed once, and a step whose hooks or
        # clipping stop the speculation must still not wait for the host
        p.suggested_gpu_optimizer_groups = groups_to_hide_optimizer(
            s, micro_batch, seq_len, gkw, {**tkw, "speculated_layers": 0}, gpu_limit)
    return p


def host_update_gparams(optimizer: str, host_state: str, overlapped: bool) -> float:
    """Gparam/s of the host optimizer step on ``CPU_REF_CORES`` cores: CompactAdamW's native kernel for a compact
    ``host_state``, torch's fused AdamW for an overlapped Adam/AdamW step, else the optimizer's serial rate."""
    if host_state != "fp32":
        return COMPACT_ADAM_GPARAMS
    return TORCH_ADAM_GPARAMS if overlapped and optimizer in ("adamw", "adam") else OPTIMIZERS[optimizer][1]


def _step_total(t: dict[str, float]) -> float:
    """Seconds per step from step_time's items: the serial ones (H2D and D2H busy overlap compute; "  of which" are
    parts)."""
    return sum(v for k, v in t.items() if not k.startswith(("  ", "H2D", "D2H")))
