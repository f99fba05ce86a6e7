"""Both memories as one pool in the planner (planner/pool.py, [Note: memory pool]): the split ``gpu_optimizer_groups=
"auto"`` plans where the host cannot hold every group's state, and the numbers pinned for the Qwen2.5-14B and
Llama-2-13B shapes on the H200 (139 GiB GPU, 128 GiB host of which 124.2 GiB usable)."""

from __future__ import annotations

import pytest

from lightning_megatrain import planner
from lightning_megatrain.cli import plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import Machine, describe
from lightning_megatrain.planner.capacity import largest_models
from lightning_megatrain.planner.pool import forward_numels, host_to_come

from helpers.shapes import LLAMA2_13B

H200 = Machine(host_ram_gib=128, gpu_mem_gib=139, cpu_cores=16)
GIB = 2**30
QWEN25_14B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
              "tie_word_embeddings": False}


def _auto(model, micro_batch, seq_len=1024):
    return planner.plan(model, seq_len=seq_len, micro_batch=micro_batch, config=EngineConfig(), machine=H200)


@pytest.mark.parametrize(("seq_len", "largest"), [(1024, 17), (2048, 8), (4096, 4)])
def test_llama2_13b_trains_at_full_precision_with_both_memories(seq_len, largest):
    """13.02B parameters at 16 B/param of fp32 state is 194 GiB: the H200's host holds it, less the engine's slack
    (``ENGINE_HOST_SLACK_GIB``), only with 23 groups (the residents and 22 layers, 7.31B params) keeping their grads
    and Adam states on the GPU; the largest micro-batch that fits is 17 x 1,024, 8 x 2,048 and 4 x 4,096 tokens,
    with recompute segments of 2 (3,486-3,679 tokens/s planned: the GPU binds, and the host, less that slack, holds
    no more checkpoints)."""
    fits, over = _auto(LLAMA2_13B, largest, seq_len), _auto(LLAMA2_13B, largest + 1, seq_len)
    assert fits.fits and not over.fits
    assert "over: " in over.verdict() and not over.verdict().endswith("over: ")  # says what does not fit
    assert fits.n_params == 13_015_864_320 and fits.assumptions["gpu_optimizer_groups"] == 23
    pool = fits.memory_pool
    assert (pool["groups"], pool["fewest"], pool["device_params"], pool["fits"]) == (23, 23, 7_306_183_680, True)
    # the host holds the masters of every group, the grads and moments of the host groups only
    host_params = fits.n_params - pool["device_params"]
    assert (fits.host["masters"], fits.host["grads"], fits.host["optimizer states"]) == (
        4 * fits.n_params, 4 * host_params, 8 * host_params)
    assert fits.host_total <= fits.host_usable and fits.gpu_total <= fits.gpu_limit
    assert "  Both memories: gpu_optimizer_groups=23 (auto; 7.31B params keep" in fits.report()


def test_llama2_13b_at_8_x_1024_predicted():
    """The benchmark's configuration (benchmarks/memory_pool.py): what the planner predicts for it (the engine chose
    24 groups on the H200, 134.4 GiB of GPU, 2,555 tokens/s with the host step overlapped:
    2026-12-04-memory-pool-llama-2-13b-overlapped-h200-7d07fad.json)."""
    p = _auto(LLAMA2_13B, 8)
    assert p.fits and p.memory_pool["groups"] == 23
    assert p.host_total / GIB == pytest.approx(123.32, abs=0.01)
    assert p.gpu_total / GIB == pytest.approx(132.85, abs=0.01)
    assert p.tokens_per_s == pytest.approx(2501, abs=1)  # measured overlapped: 2,555 (7d07fad)


def test_qwen25_14b_does_not_fit_at_full_precision():
    """14.77B parameters: the host holds the rest only with 31 or more groups (9.82B params) on the GPU, at 18
    B/param there 170+ GiB before any activation; no micro-batch fits. Cut to 41 of its 48 layers (12.84B) it
    fits with 21 groups on the GPU."""
    p = _auto(QWEN25_14B, 1)
    assert not p.fits and p.n_params == 14_770_033_664
    pool = p.memory_pool
    assert not pool["fits"] and pool["groups"] == 31
    assert p.gpu_total / GIB == pytest.approx(173.8, abs=0.1) and p.host_total <= p.host_usable
    assert "NO SPLIT FITS: the host holds the grads and optimizer states only with 31 groups (9.82B params)" in (
        p.report())
    rows = largest_models(QWEN25_14B, seq_len=1024, micro_batch=4, machine=H200, host_states=("fp32",),
                          config=EngineConfig(gpu_optimizer_groups=0))
    host_only, both = rows
    assert (host_only.layers, host_only.gpu_groups) == (23, 0)
    assert (both.both_memories, both.layers, both.gpu_groups, round(both.n_params / 1e9, 2)) == (True, 41, 21, 12.84)


def test_split_is_the_fewest_groups_and_the_host_count_is_exact():
    s = describe(planner.load_config(LLAMA2_13B))
    numels = forward_numels(s)
    assert sum(numels) == 13_015_864_320 and numels[0] == 327_685_120 and len(numels) == 41
    assert host_to_come(s, 0, grads=4, states=8) == 12 * sum(numels)
    assert host_to_come(s, 22, grads=4, states=8) == 12 * sum(numels[22:])
    assert host_to_come(s, 22, grads=4, states=8, grads_read=True) == 12 * sum(numels[22:]) + 4 * sum(numels[:22])
    # an explicit count overrides: the plan shows what it needs, and "auto" on a host that holds everything plans no
    # split (the host Adam suggestion alone)
    explicit = planner.plan(LLAMA2_13B, seq_len=1024, micro_batch=8, config=EngineConfig(gpu_optimizer_groups=10),
                            machine=H200)
    assert explicit.memory_pool is None and not explicit.fits and explicit.host_total > explicit.host_usable
    big = planner.plan(LLAMA2_13B, seq_len=1024, micro_batch=8, config=EngineConfig(),
                       machine=H200.replace(host_ram_gib=512))
    assert big.memory_pool is None and big.fits


def test_cli_plans_the_split(capsys):
    model = ('{"model_type": "llama", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, '
             '"num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40}')
    common = ["--model", model, "--seq-len", "1024", "--micro-batch", "8", "--host-ram", "128", "--gpu-mem", "139",
              "--cpu-cores", "16"]
    assert plan_main([*common, "--gpu-optimizer-groups", "auto", "--overlap-optimizer", "--compile-layers"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "Both memories: gpu_optimizer_groups=23 (auto; 7.31B params" in out
