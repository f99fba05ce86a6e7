"""``MegaTrainStrategy(attention_memo=True)`` ([Note: attention memo], engine/attention_memo.py) on the CPU in fp32:
the recompute takes each attention call's output from the layer's forward instead of running the kernel, and losses,
every gradient and the final weights are bitwise those of the same run without it, with accumulation and clipping,
grouped key/value heads, an MoE family, recompute segments, sequence tiles, a kept layer and compiled layers."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPAParams

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import attention_memo

from helpers.families import FAMILIES
from helpers.memo import count_kernel_calls
from helpers.parity import assert_records_close, run

HOST_ADAM_RTOL = 1e-3  # as tests/strategy/test_parity.py: later steps amplify last-bit differences through Adam


def _assert_bitwise(a, b) -> None:
    assert a.losses == b.losses
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert (ga[name] is None) == (gb[name] is None), (step, name)
            assert ga[name] is None or torch.equal(ga[name], gb[name]), (step, name)
    assert all(torch.equal(a.params[n], b.params[n]) for n in b.params)


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "mixtral"])
def test_memo_gives_the_same_training_bitwise_and_skips_the_recompute_kernel(monkeypatch, family):
    """llama_tied and mixtral have grouped key/value heads (4 query heads, 2 kv: enable_gqa), qwen2 q/k/v biases;
    3 layers, 3 steps of 2 micro-batches, clip 1.0: the kernel runs once per layer and micro-batch (its forward), not
    again in the recompute, and the memo is empty after each backward."""
    options = dict(cpu_adam="torch", keep_layers=0)
    reference = run(MegaTrainStrategy(**options), family, accumulate=2, clip=1.0)
    calls = count_kernel_calls(monkeypatch)
    strategy = MegaTrainStrategy(attention_memo=True, **options)
    memo = run(strategy, family, accumulate=2, clip=1.0)
    _assert_bitwise(memo, reference)
    layers = FAMILIES[family]().num_hidden_layers
    assert calls[0] == layers * 2 * 3


@pytest.mark.parametrize(("layers", "kept", "recomputed_kernels"), [(1, 0, 2), (2, 0, 1), (5, 0, 0), (2, 1, 0)])
def test_the_last_layers_memos_only(monkeypatch, layers, kept, recomputed_kernels):
    """``attention_memo=N``: only the last ``N`` of the 3 layers record; the others' recompute runs the kernel
    again (5: all 3). The first layer kept and the last 2 served: no recompute runs it (the first 2 served would
    leave the third's). Bitwise the run without memos, with accumulation and clipping."""
    options = dict(cpu_adam="torch", keep_layers=kept)
    reference = run(MegaTrainStrategy(**options), "llama_tied", accumulate=2, clip=1.0)
    calls = count_kernel_calls(monkeypatch)
    _assert_bitwise(run(MegaTrainStrategy(attention_memo=layers, **options), "llama_tied", accumulate=2, clip=1.0),
                    reference)
    assert calls[0] == (3 + recomputed_kernels) * 2 * 3  # per micro-batch: 3 forwards and the unserved recomputes


def test_memo_with_segments_tiles_and_a_kept_layer(monkeypatch):
    """Segments of 2 (the second layer's input replayed from the first's in backward, without the memo), tiles of
    4 positions and the first layer kept (no memo: its graph is kept): bitwise the same options without the memo.
    Kernel runs per micro-batch: 3 forwards + 1 segment replay (the kept layer's forward is its only one)."""
    options = dict(cpu_adam="torch", keep_layers=1, segment_layers=2, seq_tile=4)
    reference = run(MegaTrainStrategy(**options), "llama_tied", accumulate=2, clip=1.0)
    calls = count_kernel_calls(monkeypatch)
    _assert_bitwise(run(MegaTrainStrategy(attention_memo=True, **options), "llama_tied", accumulate=2, clip=1.0),
                    reference)
    assert calls[0] == (3 + 1) * 2 * 3


def test_families_without_sdpa_pass_through(monkeypatch):
    """qwen3 here runs eager attention (no SDPA call): the memo records nothing and changes nothing."""
    options = dict(cpu_adam="torch", keep_layers=0)
    reference = run(MegaTrainStrategy(**options), "qwen3", steps=2)
    calls = count_kernel_calls(monkeypatch)
    _assert_bitwise(run(MegaTrainStrategy(attention_memo=True, **options), "qwen3", steps=2), reference)
    assert calls[0] == 0


def test_compiled_layers_with_the_memo(monkeypatch):
    """Compiled layers call the memo's op inside their graphs (no graph break: one graph per grad mode, plus the
    setup's probe) and save its outputs; the recompute runs no attention kernel. Not bitwise the compiled run without
    the memo: the recorded output comes from the no-grad graph, whose fused kernels round q, k, v differently from the
    graph with grad; within 1e-6 at the first step, HOST_ADAM_RTOL after."""
    from torch._dynamo.utils import counters

    options = dict(cpu_adam="torch", keep_layers=0, compile_layers=True)
    torch._dynamo.reset()
    reference = run(MegaTrainStrategy(**options), "llama_tied", accumulate=2)
    torch._dynamo.reset()
    counters.clear()
    calls = count_kernel_calls(monkeypatch)
    memo = run(MegaTrainStrategy(attention_memo=True, **options), "llama_tied", accumulate=2)
    assert counters["stats"]["unique_graphs"] == 2 + 1
    assert calls[0] == 3 * 2 * 3  # the forwards' only
    assert_records_close(memo, reference, rtol=1e-6, rtol_updated=HOST_ADAM_RTOL)


def test_the_routing_traces_whole_in_a_compiled_graph(monkeypatch):
    """The cuDNN check the routing makes on CUDA is a constant to dynamo (``_cudnn_takes``): SDPA's own check takes
    an ``SDPAParams``, a pybind object dynamo cannot trace, and a break there ran compiled layers' checkpoints
    eagerly. The probe, a stand-in here (no cuDNN on the CPU) that builds such an object, runs at trace time, once per
    static property; batch and sequence dims dynamic, as compiled layers mark them (engine/compiled.py)."""
    probes = []

    def probe(device, dtype, heads, kv_heads, head_dim, is_causal, enable_gqa):
        q = torch.empty(1, heads, 256, head_dim, dtype=dtype)
        probes.append(SDPAParams(q, q, q, None, 0.0, is_causal, enable_gqa))
        return True

    monkeypatch.setattr(attention_memo, "_cudnn_probe", probe)

    def routed(q: torch.Tensor) -> torch.Tensor:
        takes = attention_memo._cudnn_takes(q.device, q.dtype, q.shape[1], q.shape[1], q.shape[-1], True, False)
        return q * 2 if takes else q + 1

    torch._dynamo.reset()
    compiled = torch.compile(routed, fullgraph=True)
    for batch, length in ((2, 8), (3, 12)):
        q = torch.ones(batch, 2, length, 16, dtype=torch.bfloat16)  # [B, heads, T, head_dim]
        torch._dynamo.maybe_mark_dynamic(q, 0)
        torch._dynamo.maybe_mark_dynamic(q, 2)
        torch.testing.assert_close(compiled(q), q * 2)
    assert len(probes) == 1


def test_a_recompute_that_calls_attention_differently_is_refused():
    memo = attention_memo.AttentionMemo()
    q = torch.zeros(1, 2, 4, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with attention_memo.memo_mode(memo), memo.recording(0) as calls:
        sdpa(q, q, q, is_causal=True)
    with pytest.raises(RuntimeError, match="recompute called attention as"):  # noqa: SIM117
        with attention_memo.memo_mode(memo), memo.replaying(0, calls):
            sdpa(q, q, q, is_causal=False)
    with attention_memo.memo_mode(memo), memo.recording(1) as calls:
        sdpa(q, q, q, is_causal=True)
    with pytest.raises(RuntimeError, match="fewer attention calls"), memo.replaying(1, calls):
        pass
    with pytest.raises(RuntimeError, match="more attention calls"):  # noqa: SIM117
        with attention_memo.memo_mode(memo), memo.replaying(2, []):
            sdpa(q, q, q, is_causal=True)


def test_masked_or_dropout_attention_passes_through():
    memo = attention_memo.AttentionMemo()
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    with attention_memo.memo_mode(memo), memo.recording(0) as calls:
        masked = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert calls == []
    assert torch.equal(masked, torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask))


def test_bf16_mixed_with_the_memo(monkeypatch):
    """Under bf16 autocast (q, k fp32 after rotary, v bf16) the memo's op computes in autocast's dtype, as SDPA
    does: the same losses and grads as without the memo (CPU bf16: bitwise not asserted, within 1e-3)."""
    options = dict(cpu_adam="torch", keep_layers=0)
    reference = run(MegaTrainStrategy(**options), "llama_tied", precision="bf16-mixed", steps=2)
    calls = count_kernel_calls(monkeypatch)
    memo = run(MegaTrainStrategy(attention_memo=True, **options), "llama_tied", precision="bf16-mixed", steps=2)
    assert calls[0] == 3 * 2
    assert_records_close(memo, reference, rtol=1e-3)


def test_a_second_forward_before_backward_keeps_its_own_memos():
    """Two forwards with grad summed into one loss: each layer node replays the calls of its own forward."""
    from helpers.parity import ParityLM

    class TwoForwards(ParityLM):
        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss + 0.5 * self.model(
                input_ids=batch.flip(1), labels=batch.flip(1)).loss

    options = dict(cpu_adam="torch", keep_layers=0)
    reference = run(MegaTrainStrategy(**options), None, module=lambda: TwoForwards("llama_tied"), steps=2)
    memo = run(MegaTrainStrategy(attention_memo=True, **options), None, module=lambda: TwoForwards("llama_tied"),
               steps=2)
    _assert_bitwise(memo, reference)


def test_the_memo_switched_between_micro_batches(monkeypatch):
    """``StreamedLayers.use_memo``, how the engine applies ``attention_memo="auto"`` at the first training micro-batch
    (engine/first_batch.py), switches the memo on and off between micro-batches, here inside an accumulated step:
    bitwise the run without it; the kernel runs through the memo's op only while it is on (the forwards of the first
    3 of 6 micro-batches), the others running SDPA itself. Switching off while a forward's memos wait for its backward
    is refused."""
    import lightning as L

    from helpers.parity import ParityLM

    class Switch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            trainer.strategy.engine.streamed.use_memo(batch_idx < 3)

    options = dict(cpu_adam="torch", keep_layers=0)
    reference = run(MegaTrainStrategy(attention_memo=False, **options), "llama_tied", accumulate=2, clip=1.0)
    calls = count_kernel_calls(monkeypatch)
    switched = run(MegaTrainStrategy(attention_memo=False, **options), "llama_tied", accumulate=2, clip=1.0,
                   callbacks=[Switch()])
    _assert_bitwise(switched, reference)
    assert calls[0] == FAMILIES["llama_tied"]().num_hidden_layers * 3

    class Pending(ParityLM):  # the forward's memos are recorded, its backward not run yet
        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            with pytest.raises(RuntimeError, match="switched off while a forward's memos wait for its backward"):
                self.trainer.strategy.engine.streamed.use_memo(False)
            return loss

    run(MegaTrainStrategy(attention_memo=True, **options), None, module=lambda: Pending("llama_tied"), steps=1)


def test_auto_plans_the_memo_where_it_pays(monkeypatch):
    """``attention_memo="auto"`` in the planner, the engine's rule (result.py ``memo_pays``): the plan with the
    memos where it fits and is ``MEMO_MIN_GAIN`` faster (the Llama-2-7B shape at 131,072 tokens: +18%), else the plan
    without: at 4,096 tokens (the memos could save about 1% of the step: the plan with them is not even made), at
    524,288 (they do not fit beside the checkpoints), in fp32 (cuDNN's kernel runs fp16/bf16) and with two ranks."""
    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.planner import Machine, plan, planning
    from lightning_megatrain.planner.result import memo_pays

    llama7 = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)
    machine = Machine(host_ram_gib=125.85, gpu_mem_gib=139.8, cpu_cores=16)

    def plans(seq_len, **kwargs):
        return [plan(llama7, seq_len=seq_len, config=EngineConfig(attention_memo=memo), machine=machine, **kwargs)
                for memo in ("auto", False, True)]

    auto, off, on = plans(131072)
    assert on.tokens_per_s > 1.15 * off.tokens_per_s and on.fits
    assert auto.to_dict() == on.to_dict()
    for seq_len in (4096, 524288):
        auto, off, on = plans(seq_len)
        assert auto.to_dict() == off.to_dict() and "attention memos" in on.gpu and not memo_pays(off, on)
    assert not plans(524288)[2].fits
    # fp32: memos asked for are planned as asked; "auto" knows that the kernel the memo calls (cuDNN's) runs bf16 only
    auto, off, _ = plans(131072, precision="32-true")
    assert auto.to_dict() == off.to_dict() and off.memo_bound == 0
    made, real = [], planning.plan

    def counting(*args, config, **kwargs):
        made.append(config.attention_memo)
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(planning, "plan", counting)
    short = planning.plan(llama7, seq_len=4096, config=EngineConfig(attention_memo="auto"), machine=machine)
    assert short.memo_bound < 0.02 * short.time["step total"] and True not in made
    two = plan(llama7, seq_len=131072, config=EngineConfig(attention_memo="auto"), machine=machine, devices=2)
    assert "attention memos" not in two.gpu  # several ranks: "auto" is off (engine/sharding.py)


