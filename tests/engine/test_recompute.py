"""The auto keep/recompute policy's arithmetic, with the CUDA allocator counters mocked (no GPU here)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch

from lightning_megatrain.engine.recompute import DEVICE_FRACTION, TOP_UP_FRACTION, RecomputePolicy

GIB = 1024**3


def _cuda_counters(peak: list[int], total: int = 100 * GIB, reserved: list[int] | None = None, segment: int = GIB):
    return (
        mock.patch.object(torch.cuda, "max_memory_allocated", lambda device=None: peak[0]),
        mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=total)),
        mock.patch.object(torch.cuda, "max_memory_reserved", lambda device=None: (reserved or peak)[0]),
        # the allocator's segments: the largest one, another device's larger one (not counted), and a small one
        mock.patch.object(torch.cuda, "memory_snapshot", lambda: [{"device": 0, "total_size": segment},
                                                                   {"device": 1, "total_size": 50 * GIB},
                                                                   {"device": 0, "total_size": 2}]),
    )


def test_fixed_count_keeps_the_first_layers_of_every_micro_batch():
    policy = RecomputePolicy(2, torch.device("cpu"), layer_weight_bytes=0)
    for _ in range(2):  # two micro-batches
        policy.start_forward()
        assert [policy.keep(1) for _ in range(4)] == [True, True, False, False]


def test_auto_keeps_none_on_cpu():
    policy = RecomputePolicy("auto", torch.device("cpu"), layer_weight_bytes=0)
    policy.start_forward()
    assert not policy.calibrating and not any(policy.keep(1) for _ in range(4))


def test_auto_calibrates_on_the_first_micro_batch_then_fills_the_budget():
    peak = [10 * GIB]
    patches = _cuda_counters(peak)
    with patches[0], patches[1]:
        policy = RecomputePolicy("auto", torch.device("cuda", 0), layer_weight_bytes=GIB // 2)
        x = GIB // 4  # each layer's input
        policy.start_forward()
        assert not any(policy.keep(x) for _ in range(8))  # first micro-batch: recompute everything
        peak[0] = 30 * GIB  # this micro-batch's peak
        for _ in range(8):
            policy.measure_recompute(graph_bytes=2 * GIB, input_bytes=x)  # A = 2 GiB: 8 bytes per input byte
        policy.end_backward()
        assert not policy.calibrating
        budget = DEVICE_FRACTION * 100 * GIB
        per_layer = (8 + 1) * x + GIB // 2  # graph + kept input + private weights = 2.75 GiB
        want = int((budget - 30 * GIB) // per_layer)
        assert want == 21
        policy.start_forward()
        assert sum(policy.keep(x) for _ in range(40)) == want
        # twice the tokens: the peak scales up and each kept layer costs twice the activations
        assert policy.limit(2 * x) == int((budget - 60 * GIB) // ((8 + 1) * 2 * x + GIB // 2))
        assert policy.limit(2 * x) < want


def test_auto_recomputes_a_layer_with_no_input_on_the_activation_path():
    # frozen embeddings: the first layer's input needs no grad, so it stashes nothing (0 input bytes); the per-byte
    # model cannot size its graph and divided by zero on the H200 before: it is recomputed, the next layers kept
    peak = [10 * GIB]
    patches = _cuda_counters(peak)
    with patches[0], patches[1]:
        policy = RecomputePolicy("auto", torch.device("cuda", 0), layer_weight_bytes=GIB // 2)
        policy.start_forward()
        policy.measure_recompute(graph_bytes=GIB, input_bytes=GIB // 4)
        policy.end_backward()
        policy.start_forward()
        assert policy.limit(0) == 0 and not policy.keep(0)
        assert policy.keep(GIB // 4)


def test_auto_never_plans_past_the_device():
    peak = [95 * GIB]
    patches = _cuda_counters(peak)
    with patches[0], patches[1]:
        policy = RecomputePolicy("auto", torch.device("cuda", 0), layer_weight_bytes=GIB)
        policy.start_forward()
        policy.measure_recompute(graph_bytes=GIB, input_bytes=GIB)
        policy.end_backward()
        assert policy.limit(GIB) == 0  # 95 GiB peak already above 90% of 100 GiB: recompute everything


def test_auto_counts_no_weight_copy_for_layers_whose_weights_persist():
    # gpu_optimizer_groups: the first layers' compute weights stay on the device, a kept graph uses them in place
    peak = [10 * GIB]
    patches = _cuda_counters(peak)
    with patches[0], patches[1]:
        policies = [
            RecomputePolicy("auto", torch.device("cuda", 0), layer_weight_bytes=GIB, persistent_layers=n)
            for n in (0, 3, 100)
        ]
        for policy in policies:
            policy.start_forward()
            policy.measure_recompute(graph_bytes=GIB, input_bytes=GIB)  # A = 1 GiB per input GiB: 2 GiB a layer
            policy.end_backward()
        free = DEVICE_FRACTION * 100 * GIB - 10 * GIB  # 80 GiB
        assert policies[0].limit(GIB) == int(free // (3 * GIB))  # 26: graph, input and weights
        assert policies[1].limit(GIB) == 3 + int((free - 3 * 2 * GIB) // (3 * GIB))  # 27
        assert policies[2].limit(GIB) == int(free // (2 * GIB))  # 40: every kept layer persists


def test_auto_tops_up_after_the_first_kept_micro_batch():
    # the first micro-batch that keeps layers peaks below the plan: the room left is filled once, for inputs up to
    # that micro-batch's size
    peak, reserved = [10 * GIB], [10 * GIB]
    patches = _cuda_counters(peak, reserved=reserved)
    with patches[0], patches[1], patches[2], patches[3]:
        policy = RecomputePolicy("auto", torch.device("cuda", 0), layer_weight_bytes=GIB)
        x = GIB
        policy.start_forward()
        policy.measure_recompute(graph_bytes=GIB, input_bytes=x)  # 2 GiB graph + input, 3 GiB with the weights
        policy.end_backward()
        planned = int((DEVICE_FRACTION * 100 * GIB - 10 * GIB) // (3 * GIB))
        assert planned == 26
        policy.start_forward()
        assert sum(policy.keep(x) for _ in range(40)) == planned
        # the kept graphs cost less than planned: 35 GiB of the 95 GiB top-up budget left as reserved (not as
        # allocated); the largest segment (1 GiB) leaves that budget as it is
        peak[0], reserved[0] = 50 * GIB, 60 * GIB
        policy.end_backward()
        assert TOP_UP_FRACTION * 100 == 95 and policy.extra == 11 and policy.limit(x) == planned + 11
        assert policy.limit(x // 2) > policy.limit(x) and policy.limit(2 * x) < planned  # larger inputs: no top-up
        reserved[0] = 89 * GIB  # tops up once only
        policy.start_forward()
        assert sum(policy.keep(x) for _ in range(60)) == planned + 11
        policy.end_backward()
        assert policy.extra == 11


def _first_kept_micro_batch() -> RecomputePolicy:
    """A policy (CUDA counters patched by the caller) calibrated at a 10 GiB peak, 1 GiB inputs and 1 GiB graphs, then
    through the forward of its first kept micro-batch."""
    policy = RecomputePolicy("auto", torch.device("cuda", 0), layer_weight_bytes=GIB)
    policy.start_forward()
    policy.measure_recompute(graph_bytes=GIB, input_bytes=GIB)
    policy.end_backward()
    policy.start_forward()
    while policy.keep(GIB):
        pass
    return policy


def test_auto_top_up_leaves_the_largest_segment_unreserved():
    # HF's loss at 32 x 1024 on the H200: a 15.7 GiB logits block. The top-up must leave room to make it again, and
    # never plans below the first plan's budget.
    for segment, budget in [(8 * GIB, 92 * GIB), (20 * GIB, DEVICE_FRACTION * 100 * GIB)]:
        peak, reserved = [10 * GIB], [10 * GIB]
        patches = _cuda_counters(peak, reserved=reserved, segment=segment)
        with patches[0], patches[1], patches[2], patches[3]:
            policy = _first_kept_micro_batch()
            peak[0], reserved[0] = 50 * GIB, 60 * GIB
            policy.end_backward()
            # 92 GiB: 8 GiB stay free (11 layers at 95); 20 GiB: 80 GiB, below the first plan's 90 GiB, which stands
            assert policy.extra == int((budget - 60 * GIB) // (3 * GIB)) == 10


def test_auto_top_up_adds_nothing_past_the_budget():
    peak = [10 * GIB]
    patches = _cuda_counters(peak)
    with patches[0], patches[1], patches[2], patches[3]:
        policy = _first_kept_micro_batch()
        peak[0] = 95 * GIB  # above the budget already (the plan was optimistic): no top-up, no change
        policy.end_backward()
        assert policy.extra == 0 and policy.limit(GIB) == 26
