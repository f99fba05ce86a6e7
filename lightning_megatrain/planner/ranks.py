"""Several ranks: what ``Trainer(strategy="megatrain", devices=N, num_nodes=M)`` needs per host and per GPU, and
how long its step takes (docs/multi-gpu.md; the mechanism is engine/sharding.py, [Note: sharded host state]).

[Note: planning several ranks]
``W = N * M`` ranks, ``N`` per host. Every flat group (one per decoder layer, one for the residents) is padded to ``W
* S`` elements, ``S = ceil(numel / W)``, and rank r owns ``S`` of them. Per rank, in bytes (memory.py's items
otherwise, for the rank's own micro-batch):

- host: masters ``4 * sum(S_layer) + 4 * W * S_res`` (the residents whole on every rank), owned grads ``4 * (sum
  S_layer + S_res)``, Adam states ``8 * (sum S_layer + S_res)`` (every reduce-scatter, the residents' too, runs on
  the device and only the rank's share is copied into the pinned owned grad), the drain's grad slabs (three of the
  largest share, fp32: ``12 * max S_layer``), the offloaded layer inputs and the process allowance as with one
  rank. A host holds N of these; at setup each rank also packs the whole model's masters once (``4 B/param``, in
  place of the model's own, freed before the first step), so the setup peak per host is ``N * (4 * params +
  process)``, judged against the host's usable RAM too;
- GPU: one rank's items plus the all-gather buffer ``4 * W * max S_layer`` (engine/sharded_layers.py keeps it)
  and the NCCL communicator's buffers (``NCCL_GPU_GIB``).

Time per step, per rank (timing.py's ``step_time`` with a :class:`RankTiming`):

- each layer's upload is this rank's shard over its own PCIe link (``4 * S`` bytes) followed, on the same H2D stream,
  by the all-gather of the layer (``4 * W * S`` bytes); the H2D stream runs ahead of compute, so both hide behind
  the previous layer's compute as the single-rank upload does (only the excess is exposed);
- each layer's backward ends with a small all-reduce of presence flags and a reduce-scatter of its fp32 grads
  (``4 * W * S`` bytes) on the compute stream (serial: the next layer's backward waits for them); this rank's ``[S]``
  mean then takes the gradient drain as a layer's grads do with one rank (``4 * S`` bytes D2H into the pinned owned
  grad, or for the later micro-batches of a step the owned grad uploaded, summed on the device and written back),
  hidden behind the backward of the layers below as timing.py prices the single-rank drain;
- the residents' grads are reduce-scattered once per step and their masters all-gathered after the step, through
  the device: the grads, accumulated on the device, reduce-scattered over NCCL and the owned ``S_res`` copied into
  the owned grad (no whole drain to the host); the owned master uploaded, all-gathered and copied back whole.
  Serial; the grad norm and the finite check are one small all-reduce each (gloo);
- the host Adam steps ``sum S_layer + S_res`` parameters on the rank's ``cores // N`` cores (Lightning's launcher
  sets ``OMP_NUM_THREADS`` so): with ``overlap_optimizer`` beside the next forward, as one rank's (timing.py),
  since each rank's upload of a layer waits only for its own update of that layer's share; else serially.
  ``gpu_optimizer_groups`` and ``update_during_backward`` are refused with several ranks (engine/sharding.py
  ``sharded_config``), their ``"auto"`` off.

An all-gather or reduce-scatter of ``D`` bytes in all (the padded group) over a ring of ``W`` ranks moves ``D * (W -
1) / W`` through each rank's link (nccl-tests' PERFORMANCE.md: busbw = algbw * (n - 1) / n for both), and at least
``D * (M - 1) / M`` into each host over its ``N`` NICs; the ring pipelines the two, so it takes the longer:
``max(D (W - 1) / W / nvlink, D (M - 1) / M / (N * inter_host))`` (:func:`ring_seconds`).

Not modelled: NCCL's kernels take SMs from the concurrent compute; the ranks' PCIe links and host memory are assumed
not to limit each other (each rank its full ``pcie_h2d_gbps``); the device copy from the all-gather buffer into the
slot (8 B/param at HBM speed); a resident without a gradient on some rank, whose reduced share lands in pageable
memory and is added on the host. Measured once (benchmarks/results/2026-12-04-ranks-*, two H200s, before the
drains and the residents moved off the host): see docs/multi-gpu.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_megatrain._hardware import GIB
from lightning_megatrain.planner.constants import (
    COLLECTIVE_LATENCY_S,
    NCCL_GPU_GIB,
    OPTIMIZERS,
)
from lightning_megatrain.planner.shape import _Shape


@dataclass(frozen=True)
class RankTiming:
    """What timing.py's ``step_time`` needs for several ranks: per layer, the elements of this rank's shard, the
    seconds of its all-gather (on the H2D stream, after the shard's upload) and of its reduce-scatter (serial, on
    the compute stream); per step, the parameters the rank's host optimizer steps and the serial seconds of the
    residents' collectives."""

    shard_numels: list[int]
    gather_s: list[float]
    reduce_s: list[float]
    optimizer_params: int
    residents_s: float


