"""Each rank's CPU cores (lightning_megatrain/cpu_binding.py, [Note: rank CPU binding]): the split over NUMA nodes
and physical cores on fake sysfs trees, the GPU's node from its PCI address, and two gloo ranks bound for real."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_megatrain.cpu_binding import (
    format_cpulist,
    gpu_numa_node,
    numa_nodes,
    parse_cpulist,
    physical_cores,
    rank_cpus,
)

from helpers.ranks import launch


def _sysfs(root: Path, nodes: dict[int, str], siblings: dict[int, str]) -> Path:
    """A sysfs tree with ``nodes`` (node -> cpulist) and each CPU's hyperthread siblings (cpu -> cpulist)."""
    for node, cpus in nodes.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for cpu, sib in siblings.items():
        (root / f"devices/system/cpu/cpu{cpu}/topology").mkdir(parents=True)
        (root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").write_text(sib + "\n")
    return root


@pytest.fixture
def two_sockets(tmp_path) -> Path:
    """2 NUMA nodes of 4 physical cores, each with a hyperthread sibling numbered 8 above it (as Linux numbers
    them): node 0 is CPUs 0-3 and 8-11, node 1 CPUs 4-7 and 12-15."""
    return _sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"},
                  {c: f"{c % 8},{c % 8 + 8}" for c in range(16)})


def test_cpulists():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert parse_cpulist("") == set() and format_cpulist(set()) == ""


def test_sysfs_readers(two_sockets):
    assert numa_nodes(two_sockets) == {0: {0, 1, 2, 3, 8, 9, 10, 11}, 1: {4, 5, 6, 7, 12, 13, 14, 15}}
    assert physical_cores({0, 1, 8, 9, 4}, two_sockets) == [(0, 8), (1, 9), (4,)]
    assert physical_cores({5}, two_sockets / "nowhere") == [(5,)]  # no topology: a core of its own


def _all(world, gpus, allowed, root):
    return [rank_cpus(r, world, allowed, numa_nodes(root), gpus, root) for r in range(world)]


def test_each_rank_takes_its_gpus_node(two_sockets):
    everything = set(range(16))
    zero, one = _all(2, [0, 1], everything, two_sockets)
    assert zero.cpus == {0, 1, 2, 3, 8, 9, 10, 11} and one.cpus == {4, 5, 6, 7, 12, 13, 14, 15}
    assert one.reason == "4 of NUMA node 1's 4 physical cores, shared by 1 ranks"
    # two GPUs per node: the node's physical cores split, siblings kept together
    four = _all(4, [0, 0, 1, 1], everything, two_sockets)
    assert [set(b.cpus) for b in four] == [{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}]


def test_without_numa_the_hosts_cores_are_split(two_sockets):
    # GPUs whose node is not known (or the CPU backend): the host's 8 physical cores over 3 ranks, 3 + 3 + 2
    got = _all(3, [None, None, None], set(range(16)), two_sockets)
    assert [sorted(b.cpus) for b in got] == [[0, 1, 2, 8, 9, 10], [3, 4, 5, 11, 12, 13], [6, 7, 14, 15]]
    assert got[2].reason == "2 of the host's 8 physical cores, shared by 3 ranks"
    assert got == _all(3, [], set(range(16)), two_sockets)


def test_the_allowed_set_is_respected(two_sockets):
    # taskset/cpuset left only node 0: a GPU on node 1 has no allowed core there, so the allowed ones are split
    allowed = {0, 1, 2, 3, 8, 9, 10, 11}
    zero, one = _all(2, [0, 1], allowed, two_sockets)
    assert zero.cpus | one.cpus == allowed and not zero.cpus & one.cpus
    assert "the host's 4 physical cores" in one.reason


def test_no_binding_with_more_ranks_than_cores(two_sockets):
    assert rank_cpus(0, 3, {0, 8}, numa_nodes(two_sockets), [], two_sockets) is None  # one core, three ranks


def test_gpu_numa_node(tmp_path, monkeypatch):
    pci = tmp_path / "bus/pci/devices/0000:1b:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert gpu_numa_node(0, tmp_path) == 1
    (pci / "numa_node").write_text("-1\n")  # a single-node host's PCI devices say -1
    assert gpu_numa_node(0, tmp_path) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace())  # an older torch
    assert gpu_numa_node(0, tmp_path) is None


def _affinity(trainer, module):
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), trainer.strategy.cpu_bound


def _refit_affinity(trainer, module):
    first = _affinity(trainer, module)
    trainer.fit(module)
    return [first, _affinity(trainer, module)]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_two_ranks_are_bound_to_their_own_cores(tmp_path):
    """Two gloo ranks (started by hand as Lightning's launcher starts them: its cluster environment, so ``"auto"``
    binds): each is bound to the cores :func:`rank_cpus` gives it on this machine, disjoint; ``False`` binds none.
    tests/test_benchmark_ranks.py has them started by Lightning's launcher itself."""
    allowed = os.sched_getaffinity(0)
    want = [rank_cpus(r, 2, allowed, numa_nodes(), []) for r in range(2)]
    if None in want:
        pytest.skip(f"fewer than 2 physical cores in {sorted(allowed)}")
    # two fits on one Trainer: the second binding splits the process's first affinity again, not its share
    runs = launch(2, tmp_path / "bound", steps=1, grads=False, after=_refit_affinity)
    for rank, (run, binding) in enumerate(zip(runs, want)):
        for cpus, threads, bound in run.after:
            assert set(cpus) == binding.cpus and bound == binding, f"rank {rank}"
            assert threads <= len(binding.cpus)
    assert not set(runs[0].after[0][0]) & set(runs[1].after[0][0])
    for run in launch(2, tmp_path / "unbound", steps=1, grads=False, cpu_binding=False, after=_affinity):
        assert set(run.after[0]) == allowed and run.after[2] is None


def test_auto_leaves_torchrun_and_slurm_ranks_alone():
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    from lightning_megatrain.ranks import binds_cpus

    lightning, elastic, slurm = (e.__new__(e) for e in (LightningEnvironment, TorchElasticEnvironment,
                                                         SLURMEnvironment))
    assert binds_cpus("auto", lightning) and not binds_cpus("auto", elastic) and not binds_cpus("auto", slurm)
    assert binds_cpus(True, elastic) and not binds_cpus(False, lightning)