def test_the_plan_counts_the_memos_and_the_attention_they_save():
    """The Llama-2-7B shape at 131,072 tokens, every layer recomputed: the memos are every layer's bf16 attention output
    and fp32 log-sum-exp (32 x 131,072 x 32 x (128 x 2 + 4) bytes: 32.5 GiB) on the GPU, and the step loses one
    attention forward per layer; the host is unchanged. Eager attention (no SDPA call) plans no memo."""
    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.planner import Machine, describe, plan
    from lightning_megatrain.planner.timing import _attn_flops

    llama7 = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)
    machine = Machine(host_ram_gib=125.85, gpu_mem_gib=139.8, cpu_cores=16)
    off, on = (plan(llama7, seq_len=131072, config=EngineConfig(attention_memo=memo, keep_layers=0),
                    machine=machine) for memo in (False, True))
    assert on.gpu["attention memos"] == 32 * 131072 * 32 * (128 * 2 + 4) and "attention memos" not in off.gpu
    assert on.gpu_total - off.gpu_total == on.gpu["attention memos"] and on.host_total == off.host_total
    s = describe(llama7)
    # at the attention kernel's own forward rate (planner/constants.py ATTN_FWD_TFLOPS: rows of 32,768 and more)
    saved = 32 * _attn_flops(s, s.layers[0], 131072) * 131072 / (on.assumptions["attention_tflops"][0] * 1e12)
    assert off.time["GPU compute"] - on.time["GPU compute"] == pytest.approx(saved)
    assert on.tokens_per_s > 1.15 * off.tokens_per_s
    # the last 12 layers' memos: 12/32 of the bytes and of the attention forwards saved, the same placement
    part = plan(llama7, seq_len=131072, config=EngineConfig(attention_memo=12, keep_layers=0), machine=machine)
    assert part.gpu["attention memos"] * 32 == on.gpu["attention memos"] * 12
    assert off.time["GPU compute"] - part.time["GPU compute"] == pytest.approx(saved * 12 / 32)
    placement = ("segment_layers", "sub_segment_layers", "device_checkpoints", "seq_tile")
    assert [part.long_context[k] for k in placement] == [off.long_context[k] for k in placement]
    # Plan.memo_fitting: the last layers whose memos fit the room the plan without them leaves, within the share of
    # the GPU keep_layers="auto" fills (engine/recompute.py DEVICE_FRACTION): at 131,072 all 32; at 262,144 on a
    # 118 GiB host (checkpoints on the GPU) some
    from lightning_megatrain.engine.recompute import DEVICE_FRACTION

    per_layer = on.gpu["attention memos"] / 32
    assert off.memo_fitting == 32 and 32 * per_layer <= DEVICE_FRACTION * off.gpu_limit - off.gpu_total
    tight = plan(llama7, seq_len=262144, config=EngineConfig(attention_memo=False, keep_layers=0),
                 machine=Machine(host_ram_gib=118, gpu_mem_gib=139.8, cpu_cores=16))
    room, per_layer = DEVICE_FRACTION * tight.gpu_limit - tight.gpu_total, 2 * per_layer
    assert 0 < tight.memo_fitting < 32
    assert tight.memo_fitting * per_layer <= room < (tight.memo_fitting + 1) * per_layer
    eager = plan(llama7, seq_len=4096, attn_implementation="eager", config=EngineConfig(attention_memo=True))
    assert "attention memos" not in eager.gpu
    windowed = dict(llama7, model_type="mistral", sliding_window=4096)  # a mask past the window: SDPA with a mask
    assert "attention memos" not in plan(windowed, seq_len=8192, config=EngineConfig(attention_memo=True)).gpu
    assert "attention memos" in plan(windowed, seq_len=4096, config=EngineConfig(attention_memo=True)).gpu