def shard(numel: int, world: int) -> int:
    """Elements each of ``world`` ranks owns of a group of ``numel`` (engine/sharding.py pads to ``world * S``)."""
    return -(-numel // world)


def ring_seconds(nbytes: float, devices: int, num_nodes: int, nvlink_gbps: float, inter_host_gbps: float) -> float:
    """Seconds of one all-gather or reduce-scatter whose whole tensor is ``nbytes`` (see the note)."""
    world = devices * num_nodes
    within = nbytes * (world - 1) / world / (nvlink_gbps * 1e9)
    across = nbytes * (num_nodes - 1) / num_nodes / (devices * inter_host_gbps * 1e9) if num_nodes > 1 else 0.0
    return max(within, across)


def rank_timing(s: _Shape, *, devices: int, num_nodes: int, nvlink_gbps: float, inter_host_gbps: float,
                h2d_gbps: float, d2h_gbps: float) -> RankTiming:
    """:class:`RankTiming` of one rank of ``devices * num_nodes`` (see the note)."""
    world = devices * num_nodes
    ring = lambda b: ring_seconds(b, devices, num_nodes, nvlink_gbps, inter_host_gbps)  # noqa: E731
    shards = [shard(ly.numel, world) for ly in s.layers]
    reduce = [2 * COLLECTIVE_LATENCY_S + ring(4 * world * n) for n in shards]  # the flags, the grads
    r = shard(s.resident_params, world)
    # the grads reduce-scattered from the device and this rank's mean copied down; the owned master uploaded, gathered
    # and copied back whole
    up, down = 4 * r / (h2d_gbps * 1e9), 4 * (world + 1) * r / (d2h_gbps * 1e9)
    residents = up + down + 2 * ring(4 * world * r) + 4 * COLLECTIVE_LATENCY_S  # + the flags, finite check, norm
    return RankTiming(shard_numels=shards, gather_s=[ring(4 * world * n) for n in shards], reduce_s=reduce,
                      optimizer_params=sum(shards) + r, residents_s=residents)


def rank_host_items(s: _Shape, one_rank: dict[str, int], *, world: int, devices: int, optimizer: str) -> dict[str, int]:
    """Host bytes per host: ``devices`` ranks of ``world``, each holding the items of the note; ``one_rank`` is
    memory.py's ``host_bytes`` for one rank's micro-batch (its slabs, offloaded inputs, process)."""
    layers = sum(shard(ly.numel, world) for ly in s.layers)
    r = shard(s.resident_params, world)
    per_rank = {
        "masters": 4 * layers + 4 * world * r,
        "grads": 4 * (layers + r),
        "optimizer states": OPTIMIZERS[optimizer][0] * (layers + r),
        **{k: v for k, v in one_rank.items() if k not in ("masters", "grads", "optimizer states")},
        "grad slabs": 3 * 4 * max(shard(ly.numel, world) for ly in s.layers),  # the drain's, fp32 over the shares
    }
    return {k: devices * v for k, v in per_rank.items()}


def rank_setup_bytes(s: _Shape, *, devices: int, process_bytes: int) -> int:
    """Host bytes at setup: every rank of the host packs the whole model once in fp32 before cutting its share
    (docs/multi-gpu.md, "What does not run yet")."""
    return devices * (4 * s.n_params + process_bytes)


def rank_gpu_items(s: _Shape, *, world: int) -> dict[str, int]:
    """GPU bytes one rank has beyond a single rank's (persistent; see the note)."""
    return {
        f"all-gather buffer ({world} x largest shard)": 4 * world * max(shard(ly.numel, world) for ly in s.layers),
        "NCCL communicator": int(NCCL_GPU_GIB * GIB),
    }


def rank_summary(s: _Shape, *, devices: int, num_nodes: int, host: dict[str, int], setup: int,
                 time: dict[str, float], nvlink_gbps: float, inter_host_gbps: float, cores: int) -> dict:
    """``Plan.ranks``: the layout, the per-rank host items, the setup peak and the collectives' seconds per step
    (from timing.py's items: ``time``)."""
    return {
        "devices": devices, "num_nodes": num_nodes, "world": devices * num_nodes,
        "host_per_rank": {k: v // devices for k, v in host.items()},
        "setup_host_bytes": setup,
        "cores_per_rank": max(1, cores // devices),
        "gathers_s": time["  of which layer all-gathers"],
        "reduce_scatters_s": time["layer reduce-scatters (serial)"],
        "residents_s": time["residents' collectives (serial)"],
        "assumptions": {"nvlink_gbps": nvlink_gbps, "inter_host_gbps": inter_host_gbps,
                        "collective_latency_s": COLLECTIVE_LATENCY_S, "nccl_gpu_gib": NCCL_GPU_GIB},
    }
