"""Several ranks in the planner (planner/ranks.py, [Note: planning several ranks]): one rank plans as before, the host
items follow the shard layout to the byte, the collectives' time follows the ring formula, and the numbers
docs/multi-gpu.md ("Planning several ranks") prints are pinned here."""

from __future__ import annotations

import json

import pytest

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import Machine, plan
from lightning_megatrain.planner.command import plan_main
from lightning_megatrain.planner.constants import COLLECTIVE_LATENCY_S, NCCL_GPU_GIB, NVLINK_GBPS
from lightning_megatrain.planner.ranks import ring_seconds, shard
from lightning_megatrain.planner.shape import describe

from helpers.shapes import LLAMA_3B

QWEN25_14B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
              "tie_word_embeddings": False}
QWEN25_32B = QWEN25_14B | {"intermediate_size": 27648, "num_hidden_layers": 64}
SERIAL = EngineConfig(overlap_optimizer=False, compile_layers=False, gpu_optimizer_groups=0)
# the lent H200 kinds: ranks -> (host RAM GiB, cores); one rank is the single-GPU machine
HOSTS = {1: (128, 16), 2: (256, 32), 4: (512, 64), 8: (560, 128)}
BATCH = dict(seq_len=1024, micro_batch=8, grad_accum=4, config=SERIAL)  # benchmarks/ranks.py's defaults


def _on(devices: int, **kw):
    ram, cores = HOSTS[devices]
    return plan(LLAMA_3B, **BATCH, devices=devices, machine=Machine(host_ram_gib=ram, gpu_mem_gib=139,
                                                                     cpu_cores=cores), **kw)


def test_one_rank_is_todays_plan():
    machine = Machine(host_ram_gib=125, gpu_mem_gib=139, cpu_cores=16)
    before = plan(LLAMA_3B, **BATCH, machine=machine)
    one = plan(LLAMA_3B, **BATCH, machine=machine, devices=1, num_nodes=1)
    assert one.report() == before.report()
    assert json.dumps(one.to_dict(), sort_keys=True) == json.dumps(before.to_dict(), sort_keys=True)
    assert one.ranks is None and "ranks" not in one.to_dict() and "Ranks:" not in one.report()


def test_host_items_follow_the_shard_layout_to_the_byte():
    s = describe(LLAMA_3B)
    p = _on(2)
    W, r = 2, shard(s.resident_params, 2)
    layers = sum(shard(ly.numel, W) for ly in s.layers)
    per_rank = p.ranks["host_per_rank"]
    assert per_rank["masters"] == 4 * layers + 4 * W * r  # residents whole on every rank
    assert per_rank["grads"] == 4 * (layers + r)
    assert per_rank["optimizer states"] == 8 * (layers + r)
    assert "resident grads (whole)" not in per_rank  # reduce-scattered from the device (engine/sharded_step.py)
    assert p.host["masters"] == 2 * per_rank["masters"]  # a host holds its 2 ranks
    # the host state: 16 B per layer parameter, 4N + 12 per resident one (docs/multi-gpu.md), up to the padding
    state = p.host["masters"] + p.host["grads"] + p.host["optimizer states"]
    exact = 16 * (s.n_params - s.resident_params) + (4 * W + 12) * s.resident_params
    assert 0 <= state - exact <= 16 * W * (len(s.layers) + 1)
    assert p.ranks["setup_host_bytes"] == 2 * (4 * s.n_params + 3 * GIB)


def test_gpu_items_per_rank():
    s = describe(LLAMA_3B)
    p1, p8 = _on(1), _on(8)
    largest = max(shard(ly.numel, 8) for ly in s.layers)
    assert p8.gpu["all-gather buffer (8 x largest shard)"] == 4 * 8 * largest
    assert p8.gpu["NCCL communicator"] == int(NCCL_GPU_GIB * GIB)
    assert p8.gpu_total - p1.gpu_total == 4 * 8 * largest + int(NCCL_GPU_GIB * GIB)


def test_ring_seconds():
    # within a host: D (W - 1) / W over NVLink; across hosts the network into each host bounds it
    assert ring_seconds(400e9, 2, 1, 400.0, 50.0) == pytest.approx(0.5)
    assert ring_seconds(400e9, 8, 1, 350.0, 50.0) == pytest.approx(1.0)
    assert ring_seconds(400e9, 8, 2, 360.0, 5.0) == pytest.approx(400e9 * 0.5 / 40e9)  # the network: 8 NICs of 5
    assert ring_seconds(400e9, 8, 2, 360.0, 1000.0) == pytest.approx(400e9 * 15 / 16 / 360e9)  # NVLink bound


