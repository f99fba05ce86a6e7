"""Recompute segments ([Note: recompute segments]): a layer input saved every ``segment_layers`` layers, the rest
replayed in backward, must give plain Lightning's losses, gradients and post-step weights."""

from __future__ import annotations

import pytest
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import segments as segments_module

from helpers.parity import assert_records_close, run

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*smaller than the logging interval.*"
)


@pytest.fixture
def replays(monkeypatch):
    """Counts the layer forwards replayed in backward, by layer index."""
    counts: dict[int, int] = {}
    original = segments_module.Segment.input

    def counting(self, index, transfer, replay_layer):
        def counted(i, args, kwargs):
            counts[i] = counts.get(i, 0) + 1
            return replay_layer(i, args, kwargs)

        return original(self, index, transfer, counted)

    monkeypatch.setattr(segments_module.Segment, "input", counting)
    return counts


# Grads up to the first update within 1e-6 of plain Lightning's. After it, an MoE's weights drift a little further
# (1.2e-6 measured for qwen3_moe on an AVX2 AMD EPYC): AdamW divides each element by its own magnitude, so the grads'
# fp32 noise reaches the weights amplified where a grad is near eps (the router's, a rarely chosen expert's).
def _rtol_updated(family: str) -> float:
    return 1e-5 if family in ("qwen3_moe", "mixtral") else 1e-6


@pytest.mark.parametrize(
    ("family", "segment_layers", "replayed"),
    [
        ("llama_tied", 2, {0}),  # 3 layers: segments [0, 1] and [2]
        ("llama_tied", 3, {0, 1}),
        ("qwen3", 3, {0, 1}),
        ("qwen3_moe", 3, {0, 1}),
        ("mixtral", 2, {0}),
    ],
)
def test_segments_match_plain_lightning(family, segment_layers, replayed, replays):
    """Accumulation over 2 micro-batches and clipping that fires (clip 0.05 is far below these grads' norms): every
    loss, grad and final weight equals plain Lightning's within fp32 re-association; the replays really ran."""
    kw = {"steps": 2, "accumulate": 2, "clip": 0.05}
    reference = run("auto", family, optimizer="adamw_fused", **kw)
    got = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=segment_layers), family, **kw)
    assert_records_close(got, reference, rtol=1e-6, rtol_updated=_rtol_updated(family))
    assert set(replays) == replayed, replays
    assert all(n == 4 for n in replays.values()), replays  # once per micro-batch: 2 steps x 2 micro-batches


def test_segments_replay_dropout_exactly(replays):
    """The replay runs under each layer's forward RNG state: with dropout the results still equal one checkpoint
    per layer (the same strategy otherwise), bitwise."""
    from helpers.parity import ParityLM

    def module():
        m = ParityLM("llama_tied")
        m.model.config.attention_dropout = 0.3
        for layer in m.model.model.layers:
            layer.self_attn.attention_dropout = 0.3
        return m

    # attention dropout 0.3 is live: the first loss differs from the same model's without it
    base = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0), None, module=module, steps=2)
    seg = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=3), None, module=module, steps=2)
    assert replays, "no layer was replayed"
    assert base.losses == seg.losses
    for name, p in base.params.items():
        assert torch.equal(p, seg.params[name]), name


def test_device_checkpoints_never_exceed_the_count_where_the_chain_breaks():
    # every layer saves its own input (no layer chains): the index rule alone would keep all of the last
    # device_checkpoints * k layers' inputs on the device; the count caps them per micro-batch
    segments = segments_module.Segments(8)
    segments.configure(4, 1)
    segments.reset()
    assert [i for i in range(8) if segments.on_device(i)] == [4]
    segments.reset()  # the next micro-batch starts its own count
    assert segments.on_device(4)


def test_segments_are_let_go_after_backward():
    # the hints hold no segment (and so no checkpoint) past the micro-batch's backward
    import lightning as L

    class Check(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            self.held = dict(trainer.strategy.engine.streamed.segments.by_layer)

    check = Check()
    run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=2), "llama_tied", steps=1,
        callbacks=[check])
    assert check.held == {}


@pytest.mark.parametrize("family", ["llama_tied", "qwen3_moe"])
def test_nested_segments_match_flat_ones_bitwise_and_plain_lightning(family, replays):
    """Segments of 3 in sub-segments of 2: the replay toward layer 2 keeps only its input (a sub-checkpoint), so
    layer 1's input is replayed again from the checkpoint: layer 0 replays twice per micro-batch, layer 1 once.
    The replays regenerate the forward's inputs bitwise, so everything equals flat segments' to the bit, and plain
    Lightning's within fp32 re-association (accumulation, clipping that fires)."""
    kw = {"steps": 2, "accumulate": 2, "clip": 0.05}
    reference = run("auto", family, optimizer="adamw_fused", **kw)
    flat = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=3, sub_segment_layers=1), family,
               **kw)
    assert replays == {0: 4, 1: 4}, replays
    replays.clear()
    nested = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=3, sub_segment_layers=2), family,
                 **kw)
    assert replays == {0: 8, 1: 4}, replays  # 2 steps x 2 micro-batches
    assert nested.losses == flat.losses
    for name, p in flat.params.items():
        assert torch.equal(p, nested.params[name]), name
    for step, grads in enumerate(flat.grads):
        for name, g in grads.items():
            assert torch.equal(g, nested.grads[step][name]), (step, name)
    assert_records_close(nested, reference, rtol=1e-6, rtol_updated=_rtol_updated(family))


