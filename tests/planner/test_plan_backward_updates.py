"""Host updates during backward in the planner (engine/backward_updates.py, [Note: updates during backward]): the
time model of timing.py (``host_after_backward``, ``step_time(speculated_layers=...)``) and how plan() decides the
layers and shows their snapshots (CPU, no downloads)."""

from __future__ import annotations

import json

import pytest

from lightning_megatrain import planner
from lightning_megatrain.cli import plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import Machine
from lightning_megatrain.planner.timing import host_after_backward, step_time

GIB = 2**30
KEY = "CPU optimizer (beyond the next forward)"
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}
TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}
TKW = dict(c=2, grad_accum=1, offload=True, tflops=450, h2d=55.4, d2h=55.3, duplex=97.0, num_slots=2,
           overlap_optimizer=True)
OVERLAP = EngineConfig(overlap_optimizer=True, compile_layers=False, gpu_optimizer_groups=0)


@pytest.fixture(scope="module")
def s7():
    return planner.describe(LLAMA_7B)


def test_no_speculated_layer_is_the_overlapped_step_as_before(s7):
    # the host step starts when backward ends and hides behind the next forward (its layers' and the head's)
    for opt_rate, groups in ((3.1, 0), (1.0, 0), (3.1, 6), (50.0, 0)):
        kw = TKW | dict(opt_rate=opt_rate, gpu_groups=groups)
        t = step_time(s7, 32, 1024, **kw)
        assert step_time(s7, 32, 1024, **kw, speculated_layers=0) == t
        host = s7.n_params - s7.resident_params * (groups >= 1) - sum(ly.numel for ly in s7.layers[:max(groups - 1, 0)])
        forward = t["  of which layers"] / 4 + t["  of which LM head + loss"] / 3  # recompute + backward: 3 forwards
        assert t[KEY] == pytest.approx(max(0.0, host / (opt_rate * 1e9) - forward), rel=1e-12, abs=0.0)
    assert host_after_backward([0.1, 0.2], [], 7e9, 3.5) == 2.0


def test_hand_computed_three_layers():
    # opt_rate 1 Gparam/s and copies at 24 GB/s: a layer of n parameters takes 2n ns (its update n, its snapshot
    # 2 x 12 n bytes at 24 GB/s n); layers 2, 1, 0 of 0.1, 0.2, 0.05 G parameters, 0.1 G resident
    bwd = [0.3, 0.2, 0.1]  # layer 0 first
    numels = [0.1e9, 0.2e9, 0.05e9]  # layers 2, 1, 0
    host = sum(numels) + 0.1e9
    # grads final at t2 = 0.1, t1 = 0.3, t0 = 0.6 (the end of backward); layer 2 runs 0.1-0.3, layer 1 0.3-0.7;
    # layer 0 would start at 0.7, after backward ends: not speculated. Left: 0.1 s of layer 1, then layer 0 and the
    # residents without snapshots (0.15 s)
    assert host_after_backward(bwd, numels, host, 1.0, 24.0) == pytest.approx(0.1 + 0.15)
    assert host_after_backward(bwd, numels[:2], host, 1.0, 24.0) == pytest.approx(0.1 + 0.15)
    # layer 2 only: done at 0.3, before backward ends; the rest (0.35 s) after it
    assert host_after_backward(bwd, numels[:1], host, 1.0, 24.0) == pytest.approx(0.35)
    assert host_after_backward(bwd, [], host, 1.0, 24.0) == pytest.approx(0.45)


def test_hand_computed_step_time_of_a_three_layer_model():
    s = planner.describe(TINY)
    n, L = s.layers[0].numel, len(s.layers)
    assert n == 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64 and L == 3
    kw = TKW | dict(opt_rate=1e-4, copy_gbps=1e-3)  # a slow host: its step outlasts the GPU's
    base = step_time(s, 4, 64, **kw)
    f = base["  of which layers"] / (4 * L)  # one layer's forward; its backward is 3f (recompute + backward)
    head = base["  of which LM head + loss"]
    u = n / 1e5 + 24 * n / 1e6  # one layer's update and snapshot
    for k in range(L + 1):
        finish, started = 0.0, 0  # the worker, layer L-1 first, each layer's grads final 3f after the previous one's
        for j in range(k):
            start = max(finish, 3 * f * (j + 1))
            if start >= 3 * f * L:  # backward has ended: the step updates it, no snapshot
                break
            finish, started = start + u, started + n
        left = max(0.0, finish - 3 * f * L) + (s.n_params - started) / 1e5
        got = step_time(s, 4, 64, **kw, speculated_layers=k)
        assert got[KEY] == pytest.approx(max(0.0, left - L * f - head / 3), rel=1e-12)
        assert {k: v for k, v in got.items() if k != KEY} == {k: v for k, v in base.items() if k != KEY}
    # more than the host layers: as many as there are; device-group layers never
    assert step_time(s, 4, 64, **kw, speculated_layers=9) == step_time(s, 4, 64, **kw, speculated_layers=L)
    two_on_gpu = kw | dict(gpu_groups=3)  # residents and layers 0, 1
    assert (step_time(s, 4, 64, **two_on_gpu, speculated_layers=3)
            == step_time(s, 4, 64, **two_on_gpu, speculated_layers=1))