def test_three_b_scaling_on_the_h200_hosts():
    """docs/multi-gpu.md's table: the Llama-3.2-3B shape, 8 x 1024 tokens per micro-batch and rank, accumulation 4."""
    plans = {n: _on(n) for n in HOSTS}
    tokens = {n: round(p.tokens_per_s, -1) for n, p in plans.items()}
    assert tokens == {1: 8570, 2: 25680, 4: 57250, 8: 120200}
    assert all(p.fits for p in plans.values())
    assert {n: round(p.host_total / GIB, 1) for n, p in plans.items()} == {1: 54.1, 2: 61.7, 4: 75.9, 8: 104.3}
    assert {n: round(p.gpu_total / GIB, 1) for n, p in plans.items()} == {1: 13.6, 2: 14.9, 4: 14.9, 8: 14.9}
    two = plans[2]
    assert two.tokens_per_step == 2 * 8 * 1024 * 4
    # the gathers run on the H2D stream behind compute: what is exposed is the 8,192-token layers' uploads
    assert round(two.ranks["gathers_s"], 3) == 0.121 and round(two.time["transfers exposed"], 3) == 0.045
    # serial on the compute stream: per layer and micro-batch the flags and the reduce-scatter of 4 x 2 x S bytes
    s = describe(LLAMA_3B)
    rs = sum(2 * COLLECTIVE_LATENCY_S + ring_seconds(4 * 2 * shard(ly.numel, 2), 2, 1, NVLINK_GBPS, 0)
             for ly in s.layers)
    assert two.ranks["reduce_scatters_s"] == pytest.approx(4 * rs)
    # once a step: their grads reduce-scattered from the device, this rank's share copied down; masters gathered
    assert round(two.ranks["residents_s"], 3) == 0.062
    assert round(two.time["CPU optimizer (serial)"], 3) == 0.446  # half the parameters on 16 of the 32 cores
    alone = plan(LLAMA_3B, **BATCH, machine=Machine(host_ram_gib=256, gpu_mem_gib=139, cpu_cores=32))
    assert round(alone.tokens_per_s) == 9705 and round(two.tokens_per_s / alone.tokens_per_s, 2) == 2.65


def test_qwen25_14b_on_two_ranks_fits_a_256_gib_host_barely():
    p = plan(QWEN25_14B, **BATCH, devices=2, machine=Machine(host_ram_gib=256, gpu_mem_gib=139, cpu_cores=32))
    assert p.fits
    assert round(p.host_total / GIB, 1) == 248.1 and round(p.host_usable / GIB, 1) == 248.3
    assert p.long_context["device_checkpoints"] == 6  # the host holds most layer inputs, the GPU the rest
    assert round(p.gpu_total / GIB, 1) == 31.0
    assert round(p.tokens_per_s, -1) == 5840


def test_setup_peak_is_judged():
    """The x8 target (~32B): each rank packs the whole model at setup, 8 x 4 B/param on one host."""
    p = plan(QWEN25_32B, **BATCH, devices=8, machine=Machine(host_ram_gib=560, gpu_mem_gib=139, cpu_cores=128))
    assert not p.fits
    assert "host RAM at setup by 457.2 GiB" in p.verdict()
    assert any(w.startswith("host RAM too small at setup") for w in p.warnings)


