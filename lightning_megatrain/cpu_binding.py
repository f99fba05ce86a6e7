"""Each rank's CPU cores: the host optimizer step of a rank runs on cores of its own, near its GPU.

[Note: rank CPU binding]
With several ranks on one host every rank runs a host Adam step over its share of the state (engine/sharding.py,
[Note: sharded host state]) at the same time as the others, on ``OMP_NUM_THREADS`` threads (Lightning's launcher
sets cores / ranks). Unbound, the kernel schedules those threads over every core, so the ranks' threads share cores
and a rank's threads run on the NUMA node far from the pinned host memory its GPU reads. :func:`bind_rank` gives
each rank a disjoint set of whole physical cores (every hyperthread sibling of a core goes with it):

- where the host has several NUMA nodes and every GPU of the host names its node (the PCI device's ``numa_node`` in
  sysfs), a rank gets the allowed cores of its GPU's node, shared evenly with the other ranks whose GPU is there;
- otherwise (one node, a node not known, the CPU backend) the host's allowed cores are split evenly over the ranks
  in local-rank order.

"Allowed" is the process's affinity when bound (a cgroup cpuset or ``taskset`` narrows it; every rank started by
Lightning's launcher inherits the same). Every thread of the process is bound (threads already started, such as a
data loader's, would otherwise keep the old set), and torch's intra-op threads are capped at the cores bound.
Nothing is bound where a rank would get no core (more ranks than cores), nor, by default, where the processes were
started by something other than Lightning's launcher (torchrun, SLURM: ranks.py tells by the cluster environment):
those have their own binding flags (``torchrun --numa-binding``, ``srun --cpu-bind``), whose per-rank sets this
must not split again. A bound process stays bound after ``fit`` (rank 0 is the script's own process).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SYS = Path("/sys")


def format_cpulist(cpus: set[int] | frozenset[int]) -> str:
    """``cpus`` as a sysfs cpulist (``{0, 1, 2, 3, 8}`` -> ``"0-3,8"``)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpulist(text: str) -> set[int]:
    """The CPU ids of a sysfs cpulist (``"0-3,8,10-11"``)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def numa_nodes(sys_root: Path = SYS) -> dict[int, set[int]]:
    """NUMA node -> its CPU ids, from sysfs (empty where sysfs does not say)."""
    base = sys_root / "devices/system/node"
    nodes = {}
    for path in sorted(base.glob("node[0-9]*")):
        try:
            nodes[int(path.name[4:])] = parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def physical_cores(cpus: set[int], sys_root: Path = SYS) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (each group the hyperthread siblings present in ``cpus``), ordered by the
    lowest id of each group; a CPU whose siblings sysfs does not give is a core of its own."""
    groups: dict[tuple[int, ...], set[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = parse_cpulist((sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
                                     .read_text())
        except (OSError, ValueError):
            siblings = {cpu}
        key = tuple(sorted(siblings | {cpu}))
        groups.setdefault(key, set()).add(cpu)
    return sorted((tuple(sorted(g)) for g in groups.values()), key=min)


def gpu_numa_node(index: int, sys_root: Path = SYS) -> int | None:
    """The NUMA node of CUDA device ``index`` (its PCI device's ``numa_node``), or None where not known."""
    try:
        props = torch.cuda.get_device_properties(index)
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int((sys_root / "bus/pci/devices" / address / "numa_node").read_text())
    except (AssertionError, AttributeError, OSError, RuntimeError, ValueError):  # no CUDA, an older torch, no sysfs
        return None
    return node if node >= 0 else None


@dataclass(frozen=True)
class Binding:
    """The CPUs one rank is bound to, and why (for the log)."""

    cpus: frozenset[int]
    reason: str


def rank_cpus(local_rank: int, local_world: int, allowed: set[int], nodes: dict[int, set[int]],
              gpu_nodes: list[int | None], sys_root: Path = SYS) -> Binding | None:
    """The cores of local rank ``local_rank`` of ``local_world`` on this host (see the note); None where its share
    is no core. ``gpu_nodes``: per local rank, its GPU's NUMA node (None: not known; empty: no GPUs)."""
    peers, pool, where = list(range(local_world)), allowed, "the host's"
    # decided alike on every rank (the same inputs): by node only where every rank's node has allowed cores
    by_node = (len(nodes) > 1 and len(gpu_nodes) == local_world
               and all(n is not None and nodes.get(n, set()) & allowed for n in gpu_nodes))
    if by_node:
        node = gpu_nodes[local_rank]
        peers = [r for r in range(local_world) if gpu_nodes[r] == node]
        pool, where = nodes[node] & allowed, f"NUMA node {node}'s"
    cores = physical_cores(pool, sys_root)
    share, extra = divmod(len(cores), len(peers))
    if share == 0:
        return None
    k = peers.index(local_rank)
    first = k * share + min(k, extra)  # the first `extra` ranks take one core more
    mine = cores[first : first + share + (k < extra)]
    cpus = frozenset(c for core in mine for c in core)
    return Binding(cpus, f"{len(mine)} of {where} {len(cores)} physical cores, shared by {len(peers)} ranks")


# The process's affinity before its first binding: a later Trainer entry (validate, test, a second fit) binds again
# and must split this set, not the share the first binding left.
_UNBOUND: set[int] | None = None


def _bind_all_threads(cpus: frozenset[int], unbound: set[int]) -> None:
    """Bind the calling thread to ``cpus`` (raises if it cannot), then every other thread of the process still on
    ``unbound`` (one that has exited meanwhile, or whose affinity something else set, is left)."""
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == unbound:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue


def bind_rank(local_rank: int, devices: list[torch.device], sys_root: Path = SYS) -> Binding | None:
    """Bind this process, local rank ``local_rank`` of the host's ranks computing on ``devices`` (one each, by local
    rank), to its cores and cap torch's threads at them (see the note); the binding, or None where none was made."""
    global _UNBOUND
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        return None
    if _UNBOUND is None:
        _UNBOUND = os.sched_getaffinity(0)
    gpus = [gpu_numa_node(d.index or 0, sys_root) for d in devices if d.type == "cuda"]
    binding = rank_cpus(local_rank, len(devices), _UNBOUND, numa_nodes(sys_root), gpus, sys_root)
    if binding is None:
        log.info("MegaTrain: rank %d not bound to CPUs: fewer physical cores than the ranks sharing them", local_rank)
        return None
    _bind_all_threads(binding.cpus, os.sched_getaffinity(0))
    threads = min(torch.get_num_threads(), len(binding.cpus))
    torch.set_num_threads(threads)
    log.info("MegaTrain: rank %d bound to CPUs %s (%s; %d torch threads)", local_rank,
             format_cpulist(binding.cpus), binding.reason, threads)
    return binding
