"""The 70B/120B class (docs/scale.md): the plans of the truncated Llama-3.1-70B and gpt-oss-120b shapes against
their H200 runs, the gpt-oss-120b shape as the planner reads it, and the full-depth and largest-model tables, pinned
as the planner computes them (benchmarks/scale_plan.py prints the tables; CPU, no downloads)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lightning_megatrain import planner
from lightning_megatrain._hardware import GIB
from lightning_megatrain.planner.capacity import largest_models, with_layers
from lightning_megatrain.planner.shape import load_config
from lightning_megatrain.planner.timing import _attn_flops

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def scale():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_scale_plan", BENCH / "scale_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_truncated_runs_against_their_plans(scale):
    """The H200 runs of 2 and 4 Llama-3.1-70B layers (fp32) and 2 and 3 gpt-oss-120b layers (compact), 8 x 4,096,
    every layer recomputed, beside their plans (docs/scale.md): host RAM within 2.5% per run and per layer for all;
    70B tokens/s within 10% (it was 16-17% slow while the plan priced a host pass over the residents' grads that
    the engine no longer makes); the GPU planned above the runs (eager activations for compiled layers). gpt-oss
    with grouped_mm experts and eager layers (compile_layers="auto"'s choice for it): tokens/s +11% and +2% (within
    10% at 3 layers, not at 2); with eager experts and compiled layers 2.3-2.4x too fast (3.0 s per layer against
    1.07 planned: the experts' loop, which the plan does not price), which the docs say."""
    rows = scale.measured_rows()
    grouped, eager = "gpt-oss-120b (grouped_mm experts)", "gpt-oss-120b (eager experts)"
    assert [(r["model"], r["layers"], r["host_state"]) for r in rows] == [
        ("llama-3.1-70b", 2, "fp32"), ("llama-3.1-70b", 4, "fp32"), (grouped, 2, "compact"), (grouped, 3, "compact"),
        (eager, 2, "compact"), (eager, 3, "compact")]
    H, I, kv = 8192, 28672, 1024  # noqa: E741
    layer = 2 * H * H + 2 * H * kv + 3 * H * I + 2 * H  # q, o; k, v; gate, up, down; 2 norms
    assert rows[1]["plan"].n_params == rows[1]["n_params"] == 4 * layer + 2 * 128256 * H + H  # untied embeddings
    assert all(abs(r["host_err"]) < 0.025 for r in rows)  # -1% to +2.1%
    assert [round(r["tokens_per_s_err"], 2) for r in rows[:4]] == [-0.06, -0.08, 0.11, 0.02]
    assert all(r["gpu_err"] > 0 for r in rows)  # the plan errs on the side of fitting
    assert [round(r["tokens_per_s_err"], 1) for r in rows[4:]] == [1.3, 1.4]
    llama, oss, oss_eager = scale.per_layer(rows)
    assert abs(llama["host_plan"] / llama["host_measured"] - 1) < 0.01
    assert all(abs(one["host_plan"] / one["host_measured"] - 1) < 0.02 for one in (oss, oss_eager))
    assert round(llama["step_plan"] / llama["step_measured"] - 1, 2) == 0.15
    assert round(oss["step_plan"] / oss["step_measured"] - 1, 2) == 0.28  # a layer 0.83 s, planned 1.07
    assert round(oss_eager["host_step_plan"] / oss_eager["host_step_measured"] - 1, 2) == -0.05  # compact, in a run


def test_where_the_truncated_steps_go(scale):
    """docs/scale.md's split of each measured step against its plan (``step_split``). 70B: the plan's two parts are
    each within 0.3 s of the runs'. gpt-oss with grouped_mm experts in uncompiled layers: the step less the
    thread's wait for the host step is 0.51 s (2 layers) and 0.64 s (3 layers) above the plan's non-host part, GPU
    or training-thread time the plan does not price (not measured apart), while the plan's host term is 0.20 and
    0.57 s above the measured waits: the two errors partly cancel, which is why 2 layers is +11% and 3 layers +2%.
    The worker's wall time less the wait is the same at both depths of a model (0.46 s gpt-oss, 0.63 s 70B): the end
    of the previous step that the worker waits for before its first update ([Note: late grads])."""
    split = scale.step_split(scale.measured_rows())
    llama2, llama4, oss2, oss3 = split[:4]
    for d in (llama2, llama4):
        assert abs(d["rest"] - d["plan_rest"]) < 0.3 and abs(d["waited"] - d["plan_host"]) < 0.1
    assert [round(d["rest"] - d["plan_rest"], 2) for d in (oss2, oss3)] == [0.51, 0.64]
    assert [round(d["plan_host"] - d["waited"], 2) for d in (oss2, oss3)] == [0.20, 0.57]
    assert [round(d["host_step"] - d["waited"], 2) for d in (oss2, oss3, llama2, llama4)] == [0.46, 0.46, 0.64, 0.64]


def test_gpt_oss_120b_shape(scale):
    """The Hub config: 116.8B parameters, 5.71B active per token (both embeddings and 4 of 128 experts; 5.13B without
    the input embedding, the model card's 5.1B), sliding (128) and full attention alternating, and the FLOPs of a
    layer counted on its active parameters. Truncated, the layer pattern repeats and the count is linear."""
    s = planner.describe(scale.GPT_OSS_120B)
    assert (s.n_params, len(s.layers), s.experts, s.top_k, s.expert_i) == (116_829_156_672, 36, 128, 4, 2880)
    active = sum(ly.active for ly in s.layers) + s.resident_params
    assert active == 5_711_982_912 and round((active - s.embedding_params) / 1e9, 2) == 5.13
    assert [ly.window for ly in s.layers[:4]] == [128, None, 128, None]
    assert sum(ly.window == 128 for ly in s.layers) == 18
    assert s.attn == "eager"  # transformers has no sdpa for gpt-oss (attention sinks): the CLI's "auto" picks eager
    ly = s.layers[0]
    expert = 128 * (2880 * 2 * 2880 + 2 * 2880 + 2880 * 2880 + 2880)  # gate_up and down, with biases, per expert
    assert ly.moe and ly.active == ly.numel - expert + expert * 4 // 128
    assert _attn_flops(s, s.layers[0], 4096) == 4 * 64 * 64 * 128 * (1 - 128 / (2 * 4096))
    four = planner.describe(with_layers(load_config(scale.GPT_OSS_120B), 4))
    assert [ly.window for ly in four.layers] == [128, None, 128, None]
    assert four.n_params == s.resident_params + 4 * ly.numel
    hub = json.loads(scale.GPT_OSS_120B.read_text())  # a config dict (benchmarks/memory_pool.py) cut the same way
    cut = with_layers(hub, 3)
    assert cut["num_hidden_layers"] == 3 and hub["num_hidden_layers"] == 36  # a copy
    assert cut["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]


def test_full_depth_on_a_1_5_and_a_1_tib_host(scale):
    """Llama-3.1-70B and gpt-oss-120b at 8 x 4,096 on one H200 with 16 host cores: host RAM, fits 1.5 / 1 TiB,
    tokens/s. 120B fits 1 TiB with compact (690 GiB) or compact_kahan (908 GiB) only; fp32 (1,775 GiB) does not fit
    even 1.5 TiB."""
    rows = {(r["model"], r["host_state"]): r for r in scale.full_rows()}
    got = {k: (round(r["plan"].host_total / GIB, 1), r["fits"][1536], r["fits"][1024], round(r["plan"].tokens_per_s))
           for k, r in rows.items()}
    assert got == {
        ("Llama-3.1-70B", "fp32"): (1139.1, True, False, 689),
        ("Llama-3.1-70B", "int8_moments"): (746.9, True, True, 761),
        ("Llama-3.1-70B", "compact"): (484.1, True, True, 765),
        ("Llama-3.1-70B", "compact_kahan"): (615.5, True, True, 765),
        ("gpt-oss-120b", "fp32"): (1774.5, False, False, 588),
        ("gpt-oss-120b", "int8_moments"): (1125.1, True, False, 678),
        ("gpt-oss-120b", "compact"): (689.8, True, True, 837),
        ("gpt-oss-120b", "compact_kahan"): (907.5, True, True, 837),
    }
    for (_, state), r in rows.items():  # the state is its bytes per parameter; the GPU fits in every row
        assert r["plan"].host_state_bytes_per_param == pytest.approx(sum(planner.HOST_STATE_BYTES[state].values()))
        assert r["plan"].gpu_total <= r["plan"].gpu_limit
    # the 1 TiB verdict is the plan's own at --host-ram 1024 (the host items do not depend on the limit here)
    at_1024 = planner.plan(scale.GPT_OSS_120B, seq_len=scale.SEQ, micro_batch=scale.MICRO_BATCH,
                           config=scale.ENGINE, machine=scale.machine(1024), host_state="int8_moments")
    assert not at_1024.fits and at_1024.host_total == rows["gpt-oss-120b", "int8_moments"]["plan"].host_total


def test_largest_llama_31_70b_width_on_a_128_gib_host(scale):
    """megatrain plan --largest for the Llama-3.1-70B width at 8 x 4,096 on a 128 GiB host (docs/scale.md; the 1.5
    TiB column comes from the same command): 6 layers in fp32, 12 with 8-bit moments, 15 compact with Kahan, 21
    compact (20.1B), 10 with fp32 state in both memories; in both memories too, 17 with 8-bit moments, 26 compact
    with Kahan, 33 compact (30.3B, 18 groups on the GPU: [Note: compact device groups])."""
    caps = largest_models(scale.LLAMA_31_70B, seq_len=scale.SEQ, micro_batch=scale.MICRO_BATCH,
                                           config=scale.ENGINE, machine=scale.machine(128))
    got = {(c.host_state, c.both_memories): (c.layers, round(c.n_params / 1e9, 1), c.gpu_groups) for c in caps}
    assert got == {("fp32", False): (6, 7.2, 0), ("int8_moments", False): (12, 12.4, 0),
                   ("compact", False): (21, 20.1, 0), ("compact_kahan", False): (15, 14.9, 0),
                   ("fp32", True): (10, 10.7, 4), ("int8_moments", True): (17, 16.6, 9),
                   ("compact", True): (33, 30.3, 18), ("compact_kahan", True): (26, 24.3, 14)}
    assert all(c.host_total <= c.host_usable for c in caps)