def test_speculation_shortens_a_host_step_that_outlasts_the_forward(s7):
    kw = TKW | dict(opt_rate=1.0)  # 6.7 s of host Adam against a 32K-token forward of about 1 s
    t = step_time(s7, 32, 1024, **kw)
    before, backward = t[KEY], 3 * t["  of which layers"] / 4
    after = {k: step_time(s7, 32, 1024, **kw, speculated_layers=k)[KEY] for k in (4, 8, 12, 16, 32)}
    assert before > 5.0 and before > after[4] > after[8] > after[12] > 0.0
    # each layer takes u = 0.2 s (update) + 0.06 s (snapshot, 24 B/param at 79 GB/s) against a backward of 0.09 s:
    # the worker never waits after layer 31, and the layers it would start after backward ends are left to the
    # step, without snapshots (11 here): speculating more than those changes nothing
    n, b = s7.layers[0].numel, backward / 32
    u = n / 1e9 + 24 * n / 79e9
    k = sum(1 for j in range(32) if b + j * u < 32 * b)
    assert k == 11 and after[12] == after[16] == after[32]
    assert before - after[32] == pytest.approx(k * n / 1e9 - (b + k * u - 32 * b), rel=1e-9)
    # without the overlapped step nothing changes
    serial = kw | dict(overlap_optimizer=False)
    assert step_time(s7, 32, 1024, **serial, speculated_layers=32) == step_time(s7, 32, 1024, **serial)


def _tiny_plan(host_gib: float, **kw) -> planner.Plan:
    return planner.plan(TINY, seq_len=64, micro_batch=4, machine=Machine(host_ram_gib=host_gib, gpu_mem_gib=80,
                                                                         cpu_cores=16), **{"config": OVERLAP, **kw})


def test_plan_speculates_the_layers_whose_snapshots_fit_the_free_host_memory():
    off = _tiny_plan(64, config=OVERLAP.replace(update_during_backward=False))
    n, snapshot = off.max_layer_params, 12 * off.max_layer_params
    assert "backward snapshots" not in off.host and "layers_updated_during_backward" not in off.assumptions
    # a host whose usable memory leaves 4 GiB + 2.5 snapshots free: 2 layers, the last two
    usable = off.host_total + 4 * GIB + 2.5 * snapshot
    p = _tiny_plan((usable + 2 * GIB) / GIB)  # the OS keeps max(2 GiB, 3%): 2 GiB here
    assert p.host_usable - off.host_total == pytest.approx(4 * GIB + 2.5 * snapshot, abs=2)
    assert p.assumptions["layers_updated_during_backward"] == 2
    assert p.host["backward snapshots"] == 2 * snapshot == 24 * n
    assert p.host_total == off.host_total + 2 * snapshot <= p.host_usable - 4 * GIB and p.fits
    assert p.report().count("backward snapshots") == 1
    # plenty: every layer; none free beyond the 4 GiB: none, and no item
    assert _tiny_plan(64).assumptions["layers_updated_during_backward"] == 3
    tight = _tiny_plan((off.host_total + 4 * GIB + 2 * GIB + snapshot // 2) / GIB)
    assert tight.assumptions["layers_updated_during_backward"] == 0 and "backward snapshots" not in tight.host
    assert tight.host_total == off.host_total
    # the engine speculates only with the overlapped step and the fp32 host Adam/AdamW on one rank
    for kw in (dict(config=OVERLAP.replace(overlap_optimizer=False)), dict(host_state="int8_moments"),
               dict(optimizer="sgd"), dict(devices=2, config=OVERLAP.replace(overlap_optimizer=False))):
        p = _tiny_plan(64, **kw)
        assert "backward snapshots" not in p.host and "layers_updated_during_backward" not in p.assumptions


def test_device_groups_are_never_speculated():
    p = _tiny_plan(64, config=OVERLAP.replace(gpu_optimizer_groups=3))  # residents and layers 0, 1
    assert p.assumptions["layers_updated_during_backward"] == 1
    assert p.host["backward snapshots"] == 12 * p.max_layer_params


def test_llama_7b_defaults_keep_their_device_groups_and_speculate_in_what_is_left():
    # 32 x 1024 on the H200 (125 GiB host, 16 cores): the device groups that hide the host Adam are counted without
    # updates during backward (22: a step whose hooks or clipping stop them must not wait either); the host memory
    # those groups free holds the snapshots of the last 11 host layers
    h200 = Machine(host_ram_gib=125, gpu_mem_gib=139, cpu_cores=16)
    plans = {u: planner.plan(LLAMA_7B, seq_len=1024, micro_batch=32, machine=h200,
                             config=EngineConfig(update_during_backward=u)) for u in (False, "auto")}
    assert [plans[u].assumptions["gpu_optimizer_groups"] for u in (False, "auto")] == [22, 22]
    assert plans["auto"].assumptions["layers_updated_during_backward"] == 11
    assert all(p.time[KEY] == 0.0 and p.fits for p in plans.values())
    assert plans["auto"].host_total <= plans["auto"].host_usable - 4 * GIB
    # without device groups the host has no memory left for snapshots
    none = planner.plan(LLAMA_7B, seq_len=1024, micro_batch=32, machine=h200,
                        config=EngineConfig(gpu_optimizer_groups=0))
    assert none.assumptions["layers_updated_during_backward"] == 0


def test_plan_command_flag(capsys):
    args = ["--model", json.dumps(TINY), "--seq-len", "64", "--micro-batch", "4", "--host-ram", "64", "--json",
            "--overlap-optimizer"]
    assert plan_main(args) == 0
    assert "layers_updated_during_backward" not in json.loads(capsys.readouterr().out)["assumptions"]
    assert plan_main([*args, "--update-during-backward"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["layers_updated_during_backward"] == 3
