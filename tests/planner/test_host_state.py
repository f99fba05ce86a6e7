"""The planner's host-state modes: bytes per parameter by mode, the errors, the largest model of a shape that fits a
128 GiB host in each mode (pinned), and ``megatrain plan --host-state`` / ``--largest``."""

from __future__ import annotations

import pytest

from lightning_megatrain import planner
from lightning_megatrain.cli import plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import HOST_STATE_BYTES, Machine
from lightning_megatrain.planner.capacity import largest_models

from helpers.shapes import LLAMA3_8B, LLAMA_3B

SERIAL = EngineConfig(overlap_optimizer=False, compile_layers=False, gpu_optimizer_groups=0)
HOST_128 = Machine(host_ram_gib=128, gpu_mem_gib=139, cpu_cores=16)


def test_host_state_bytes_per_parameter():
    """Masters, grads and moments of each mode are its bytes per parameter times the parameters; nothing else in
    the plan's host RAM changes with the mode."""
    assert {k: sum(v.values()) for k, v in HOST_STATE_BYTES.items()} == {
        "fp32": 16, "int8_moments": 10.03125, "compact": 6.03125, "compact_kahan": 8.03125}
    plans = {k: planner.plan(LLAMA_3B, seq_len=4096, config=SERIAL, machine=HOST_128, host_state=k)
             for k in HOST_STATE_BYTES}
    n = plans["fp32"].n_params
    for mode, p in plans.items():
        for item, per_param in HOST_STATE_BYTES[mode].items():
            assert p.host[item] == round(per_param * n), (mode, item)
        assert p.host_state_bytes_per_param == pytest.approx(sum(HOST_STATE_BYTES[mode].values()))
        others = {k: v for k, v in p.host.items() if k not in HOST_STATE_BYTES[mode]}
        assert others == {k: v for k, v in plans["fp32"].host.items() if k not in HOST_STATE_BYTES[mode]}
    assert "host_state" not in plans["fp32"].to_dict() and plans["compact"].to_dict()["host_state"] == "compact"
    assert "host_state compact)" in plans["compact"].report().splitlines()[0]
    assert "state 6.03 B/param" in plans["compact"].report()


def test_host_state_errors():
    with pytest.raises(ValueError, match=r"host_state='int4': choose one of \['fp32', 'int8_moments', 'compact'"):
        planner.plan(LLAMA_3B, seq_len=128, host_state="int4")
    with pytest.raises(ValueError, match=r"host_state='compact' is planned for CompactAdamW .* got optimizer='sgd'"):
        planner.plan(LLAMA_3B, seq_len=128, optimizer="sgd", host_state="compact")
    # device groups hold the compact layout on the GPU (tests/planner/test_compact_pool.py): planned, not refused
    p = planner.plan(LLAMA_3B, seq_len=128, config=EngineConfig(gpu_optimizer_groups=2), host_state="compact")
    assert p.assumptions["gpu_optimizer_groups"] == 2 and p.gpu["optimizer groups on the GPU"] > 0


def test_largest_llama3_8b_shape_on_a_128_gib_host_by_host_state():
    """Llama-3-8B's width at 4,096 tokens per micro-batch on a 128 GiB host (124.2 GiB usable): 32 layers (8.0B, the
    model itself) in fp32, 54 with 8-bit moments, 68 compact with Kahan, 93 compact (21.3B: over 20B). Each depth
    fits and the next does not."""
    caps = largest_models(LLAMA3_8B, seq_len=4096, config=SERIAL, machine=HOST_128)
    assert {c.host_state: c.layers for c in caps if not c.both_memories} == {
        "fp32": 32, "int8_moments": 54, "compact": 93, "compact_kahan": 68}
    # fp32 state with both memories (planner/pool.py): 56 layers (13.3B), 31 groups keeping their state on the GPU
    both = next(c for c in caps if c.both_memories)
    assert (both.host_state, both.layers, both.gpu_groups) == ("fp32", 56, 31)
    assert both.host_total <= both.host_usable and both.gpu_total <= 139 * 2**30
    compact = next(c for c in caps if c.host_state == "compact")
    assert compact.n_params > 20e9 and compact.host_total <= compact.host_usable
    deeper = planner.plan(LLAMA3_8B | {"num_hidden_layers": 94}, seq_len=4096, config=SERIAL, machine=HOST_128,
                          host_state="compact")
    assert not deeper.fits and deeper.host_total > deeper.host_usable


def test_cli_plan_host_state_and_largest(capsys):
    model = '{"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192, ' \
            '"num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8}'
    common = ["--model", model, "--seq-len", "4096", "--host-ram", "64", "--gpu-mem", "139", "--cpu-cores", "16"]
    assert plan_main([*common, "--host-state", "compact"]) == 0
    assert "host_state compact)" in capsys.readouterr().out
    assert plan_main([*common, "--largest"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:6]}
    assert list(rows) == ["fp32", "int8_moments", "compact", "compact_kahan"]
    layers = {k: int(v[2]) for k, v in rows.items()}
    assert out.splitlines()[6].startswith("  fp32 + GPU (auto)")
    assert layers["fp32"] < layers["int8_moments"] < layers["compact_kahan"] < layers["compact"]


def test_compact_host_state_moves_bf16_over_pcie_and_overlaps():
    """compact and compact_kahan keep bf16 weights and grads on the host: each upload and grad drain moves 2 bytes
    per parameter instead of 4 (int8_moments keeps fp32 ones); the host step overlaps the next forward with
    overlap_optimizer, and no device groups are suggested (the suggestion is planned for the fp32 host Adam)."""
    plans = {k: planner.plan(LLAMA_3B, seq_len=4096, config=SERIAL, machine=HOST_128, host_state=k)
             for k in HOST_STATE_BYTES}
    s = planner.describe(LLAMA_3B)
    layers = [ly.numel for ly in s.layers]
    h2d, d2h = HOST_128.pcie_h2d_gbps * 1e9, HOST_128.pcie_d2h_gbps * 1e9
    weights_up = 4 * (sum(layers) + sum(layers[:-2])) / h2d  # forward uploads, backward's but the 2 in slots
    grads_down = 4 * sum(layers) / d2h
    fp32 = plans["fp32"].time
    assert plans["int8_moments"].time["H2D busy"] == fp32["H2D busy"]
    for mode in ("compact", "compact_kahan"):
        t = plans[mode].time
        assert t["H2D busy"] == pytest.approx(fp32["H2D busy"] - weights_up / 2)
        assert t["D2H busy"] == pytest.approx(fp32["D2H busy"] - grads_down / 2)
    overlapped = planner.plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=HOST_128, host_state="compact",
                              config=SERIAL.replace(overlap_optimizer=True))
    serial = planner.plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=HOST_128, host_state="compact",
                          config=SERIAL)
    assert "CPU optimizer (beyond the next forward)" in overlapped.time
    assert overlapped.time["step total"] < serial.time["step total"]
    assert overlapped.suggested_gpu_optimizer_groups is None and overlapped.assumptions["gpu_optimizer_groups"] == 0
