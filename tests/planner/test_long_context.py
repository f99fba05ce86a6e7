"""Long context in the planner: seq_tile, segment_layers and device_checkpoints in the memory and time models
(planner/memory.py, timing.py), their placement and the longest-sequence search (planner/long_context.py), plan()'s
Long context section and the ``megatrain plan`` flags (CPU, no downloads)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lightning_megatrain import planner
from lightning_megatrain.cli import plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import Machine
from lightning_megatrain.planner.long_context import longest_placeable, place
from lightning_megatrain.planner.memory import _gpu_peak, gpu_bytes, host_bytes
from lightning_megatrain.planner.timing import step_time

from helpers.shapes import LLAMA_3B

GIB = 2**30
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "2026-12-01-planner-long-context-h200.json"
# Llama-2-7B and Llama-3.2-3B shapes (no Hub access)
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}
# one H200 (141 GiB) on a host of 125 GiB, as in the long-context issue
H200 = Machine(gpu_mem_gib=141, host_ram_gib=125, cpu_cores=16)
GKW = dict(c=2, offload=True, loss="chunked", loss_chunk=4096, num_slots=2, reserve_gib=2.0)


@pytest.fixture(scope="module")
def s7():
    return planner.describe(LLAMA_7B)


def test_tiled_layer_formula(s7):
    layer = s7.layers[0]
    assert layer.folded_norm  # Llama: post_attention_layernorm runs inside the tiles (engine/folded_norms.py)
    assert layer.folded_attn == 3  # and input_layernorm inside the tiles of q, k and v
    # untiled: the measured formula (211,080 saved, 76,800 transient)
    assert planner.layer_activation(s7, layer, 524_288, 2) == (211_080, 76_800)
    # the MLP block's own saved values (gate/up autocast copies 2 x 2H, gated intermediates 4cI = 104,448) leave, and
    # so do the folded norm's (its fp32 normalised value and rsqrt, 4H + 4): its input, the residual, is the tiles'
    # and the norm before attention's (4H + 4) with the bf16 copies of its output that q, k and v save (3 x 2H)
    block, norm, attention = 2 * 2 * 4096 + 4 * 2 * 11008, 4 * 4096 + 4, 4 * 4096 + 4 + 3 * 2 * 4096
    saved, transient = planner.layer_activation(s7, layer, 524_288, 2, 16_384)
    assert saved == 211_080 - block - norm - attention == 49_280
    # unfolded (the norms run whole): the block's fp32 input, the norm's output (4H), stays
    unfolded = dataclasses.replace(layer, folded_norm=False, folded_attn=0)
    assert planner.layer_activation(s7, unfolded, 524_288, 2, 16_384)[0] == 211_080 - block + 4 * 4096 == 123_016
    # at 1/32 of the sequence per tile the attention backward is the larger phase: 8H + c(2A + 2K) + 4A, + a tile of
    # the norm before attention and the projections' copies (8H + 4 + 3 x 2H)
    assert transient == 8 * 4096 + 2 * 4 * 4096 + 4 * 4096 + (14 * 4096 + 4) / 32 == 83_712.125
    # a tile of half the sequence: the block's phase, 14H + (block + the folded norm's 8H + 4 + 2cI) / 2
    tile_values = block + 8 * 4096 + 4 + 4 * 11008
    assert planner.layer_activation(s7, layer, 32_768, 2, 16_384)[1] == 14 * 4096 + tile_values / 2
    # a tile at least the sequence long is one tile: all of the block's activations, transient
    assert planner.layer_activation(s7, layer, 8192, 2, 16_384)[1] == 14 * 4096 + tile_values


def test_tiled_formula_matches_the_h200_measurement():
    """benchmarks/planner_long_context_check.py on the H200: saved bytes to the byte; the backward peak to the byte
    where the MLP's phase is the larger, 4 B/token above where the attention's is. It tiled the MLP alone (its
    ``run_tiled``), the norm before it untiled: the formula of an unfolded layer."""
    rows = json.loads(RESULTS.read_text())["memory"]
    assert len(rows) == 5 and {r["tile"] for r in rows} == {None, 8192, 16384}
    for r in rows:
        shape = LLAMA_7B if r["shape"] == "llama2-7b" else LLAMA_3B
        s = planner.describe(shape | {"num_hidden_layers": 1})
        layer = dataclasses.replace(s.layers[0], folded_norm=False, folded_attn=0)
        saved, transient = planner.layer_activation(s, layer, r["seq"], 2, r["tile"])
        assert saved == pytest.approx(r["saved_per_token"], abs=0.05)
        grads = (1 if r["tile"] is None else 3) * 2 * s.hidden * s.layers[0].dense_i / r["seq"]
        assert saved + transient - 4 * s.hidden + grads == pytest.approx(r["backward_peak_per_token"], abs=4)


def test_gpu_and_host_items_of_segments_and_device_checkpoints(s7):
    T = 131_072
    S = 4 * 4096 * T  # one checkpoint: the fp32 residual stream
    base, _ = gpu_bytes(s7, 1, T, **GKW, tile=16_384)
    placed, _ = gpu_bytes(s7, 1, T, **GKW, tile=16_384, segment=4, device_checkpoints=3)
    assert "layer-input checkpoints on the GPU" not in base and "phase backward: the segment's regenerated inputs" \
        not in base
    assert placed["layer-input checkpoints on the GPU"] == 3 * S
    assert placed["phase backward: the segment's regenerated inputs"] == 3 * S  # k - 1 inputs held
    # the backward starts from the top checkpoint on the GPU: no stream to restore it into
    assert base["saved layer inputs"] - placed["saved layer inputs"] == S
    assert _gpu_peak(placed) - _gpu_peak(base) == 5 * S
    one, _ = gpu_bytes(s7, 1, T, **GKW, tile=16_384, device_checkpoints=1)
    assert _gpu_peak(one) == _gpu_peak(base)  # one checkpoint on the GPU costs no peak
    many, _ = gpu_bytes(s7, 1, T, **GKW, tile=16_384, device_checkpoints=99)
    assert many["layer-input checkpoints on the GPU"] == 32 * S  # at most one per layer
    hkw = dict(c=2, optimizer="adamw", offload=True, process_gib=3.0, pinned_pow2=False)
    offloaded = lambda **kw: host_bytes(s7, 1, T, **hkw, **kw)["activation offload"]
    assert (offloaded(), offloaded(segment=4, device_checkpoints=3), offloaded(segment=5)) == (32 * S, 5 * S, 7 * S)
    assert offloaded(device_checkpoints=40) == 0


def test_time_of_replays_tiles_and_checkpoint_traffic(s7):
    T, rate = 131_072, 450e12
    tkw = dict(c=2, grad_accum=1, offload=True, tflops=450, h2d=55.4, d2h=55.3, duplex=97.0, num_slots=2,
               opt_rate=3.6)
    layer = s7.layers[0]
    forward = (2 * layer.active + planner._attn_flops(s7, layer, T)) * T / rate
    base = step_time(s7, 1, T, **tkw)
    # 8 segments of 4: 3 layer forwards replayed per segment, attention included
    assert step_time(s7, 1, T, **tkw, segment=4)["GPU compute"] - base["GPU compute"] == pytest.approx(24 * forward)
    # a tiled MLP runs its forward once more in backward: 2 * 135.3M FLOPs per token and layer; so do q, k and v,
    # tiled with the norm before attention folded in: 2 * 50.3M
    assert layer.mlp_active == 3 * 4096 * 11008 and layer.folded_attn_params == 3 * 4096 * 4096
    tiled = step_time(s7, 1, T, **tkw, tile=16_384)["GPU compute"] - base["GPU compute"]
    assert tiled == pytest.approx(32 * 2 * (layer.mlp_active + layer.folded_attn_params) * T / rate)
    # only offloaded checkpoints cross PCIe: 5 of 8 with 3 on the GPU, against 32
    weights = sum(4 * ly.numel for ly in s7.layers)
    assert base["D2H busy"] == pytest.approx((weights + 32 * 4 * 4096 * T) / 55.3e9)
    d2h = step_time(s7, 1, T, **tkw, segment=4, device_checkpoints=3)["D2H busy"]
    assert d2h == pytest.approx((weights + 5 * 4 * 4096 * T) / 55.3e9)


def _place(s, T, host_gib, gpu_gib=141, **options):
    return place(s, 1, T, config=EngineConfig(**options), gkw=GKW | {"gpu_groups": 0}, host_free=int(host_gib * GIB),
                 gpu_limit=int(gpu_gib * GIB))


def test_place_decides_auto_in_order(s7):
    # every checkpoint fits the host: one per layer, none on the GPU (the engine before these options)
    p = _place(s7, 131_072, 80)
    assert (p.seq_tile, p.segment_layers, p.device_checkpoints, p.fits) == (16_384, 1, 0, True)
    assert p.why.startswith("all 32 layer-input checkpoints of 2.0 GiB") and "64.0 GiB of 80.0 GiB free" in p.why
    # they do not: the last ones on the GPU, the fewest with which the rest fit the host (20 of 2 GiB in 40 GiB), on
    # any GPU that holds them; the GPU memory left stays free (as many as fit beside the peak put 32 there on 141 GiB,
    # 22 on 80 GiB)
    gpu = lambda T, k, n: _gpu_peak(gpu_bytes(s7, 1, T, **GKW, gpu_groups=0, tile=16_384, segment=k,
                                              device_checkpoints=n)[0])
    for gpu_gib in (141, 80):
        p = _place(s7, 131_072, 40, gpu_gib=gpu_gib)
        assert (p.segment_layers, p.device_checkpoints, p.fits) == (1, 12, True)
        assert p.host_need == 20 * 2 * GIB == p.host_free and p.gpu_peak == gpu(131_072, 1, 12)
        assert "the last 12 stay on the GPU, the fewest the host needs; 20 offloaded (40.0 GiB of 40.0 GiB" in p.why
    assert round(p.gpu_peak / GIB, 2) == 50.74 and gpu(131_072, 1, 22) - p.gpu_peak == 10 * 2 * GIB  # 58.86 unfolded
    # a GPU that does not hold those 12 beside its peak: segments of 2, all 16 checkpoints on the host
    p = _place(s7, 131_072, 40, gpu_gib=50)
    assert gpu(131_072, 1, 12) > 50 * GIB
    assert (p.segment_layers, p.device_checkpoints, p.checkpoints, p.fits) == (2, 0, 16, True)
    # neither: the smallest segment length that fits both, with the fewest on the GPU the host needs. At one per
    # layer those (27 of 32, the host holding 5 of 4 GiB) overflow the GPU; that does not end the search
    assert gpu(262_144, 1, 27) > 141 * GIB
    p = _place(s7, 262_144, 20.5)
    assert (p.segment_layers, p.device_checkpoints, p.checkpoints, p.fits) == (2, 11, 16, True)  # was 16 of 16
    assert p.host_need == 5 * 4 * GIB and round(p.gpu_peak / GIB, 2) == 92.88  # all 16 on the GPU: 112.88
    assert "does not fit with the fewest on the GPU; segments of 2 layers, 16 layer forwards replayed per " in p.why
    # where the host holds only what the GPU leaves room for, the fewest are also as many as fit (the longest flat
    # one); nested segments fit too, but replay more (36 layer forwards against 24): the flat ones are taken
    p = _place(s7, 479_232, 20.5)
    assert (p.segment_layers, p.sub_segment_layers, p.device_checkpoints, p.checkpoints, p.fits) == (4, 1, 6, 8, True)
    assert p.gpu_peak <= p.gpu_limit and p.host_need <= p.host_free
    # no flat placement fits: nested segments. 6 of 6 layers hold 3 regenerated inputs of 8 GiB at once, not 5; the
    # host holds 2 of the 6 checkpoints, the GPU the last 4 (the peak 137.2 GiB: flat, the closest needed 153.2)
    p = _place(s7, 524_288, 20.5)
    assert (p.segment_layers, p.sub_segment_layers, p.device_checkpoints, p.checkpoints, p.fits) == (6, 2, 4, 6, True)
    assert round(p.gpu_peak / GIB, 2) == 137.16 and p.host_need == 2 * 8 * GIB
    assert ("segments of 6 layers, nested in sub-segments of 2 (3 regenerated inputs held at once instead of 5), 36 "
            "layer forwards replayed per micro-batch" in p.why)


def test_place_checks_explicit_values(s7):
    p = _place(s7, 404_480, 20.5, segment_layers=4, device_checkpoints=5)
    assert (p.segment_layers, p.device_checkpoints, p.fits) == (4, 5, True) and "5 on the GPU as given" in p.why
    assert "does not fit" not in p.why  # nothing was tried before the given segments
    p = _place(s7, 524_288, 20.5, segment_layers=6)  # flat segments of 6 do not fit: nested ones of the given length
    assert (p.segment_layers, p.sub_segment_layers, p.device_checkpoints, p.fits) == (6, 2, 4, True)
    assert p.why.startswith("flat segments of 6 do not fit; nested in sub-segments of 2 (3 regenerated inputs held")
    p = _place(s7, 131_072, 20.5, segment_layers=32, device_checkpoints=100)  # one segment: one checkpoint
    assert (p.segment_layers, p.device_checkpoints, p.checkpoints, p.fits) == (32, 1, 1, True)
    p = _place(s7, 131_072, 20.5, device_checkpoints=3)  # the smallest segment length with 3 on the GPU
    assert (p.segment_layers, p.device_checkpoints, p.fits) == (3, 3, True)
    p = _place(s7, 404_480, 20.5, segment_layers=4, device_checkpoints=0)
    assert not p.fits and "with segment_layers=4, sub_segment_layers='auto', device_checkpoints=0: 8 of 6.2" in p.why
    assert "the host holds 3 (20.5 GiB of pinned host memory free)" in p.why and "closest" not in p.why


def test_place_says_why_nothing_fits(s7):
    p = _place(s7, 524_288, 20.5, sub_segment_layers=1)  # flat segments only
    assert not p.fits and (p.segment_layers, p.device_checkpoints) == (1, 0)
    # the closest: the candidate with the smallest larger shortfall, here the GPU's 12.2 GiB at segments of 4 with 6
    # on the GPU (the last searched: longer ones overflow the GPU with none on it); the old rule's closest, segments
    # of 3 with 1 on the GPU, missed the host by 59.5 GiB
    for text in ("micro-batch 1 x 524,288 tokens fit neither host nor GPU", "32 of 8.0 GiB", "256.0 GiB in all",
                 "the host holds 2 (20.5 GiB of pinned host memory free)",
                 "the GPU's 141.0 GiB leave 51.8 GiB beside its 89.2 GiB peak: 6 more inputs",
                 "the closest, segment_layers=4, sub_segment_layers=1 with device_checkpoints=6, needs 16.0 GiB of "
                 "host and a GPU peak of 153.2 GiB", "(seq_tile=16384)"):
        assert text in p.why, text
    # nested ones too: past the longest, the closest is nested
    p = _place(s7, 700_000, 20.5)
    assert not p.fits and "the closest, segment_layers=8, sub_segment_layers=3 with device_checkpoints=3" in p.why
    # the host state alone does not fit: no memory left for any checkpoint
    p = _place(s7, 131_072, -1.5)
    assert not p.fits and p.why.startswith("no host memory is left for the layer-input checkpoints of micro-batch 1 x "
                                           "131,072 tokens (32 layer-input checkpoints of 2.0 GiB")
    assert "what else it holds already exceeds it by 1.5 GiB" in p.why
    # untiled, the GPU alone is too small: the sequence's activations, not the checkpoints
    p = _place(s7, 524_288, 1000, seq_tile=None)
    assert not p.fits and "the GPU peak is 164.8 GiB of 141.0 GiB at segment_layers=1" in p.why


def test_longest_seq_len_search():
    assert planner.longest_seq_len(lambda t: t <= 300_000) == 292 * 1024
    assert planner.longest_seq_len(lambda t: False) == 0
    assert planner.longest_seq_len(lambda t: True, cap=1 << 20) == 1 << 20
    # memory drops where tiling starts: a failing doubling below does not end the search
    assert planner.longest_seq_len(lambda t: t <= 20_000 or 32_768 < t <= 70_000) == 68 * 1024
    calls = []
    planner.longest_seq_len(lambda t: calls.append(t) or t <= 300_000)
    assert len(calls) <= 15 + 9 and all(t % 1024 == 0 for t in calls)  # doublings, then bisection in steps


def test_longest_placeable_is_the_boundary(s7):
    gkw, limits = GKW | {"gpu_groups": 0}, dict(host_free=int(20.5 * GIB), gpu_limit=141 * GIB)
    longest = longest_placeable(s7, 1, config=EngineConfig(), gkw=gkw, **limits)
    assert longest == 616_448  # with nested segments
    # flat ones: 479,232 (445,440 with the norm before attention untiled, 404,480 with neither norm folded)
    assert longest_placeable(s7, 1, config=EngineConfig(sub_segment_layers=1), gkw=gkw, **limits) == 479_232
    assert place(s7, 1, longest, config=EngineConfig(), gkw=gkw, **limits).fits
    assert not place(s7, 1, longest + 1024, config=EngineConfig(), gkw=gkw, **limits).fits


def test_plan_7b_at_512k_fits_with_nested_segments():
    p = planner.plan(LLAMA_7B, seq_len=524_288, config=EngineConfig(), machine=H200)
    lc = p.long_context
    assert (lc["segment_layers"], lc["sub_segment_layers"], lc["device_checkpoints"], lc["fits"]) == (6, 2, 4, True)
    assert p.fits and p.host_total <= p.host_usable and p.gpu_total <= p.gpu_limit
    assert p.host["activation offload"] == 2 * 8 * GIB and p.gpu["layer-input checkpoints on the GPU"] == 4 * 8 * GIB
    assert p.gpu["phase backward: the segment's regenerated inputs"] == 3 * 8 * GIB  # 5 flat
    assert round(p.gpu_total / GIB, 2) == 137.16 and lc["longest_seq_len"] == 575_488  # 616,448 at 20.5 GiB free
    assert "segments of 6 layers, nested in sub-segments of 2" in p.report()


def test_plan_7b_at_512k_flat_says_why_not_and_how_long():
    p = planner.plan(LLAMA_7B, seq_len=524_288, config=EngineConfig(sub_segment_layers=1), machine=H200)
    lc = p.long_context
    assert (lc["seq_tile"], lc["segment_layers"], lc["device_checkpoints"], lc["fits"]) == (16_384, 1, 0, False)
    # the host RAM usable (the limit less what is left to the OS) less every other host item
    assert lc["longest_seq_len"] == 479_232 and lc["checkpoint_bytes"] == 8 * GIB  # 423,936, 386,048 less folded
    assert lc["host_free_for_checkpoints"] == p.host_usable - (p.host_total - p.host["activation offload"])
    assert round(p.host_total / GIB, 2) == 360.54 and round(p.gpu_total / GIB, 2) == 89.16  # untiled 164.79
    report = p.report()
    assert ("Long context (seq_tile='auto', segment_layers='auto', sub_segment_layers=1, device_checkpoints='auto')"
            in report)
    assert "NOTHING FITS" in report and "longest sequence that fits this machine at micro-batch 1: 479,232" in report
    assert any("the longest that fits at micro-batch 1 is 479,232 tokens" in w for w in p.warnings)
    assert json.loads(json.dumps(p.to_dict()))["long_context"]["longest_seq_len"] == 479_232
    # at the longest, a placement fits and the tables are planned with it
    p = planner.plan(LLAMA_7B, seq_len=479_232, config=EngineConfig(sub_segment_layers=1), machine=H200)
    lc = p.long_context
    assert (lc["segment_layers"], lc["device_checkpoints"], lc["fits"]) == (4, 6, True)
    assert p.host["activation offload"] == 2 * 4 * 4096 * 479_232
    assert p.gpu["layer-input checkpoints on the GPU"] == 6 * 4 * 4096 * 479_232
    assert p.fits and p.host_total <= p.host_usable and p.gpu_total <= p.gpu_limit
    assert not any("NOTHING" in w for w in p.warnings)


def test_plan_3b_at_256k_keeps_on_the_gpu_what_the_host_cannot_hold():
    # without the memos, which "auto" takes at this length (+22%: tests/strategy/test_attention_memo.py)
    p = planner.plan(LLAMA_3B, seq_len=262_144, config=EngineConfig(attention_memo=False), machine=H200)
    lc = p.long_context
    # 69.8 GiB of the usable host RAM free for them hold 23 of the 28 checkpoints of 3 GiB: 5 on the GPU (all 28
    # before these options; 24 and 4 with the whole 125 GiB usable)
    assert lc["host_free_for_checkpoints"] // (3 * GIB) == 23
    assert (lc["seq_tile"], lc["segment_layers"], lc["device_checkpoints"], lc["fits"]) == (16_384, 1, 5, True)
    assert p.host["activation offload"] == 23 * 3 * GIB and p.gpu["layer-input checkpoints on the GPU"] == 5 * 3 * GIB
    # was 51.44 and 127.59 before these options, 58.59 with the norm before the MLP untiled, 52.59 with the norm
    # before attention untiled: one layer's backward (20.68 GiB + 0.75 of weight grads) is now below the loss's 21.85
    assert round(p.host_total / GIB, 2) == 120.44 and round(p.gpu_total / GIB, 2) == 46.16
    assert lc["longest_seq_len"] == 1_084_416  # nested segments (992,256 flat, 822,272 with the norm before
    # attention untiled, 720,896 unfolded)


def test_plan_with_explicit_options_and_short_sequences():
    # short sequences with "auto": no section, the plan as before the options (tests/planner/test_plan_outputs.py)
    assert planner.plan(LLAMA_3B, seq_len=4096, machine=H200).long_context is None
    # explicit options always get the section, even where they change nothing
    p = planner.plan(LLAMA_3B, seq_len=4096, config=EngineConfig(seq_tile=None), machine=H200)
    assert p.long_context["requested"] == {"seq_tile": None, "segment_layers": "auto", "sub_segment_layers": "auto",
                                           "device_checkpoints": "auto"}
    p = planner.plan(LLAMA_3B, seq_len=65_536, machine=H200,
                     config=EngineConfig(seq_tile=8192, segment_layers=4, device_checkpoints=2))
    lc = p.long_context
    assert (lc["seq_tile"], lc["segment_layers"], lc["device_checkpoints"], lc["checkpoints"]) == (8192, 4, 2, 7)
    assert p.host["activation offload"] == 5 * 4 * 3072 * 65_536
    assert ("seq_tile: 8,192 positions per tile of the MLP/MoE block; segment_layers 4; sub_segment_layers 1; "
            "device_checkpoints 2" in p.report())


def test_plan_command_flags(capsys):
    model = json.dumps(LLAMA_3B)
    args = ["--model", model, "--seq-len", "65536", "--host-ram", "125", "--gpu-mem", "141", "--json"]
    assert plan_main([*args, "--seq-tile", "none", "--segment-layers", "4", "--device-checkpoints", "2"]) == 0
    lc = json.loads(capsys.readouterr().out)["long_context"]
    assert (lc["seq_tile"], lc["segment_layers"], lc["device_checkpoints"]) == (None, 4, 2)
    assert lc["requested"] == {"seq_tile": None, "segment_layers": 4, "sub_segment_layers": "auto",
                               "device_checkpoints": 2}
    assert plan_main(args) == 0  # auto: tiles of 16,384 past 32,768 positions
    assert json.loads(capsys.readouterr().out)["long_context"]["seq_tile"] == 16_384
    for flags, message in ((["--segment-layers", "0"], "segment_layers=0: need 'auto' or an int >= 1"),
                           (["--device-checkpoints", "many"], "need auto or an int; got 'many'"),
                           (["--sub-segment-layers", "0"], "sub_segment_layers=0: need 'auto' or an int >= 1"),
                           (["--seq-tile", "x"], "need auto, none or an int; got 'x'")):
        with pytest.raises(SystemExit) as error:
            plan_main([*args, *flags])
        assert error.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("shape, seq_len", [(LLAMA_7B, 524_288), (LLAMA_3B, 262_144)])
def test_docs_long_context_examples_are_the_commands_output(shape, seq_len, capsys):
    """docs/planner.md's two examples: every line but the time table's is what the command prints."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    model = {k: v for k, v in shape.items() if k != "num_key_value_heads" or v != shape["num_attention_heads"]}
    args = ["--model", json.dumps(model), "--seq-len", str(seq_len), "--host-ram", "125", "--gpu-mem", "141",
            "--cpu-cores", "16"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out.splitlines()
    timing, throughput = out.index("  Time per optimizer step"), next(i for i, line in enumerate(out)
                                                                      if line.startswith("  Throughput"))
    shown = out[:timing] + [line for line in out[timing:throughput] if "step total" in line] + out[throughput:]
    assert any(line.startswith("    longest sequence that fits this machine") for line in shown)
    assert f'--seq-len {seq_len} ' in docs
    for line in shown:
        assert line in docs, line


def test_attention_takes_its_kernels_measured_rates_on_long_rows():
    """From 32,768 tokens per row (the shortest measured) a bf16 plan prices mask-free SDPA attention at the
    kernel's own rates (planner/constants.py ATTN_FWD_TFLOPS, ATTN_BWD_TFLOPS); shorter rows, fp32 compute, a rate
    the machine names, eager attention and sliding windows shorter than the row keep the one rate. At 131,072 tokens
    the 7B step is then slower, by the attention's forward and backward seconds at those rates."""
    from lightning_megatrain.planner.constants import ATTN_BWD_TFLOPS, ATTN_FWD_TFLOPS, COMPILED_TFLOPS
    from lightning_megatrain.planner.planning import describe
    from lightning_megatrain.planner.timing import _attn_flops

    compiled = EngineConfig(compile_layers=True, keep_layers=0, attention_memo=False)  # the memos priced apart
    rates = lambda **kw: planner.plan(LLAMA_7B, machine=kw.pop("machine", H200), **kw).assumptions[  # noqa: E731
        "attention_tflops"]
    assert rates(seq_len=32768) == [ATTN_FWD_TFLOPS, ATTN_BWD_TFLOPS]
    assert rates(seq_len=16384) is None and rates(seq_len=32768, precision="32-true") is None
    assert rates(seq_len=32768, machine=dataclasses.replace(H200, achieved_tflops=400)) is None
    long = planner.plan(LLAMA_7B, seq_len=131072, config=compiled, machine=H200)
    one_rate = planner.plan(LLAMA_7B, seq_len=131072, config=compiled,
                            machine=dataclasses.replace(H200, achieved_tflops=COMPILED_TFLOPS))
    s = describe(LLAMA_7B)
    attn = 32 * _attn_flops(s, s.layers[0], 131072) * 131072  # the forward's attention FLOPs, all layers
    # forward + recompute at the forward rate, backward (counted 2x) at the backward rate, against one rate for all
    extra = attn * (2 / ATTN_FWD_TFLOPS + 2 / ATTN_BWD_TFLOPS - 4 / COMPILED_TFLOPS) / 1e12
    assert long.time["GPU compute"] - one_rate.time["GPU compute"] == pytest.approx(extra)
    windowed = dict(LLAMA_7B, model_type="mistral", sliding_window=4096)
    for model, attn_implementation in ((LLAMA_7B, "eager"), (windowed, None)):  # the rates named, not applied
        kw = dict(seq_len=32768, attn_implementation=attn_implementation)
        named = planner.plan(model, machine=H200, **kw)
        rate = named.assumptions["achieved_tflops"]
        alone = planner.plan(model, machine=dataclasses.replace(H200, achieved_tflops=rate), **kw)
        assert named.assumptions["attention_tflops"] and named.time["GPU compute"] == alone.time["GPU compute"]