def test_nested_segments_of_a_deeper_model_replay_from_sub_checkpoints(replays, monkeypatch):
    """9 layers in segments of 6 in sub-segments of 2 (the 512K plan's shape): replays start from sub-checkpoints
    (layers 2 and 4), and everything still equals one checkpoint per layer, bitwise."""
    from helpers import families

    deep = families.FAMILIES["llama_tied"]

    def llama_9():
        cfg = deep()
        cfg.num_hidden_layers = 9
        return cfg

    monkeypatch.setitem(families.FAMILIES, "llama_9", llama_9)
    kw = {"steps": 2, "accumulate": 2, "clip": 0.05}
    base = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=1), "llama_9", **kw)
    nested = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0, segment_layers=6, sub_segment_layers=2),
                 "llama_9", **kw)
    # per micro-batch, as replay_schedule says for the segment of 6 and the last one of 3: layer 2 replays twice, the
    # second time from its sub-checkpoint for layer 3
    per_micro_batch: dict[int, int] = {}
    for length, start in ((6, 0), (3, 6)):
        for replayed in segments_module.replay_schedule(length, 2)[1]:
            for j in replayed:
                per_micro_batch[start + j] = per_micro_batch.get(start + j, 0) + 1
    assert replays == {i: 4 * n for i, n in per_micro_batch.items()}, replays
    assert nested.losses == base.losses
    for name, p in base.params.items():
        assert torch.equal(p, nested.params[name]), name


@pytest.mark.parametrize(("k", "sub"), [(8, 1), (8, 3), (8, 2), (16, 4), (11, 3), (5, 7), (6, 2)])
def test_nested_replay_runs_and_holds_what_the_schedule_says(k, sub):
    """Segment.input directly, on a stand-in layer (x -> x + 1): the layers replayed before each layer's backward and
    the most regenerated inputs held at once are replay_schedule's (which the planner reads), and each layer gets
    its own input."""

    class Transfer:
        device = torch.device("cpu")

        def unstash(self, handle):
            return handle.clone()

    from torch.utils import _pytree as pytree

    _, spec = pytree.tree_flatten(((torch.zeros(1),), {}))
    state = (torch.get_rng_state(), None), (False, torch.bfloat16, False)
    segment = segments_module.Segment(0, torch.zeros(1), sub)
    segment.records = [segments_module.LayerRecord(i, spec, [None], 0, *state) for i in range(k)]
    ran: list[int] = []

    def layer(i, args, kwargs):
        ran.append(i)
        return args[0] + 1

    peak, schedule = segments_module.replay_schedule(k, sub)
    held = 0
    for target in reversed(range(k)):
        ran.clear()
        start = segment.replay_from(target) if segment.needs_replay(target) else None  # what backward prefetches
        x = segment.input(target, Transfer(), layer)
        assert ran == list(schedule[target]), (target, ran)
        assert start == (ran[0] if ran else None), (target, start, ran)
        assert float(x) == target  # the checkpoint (0) plus one per layer below
        if target:  # what the segment still holds besides its checkpoint, and this layer's input
            held = max(held, 1 + sum(j != 0 for j in segment.inputs))
    assert held == peak
    assert segment.inputs == {}


def test_schedule_of_nested_segments():
    # flat: the segment's last layer replays the others, held at once; nested: fewer held, more replayed
    assert segments_module.replay_schedule(8, 1) == (7, ((),) * 7 + (tuple(range(7)),))
    peak, replays = segments_module.replay_schedule(8, 3)
    assert peak == 3 and replays == ((), (), (0, 1), (), (), (3, 4), (), tuple(range(7)))
    assert [segments_module.replay_schedule(16, m)[0] for m in (1, 2, 3, 4, 5, 15, 16)] == [15, 8, 6, 6, 6, 14, 15]


def test_every_layer_call_runs_under_the_forwards_autocast_state(monkeypatch):
    """bf16-mixed (the precision plugin's autocast, cast cache off), the first layer kept, segments of 2: the kept
    forward, the no-grad forwards, the segment's replay and the recomputes (in backward, after the plugin's autocast
    exited) all run under one autocast state, cache flag included. Dynamo guards a compiled layer on that flag with
    the grad mode: a recompute under another flag compiled a graph of its own, and the kept forward a third, in the
    second step (segments.py ``autocast_state``)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    seen: list[tuple] = []

    def spied(forward):
        def call(self, *args, **kwargs):
            seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                         torch.is_autocast_cache_enabled()))
            return forward(self, *args, **kwargs)
        return call

    monkeypatch.setattr(LlamaDecoderLayer, "forward", spied(LlamaDecoderLayer.forward))
    run(MegaTrainStrategy(cpu_adam="torch", keep_layers=1, segment_layers=2), "llama_tied", steps=2,
        precision="bf16-mixed")
    # per micro-batch: 3 forwards (1 kept with grad), 1 replay of layer 1 without grad, 2 recomputes with grad
    assert len(seen) == 2 * (3 + 1 + 2)
    assert {s[0] for s in seen} == {True, False}
    assert set(s[1:] for s in seen) == {(True, torch.bfloat16, False)}, set(seen)