def test_several_hosts_cost_the_network():
    kw = dict(**BATCH, devices=8, num_nodes=2)
    fast = plan(LLAMA_3B, **kw, machine=Machine(host_ram_gib=560, gpu_mem_gib=139, cpu_cores=128))
    slow = plan(LLAMA_3B, **kw, machine=Machine(host_ram_gib=560, gpu_mem_gib=139, cpu_cores=128,
                                                inter_host_gbps=1.0))
    assert fast.ranks["world"] == 16 and fast.tokens_per_step == 16 * 8 * 1024 * 4
    assert slow.ranks["gathers_s"] > 10 * fast.ranks["gathers_s"]
    assert slow.tokens_per_s < fast.tokens_per_s
    assert "inter-host 1 GB/s" in slow.report()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(devices=0), "devices and num_nodes must be ints >= 1; got devices=0"),
    (dict(num_nodes=1.5), "num_nodes=1.5"),
    (dict(devices=2, config=SERIAL.replace(overlap_optimizer=True, update_during_backward=True)),
     "update_during_backward=True"),
    (dict(devices=2, config=SERIAL.replace(gpu_optimizer_groups=3)), "gpu_optimizer_groups=3"),
    (dict(devices=2, host_state="compact"), "host_state='compact'"),
])
def test_refusals(kwargs, match):
    kw = dict(BATCH) | kwargs
    with pytest.raises(ValueError, match=match):
        plan(LLAMA_3B, **kw, machine=Machine(host_ram_gib=256, gpu_mem_gib=139, cpu_cores=32))


def test_auto_options_with_several_ranks():
    """The host step overlaps the next forward as with one rank (each rank's upload of a layer waits for its own
    share's update); device groups and updates during backward stay off."""
    machine = Machine(host_ram_gib=256, gpu_mem_gib=139, cpu_cores=32)
    p = plan(LLAMA_3B, **(BATCH | {"config": EngineConfig()}), devices=2, machine=machine)
    assert p.assumptions["optimizer_overlaps_gpu"] is True and p.assumptions["gpu_optimizer_groups"] == 0
    assert p.suggested_gpu_optimizer_groups is None
    serial = plan(LLAMA_3B, **(BATCH | {"config": EngineConfig(overlap_optimizer=False)}), devices=2, machine=machine)
    hidden = serial.time["step total"] - p.time["step total"]
    # what the first micro-batch's forward hides of the host step (torch's fused AdamW beside it: a slower rate)
    assert 0 < hidden < serial.time["CPU optimizer (serial)"]
    assert p.time["CPU optimizer (beyond the next forward)"] == pytest.approx(
        serial.time["CPU optimizer (serial)"] - hidden, abs=0.05)


def test_machine_rejects_bad_rates():
    with pytest.raises(ValueError, match="nvlink_gbps=0: need a rate in GB/s > 0"):
        Machine(nvlink_gbps=0)
    with pytest.raises(ValueError, match="inter_host_gbps=-1: need a rate in GB/s > 0"):
        Machine(inter_host_gbps=-1)


def test_command(capsys):
    args = ["--model", json.dumps(LLAMA_3B), "--seq-len", "1024", "--micro-batch", "8", "--grad-accum", "4",
            "--host-ram", "256", "--gpu-mem", "139", "--cpu-cores", "32", "--devices", "2"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "Ranks: 2 (2 per host, one host)" in out and "x 2 ranks" in out and "25,685 tokens/s" in out
    # device groups and updates during backward are refused with ranks
    assert '("auto") plan 27,646 tokens/s and fits: --overlap-optimizer --compile-layers\n' in out
    with pytest.raises(SystemExit):
        plan_main(args + ["--largest"])
    assert "--largest plans one rank" in capsys.readouterr().err


def test_command_names_the_strategys_defaults(capsys):
    """The command plans eager layers and a serial host step unless told otherwise; such a plan ends with what
    MegaTrainStrategy()'s "auto" options plan (one GPU of the 32-core host: 19,911 tokens/s measured,
    benchmarks/results/2026-12-04-ranks-megatrain-llama-3.2-3b-h200x2-x1-4cd4237.json) and the flags that plan it;
    with any of those flags given, the plan is what they say and the lines are not printed."""
    args = ["--model", json.dumps(LLAMA_3B), "--seq-len", "1024", "--micro-batch", "8", "--grad-accum", "4",
            "--host-ram", "256", "--gpu-mem", "139", "--cpu-cores", "32"]
    flags = ["--overlap-optimizer", "--update-during-backward", "--gpu-optimizer-groups", "auto", "--compile-layers"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "9,705 tokens/s" in out
    assert f'("auto") plan 19,334 tokens/s and fits: {" ".join(flags)}' in out
    assert plan_main([*args, *flags]) == 0
    out = capsys.readouterr().out
    assert "Throughput 19,334 tokens/s" in out and "command's defaults" not in out
    assert plan_main([*args, "--compile-layers"]) == 0
    assert "command's defaults" not in capsys.readouterr().out