def test_the_plan_command_plans_the_memo(capsys):
    """``megatrain plan --attention-memo`` plans as ``MegaTrainStrategy(attention_memo=True)``."""
    import json

    from lightning_megatrain.planner.command import plan_main

    args = ["--model", json.dumps(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4)), "--seq-len", "512", "--json"]
    plans = []
    for flag in ([], ["--attention-memo"]):
        assert plan_main([*args, *flag]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert "attention memos" not in plans[0]["gpu"] and plans[1]["gpu"]["attention memos"] > 0
    # without the flag, a plan the memo makes 5% faster and that still fits says so in its last line: long rows only
    llama7 = json.dumps(dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_hidden_layers=32, num_attention_heads=32))
    machine = ["--gpu-mem", "139", "--host-ram", "125", "--cpu-cores", "16"]
    said = ("The plan above with --attention-memo (MegaTrainStrategy(attention_memo=True); 'auto' takes it by this "
            "rule): ")
    for seq_len, named in (("131072", True), ("4096", False)):
        assert plan_main(["--model", llama7, "--seq-len", seq_len, *machine]) == 0
        assert (said in capsys.readouterr().out.splitlines()[-1]) is named
    assert plan_main(["--model", llama7, "--seq-len", "131072", "--attention-memo", *machine]) == 0
    assert said not in capsys.readouterr().out
    # at 262,144 on a 118 GiB host every layer's memos need longer segments and gain under 5%; the last 10 layers'
    # fit the GPU memory the checkpoints leave and gain 5%: the line names that N, an explicit option
    assert plan_main(["--model", llama7, "--seq-len", "262144", "--gpu-mem", "139.8", "--host-ram", "118",
                      "--cpu-cores", "16", "--compile-layers", "--overlap-optimizer", "--update-during-backward"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("  The plan above with --attention-memo 10 (MegaTrainStrategy(attention_memo=10): the last "
                           "10 layers' memos"), last
    assert plan_main(["--model", llama7, "--seq-len", "262144", "--gpu-mem", "139.8", "--host-ram", "118",
                      "--cpu-cores", "16", "--attention-memo", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["attention memos"] == 10 * 262144 * 32 * (128 * 2 + 4)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_op_passes_torch_library_opcheck(layout):
    """Schema, fake kernels (shapes and strides through the aten meta functions), autograd registration and AOT
    dispatch of the memo's op, on q, k, v contiguous as [B, heads, T, D] or viewed from [B, T, heads, D]."""
    def qkv() -> torch.Tensor:
        x = torch.randn(2, 8, 4, 16) if layout == "transposed" else torch.randn(2, 4, 8, 16)
        return (x.transpose(1, 2) if layout == "transposed" else x).requires_grad_()

    torch.library.opcheck(attention_memo.memo_attention, (qkv(), qkv(), qkv(), True, 0.25))
