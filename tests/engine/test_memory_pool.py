"""Both memories as one pool (planner/pool.py, [Note: memory pool]) in the engine, on the CPU: ``gpu_optimizer_groups=
"auto"`` with the host's and the GPU's free memory mocked, its refusals, and the host bytes each group allocates
under the split. The GPU run is tests/engine/test_gpu_memory_pool.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import engine as engine_module
from lightning_megatrain.engine import first_batch, host_budget, host_store, placement
from lightning_megatrain.engine.engine import MegaTrainEngine
from lightning_megatrain.optim.compact_adam import CompactAdamW
from lightning_megatrain.optim.host_optimizer import overlappable
from lightning_megatrain.planner import describe
from lightning_megatrain.planner.constants import SPLIT_HOST_MARGIN_GIB
from lightning_megatrain.planner.pool import forward_numels

GIB = 2**30
CUDA = torch.device("cuda", 0)
# The Llama-2-13B shape: 13.02B parameters, 40 layers of 317.2M, 327.7M resident (untied embeddings)
LLAMA_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=40, tie_word_embeddings=False)


class _WithConfig(nn.Module):
    def __init__(self, **config) -> None:
        super().__init__()
        self.config = LlamaConfig(**config)


def _numels(shape: dict) -> list[int]:
    return forward_numels(describe(LlamaConfig(**shape)))


def _adam_to_come(numels: list[int], grads_read: bool = False):
    """The engine's count for fresh groups and one AdamW: 4 B grad + 8 B moments per host-group parameter."""
    return lambda n: 12 * sum(numels[n:]) + (4 * sum(numels[:n]) if grads_read else 0)


def _choose(host_free_gib: float, gpu_gib: float = 139, micro_batch: int = 4, shape=LLAMA_13B, **overrides):
    numels = _numels(shape)
    kwargs = dict(config=EngineConfig(overlap_optimizer=True, compile_layers=True), device=CUDA,
                  compute_dtype=torch.bfloat16, grad_accum=1, steppable=True, custom_clipping=False,
                  chunked_loss=True, host_free=int(host_free_gib * GIB), to_come=_adam_to_come(numels))
    batch = {"input_ids": torch.zeros(micro_batch, 1024, dtype=torch.long)}
    return placement.choose_gpu_optimizer_groups(_WithConfig(**shape), batch, **{**kwargs, **overrides})


@pytest.fixture
def gpu_139(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (135 * GIB, 139 * GIB))
    monkeypatch.setattr("lightning_megatrain.planner.planning.cpu_cores", lambda: 16)


def test_auto_splits_the_state_when_the_host_is_short(gpu_139):
    """Llama-2-13B on the H200 with its masters packed (about 70 GiB of 124.2 usable left): 22 groups (the residents and
    21 layers, 6.99B params) must keep their state on the GPU; 21 leave the host short. The reason gives host needed
    vs free and the GPU peak vs its memory."""
    numels = _numels(LLAMA_13B)
    free = 70.0  # GiB: 124.2 usable less the masters (48.5), the process (3) and the grad slabs (1.8), rounded down
    n, why = _choose(free)
    to_come = _adam_to_come(numels)
    assert n == 22 and to_come(22) <= (free - SPLIT_HOST_MARGIN_GIB) * GIB < to_come(21)
    assert why.startswith("both memories at 4 x 1024 tokens x 1 micro-batches: with 21 the host holds not both")
    assert "22 groups (6.99B params) on the GPU: host needs" in why and "GPU peak" in why and "of 139.0 GiB" in why
    # with room for every group's state the split is not needed: the old rule (hide the host Adam) decides
    assert _choose(1000)[1].startswith(("the fewest that hide", "at 4 x 1024 tokens"))
    # a host that reads p.grad before the step holds the device groups' grads too: then 3x groups are needed, more
    # than the GPU holds
    with pytest.raises(RuntimeError, match=r"only with 3\d groups \(\d+\.\d\dB params\) or more on the GPU"):
        _choose(free, to_come=_adam_to_come(numels, grads_read=True))


def test_auto_split_refuses_with_both_memories_and_what_would_fit(gpu_139):
    # the Qwen2.5-14B shape does not fit the H200 at full precision: the host needs 28-29 groups on the GPU, which
    # then holds 164+ GiB at micro-batch 1 (tests/planner/test_pool.py)
    qwen = dict(LLAMA_13B, vocab_size=152064, num_hidden_layers=48, num_key_value_heads=8)
    free = 124.2 - 4 * sum(_numels(qwen)) / GIB - 3 - 1.5
    with pytest.raises(RuntimeError, match=r"cannot split the state of the first training micro-batch \(4 x 1024 "
                       r"tokens x 1 micro-batches\) between host and GPU: the host holds the grads and optimizer "
                       r"states only with 2\d groups \(\d\.\d\dB params\) or more on the GPU, and with 2\d: host "
                       r"needs .* GPU peak 16\d\.\d GiB of 139\.0 GiB.*HINT: no micro-batch of 1024 tokens fits at "
                       r"any split.*CompactAdamW\(weights='fp32'\).*does not fit either: its grads and states need"):
        _choose(free, shape=qwen)
    # Llama-2-13B at a micro-batch too large for the GPU: the HINT names the largest that fits
    free_13b = 124.2 - 4 * sum(_numels(LLAMA_13B)) / GIB - 3 - 1.8
    with pytest.raises(RuntimeError, match=r"HINT: micro-batch \d+ x 1024 fits with gpu_optimizer_groups=2\d"):
        _choose(free_13b, micro_batch=64)


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(steppable=False), "not one Adam/AdamW optimizer"),
    (dict(custom_clipping=True), "clipping by value"),
])
def test_auto_split_refuses_where_device_groups_cannot_run(gpu_139, overrides, reason):
    with pytest.raises(RuntimeError, match=r"the host cannot hold every group's grads and optimizer states \(\d+\.\d "
                       rf"GiB more, 10\.0 GiB free\), and gpu_optimizer_groups='auto' cannot move any to the GPU: "
                       rf"{reason}.*HINT: an explicit gpu_optimizer_groups=3\d or more .*, host_state='compact'"):
        _choose(10, **overrides)
    assert _choose(1000, **overrides) == (0, _choose(1000, **overrides)[1])  # a host that holds it all: 0


def test_auto_splits_a_compact_state_when_the_host_is_short(gpu_139):
    """Llama-2-13B with host_state="compact" (4.03 B/param of bf16 grad and 8-bit moments to come per host-group
    parameter, 48.9 GiB in all) and 17 GiB free, 1 of them kept spare (SPLIT_HOST_MARGIN_GIB): 28 groups (8.89B
    params) keep the compact layout on the GPU, at 6.03 B/param. With room for everything, none: the hiding of the
    host step is planned for the fp32 host Adam only."""
    numels = _numels(LLAMA_13B)
    compact = lambda n: round(4.03125 * sum(numels[n:]))  # noqa: E731
    config = EngineConfig(overlap_optimizer=True, compile_layers=True, host_state="compact")
    n, why = _choose(17, config=config, to_come=compact)
    assert n == 28 and compact(28) <= (17 - SPLIT_HOST_MARGIN_GIB) * GIB < compact(27)
    assert "28 groups (8.89B params) on the GPU: host needs 16.0 GiB more of 17.0 GiB free (1 GiB kept spare), " \
           "GPU peak 59.6 GiB of 139.0 GiB" in why
    assert _choose(60, config=config, to_come=compact) == (
        0, "the host holds every group's state (host_state='compact': device groups are placed only where it cannot; "
           "hiding the host step with them is planned for the fp32 host Adam)")


def _tiny_engine(monkeypatch) -> MegaTrainEngine:
    """A 4-layer Llama on the CPU engine with ``gpu_optimizer_groups="auto"`` kept undecided (the CPU resolves it
    to 0) and device groups stood in for (they need CUDA): what is tested is the host side."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2))
    config = EngineConfig(overlap_optimizer=False, compile_layers=False, keep_layers=0)
    monkeypatch.setattr(engine_module, "resolve", lambda config, device, hf: config.replace(segment_layers=1,
                                                                                         device_checkpoints=0))

    class FakeDeviceGroup:
        def __init__(self, group, device, compute_dtype, own_grad=True, host_state="fp32") -> None:
            self.group = group

    monkeypatch.setattr(engine_module, "DeviceGroup", FakeDeviceGroup)
    engine = MegaTrainEngine(model, torch.device("cpu"), torch.float32, config)
    engine.setup(fitting=True)
    engine.transfer.set_device_groups = lambda groups: None  # the CPU transfer has no device groups
    return engine


def test_host_grads_wait_for_the_split_and_only_host_groups_allocate_them(monkeypatch, caplog):
    engine = _tiny_engine(monkeypatch)
    forward = [engine.resident_group, *engine.groups]
    assert engine.placement_pending and engine.host_bytes()["grads"] == 0  # deferred: the split decides first
    seen = {}

    def choose(module, batch, **kwargs):  # what the choice reads, before any host grad is allocated
        seen.update(none=kwargs["to_come"](0), every=kwargs["to_come"](len(forward)))
        return 3, "mocked"

    monkeypatch.setattr(first_batch, "choose_gpu_optimizer_groups", choose)
    optimizer = torch.optim.AdamW(engine.module.parameters())
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        engine.place_for_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, grad_accum=1,
                               optimizers=[optimizer], custom_clipping=False, chunked_loss=True)
    assert "gpu_optimizer_groups=3 (auto: mocked)" in caplog.text
    # the count the choice read: every group's grads and moments to come with 0 device groups, none with all
    assert seen == {"none": 12 * sum(g.numel for g in forward), "every": 0}
    assert [d.group for d in engine.device_groups] == forward[:3]
    assert [g.grad_nbytes for g in forward] == [0, 0, 0] + [4 * g.numel for g in forward[3:]]
    assert engine.host_bytes()["grads"] == 4 * sum(g.numel for g in forward[3:])


def test_setup_refuses_when_no_split_can_hold_the_host_state(monkeypatch):
    """The setup's check with the split undecided (host_budget.check_split_possible): a host without room for the
    fewest groups' state, or a GPU without room for their device state, is refused before the first micro-batch."""
    engine = _tiny_engine(monkeypatch)
    forward = [engine.resident_group, *engine.groups]
    optimizer = torch.optim.AdamW(engine.module.parameters(), fused=True)  # as to_host_optimizers makes it
    assert overlappable(optimizer)
    total = 12 * sum(g.numel for g in forward)
    for module in (host_budget, host_store):
        monkeypatch.setattr(module, "placeable_host_bytes", lambda: (total // 2, "MemAvailable"))
    # a CPU compute device cannot hold device groups: the host check's own refusal
    with pytest.raises(RuntimeError, match=r"needs about .* more host RAM for the grads and optimizer states"):
        host_budget.check_split_possible(forward, [optimizer], torch.device("cpu"), torch.float32, "fp32")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1024, 139 * GIB))
    with pytest.raises(RuntimeError, match=r"the host cannot hold every group's grads and optimizer states .* it "
                       r"would with \d groups \(0\.\d\dB params\) keeping theirs on cuda:0 \(gpu_optimizer_groups\), "
                       r"which need \d+\.\d GiB there before any activations, but 0\.0 GiB is free\. HINT: "
                       r"host_state='compact' with torch\.optim\.AdamW and precision='bf16-mixed' "
                       r"\(6\.03 B/param on either memory\) or lightning_megatrain\.optim\.Muon"):
        host_budget.check_split_possible(forward, [optimizer], CUDA, torch.bfloat16, "fp32")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * GIB, 139 * GIB))
    # the GPU holds them: no refusal
    host_budget.check_split_possible(forward, [optimizer], CUDA, torch.bfloat16, "fp32")
    monkeypatch.setattr(host_budget, "placeable_host_bytes", lambda: (total, "MemAvailable"))
    # the host holds all
    host_budget.check_split_possible(forward, [optimizer], torch.device("cpu"), torch.float32, "fp32")


def test_setup_prices_the_device_groups_in_the_host_state_layout(monkeypatch):
    """check_split_possible with CompactAdamW(weights="fp32") (the int8_moments layout of the tiny engine's fp32
    groups): its device groups need 12.03 B per layer parameter and 2.03 per resident one on the GPU (fp32 state's
    would be 18 and 8); a GPU with just that much free passes, one with a byte less refuses with the layout's bytes.
    Under host_state="fp32" the device groups hold fp32 Adam moments, which this optimizer cannot step: the host-only
    refusal."""
    engine = _tiny_engine(monkeypatch)
    forward = [engine.resident_group, *engine.groups]
    optimizer = CompactAdamW(engine.module.parameters(), weights="fp32")
    numels = [g.numel for g in forward]
    to_come = lambda n: round(6.03125 * sum(numels[n:]))  # noqa: E731  fp32 grad, 8-bit moments
    assert host_budget.host_bytes_to_come_split(forward, [optimizer], 0, False) == to_come(0)
    free = to_come(2)  # the host holds the rest with the residents and layer 0 on the GPU
    for module in (host_budget, host_store):
        monkeypatch.setattr(module, "placeable_host_bytes", lambda: (free, "MemAvailable"))
    assert host_budget.fewest_host_groups(lambda n: host_budget.host_bytes_to_come_split(
        forward, [optimizer], n, False), free) == 2
    int8 = round(2.03125 * numels[0] + 12.03125 * numels[1])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int8, 139 * GIB))
    host_budget.check_split_possible(forward, [optimizer], CUDA, torch.bfloat16, host_state="int8_moments")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int8 - 1, 139 * GIB))
    with pytest.raises(RuntimeError, match=rf"it would with 2 groups .* which need {int8 / GIB:.1f} GiB there"):
        host_budget.check_split_possible(forward, [optimizer], CUDA, torch.bfloat16, host_state="int8_moments")
    with pytest.raises(RuntimeError, match=r"needs about .* more host RAM for the grads and optimizer states"):
        host_budget.check_split_possible(forward, [optimizer], CUDA, torch.bfloat16, host_state="fp32")


@pytest.mark.parametrize(("make", "host_state", "steppable"), [
    (lambda params: torch.optim.AdamW(params, fused=True), "fp32", True),
    (lambda params: CompactAdamW(params, weights="fp32"), "int8_moments", True),  # the compact layouts' optimizer
    (lambda params: CompactAdamW(params, weights="fp32"), "fp32", False),  # fp32 device groups hold Adam moments
    (lambda params: torch.optim.SGD(params, lr=0.1), "int8_moments", False),
])
def test_the_split_is_told_whether_device_groups_can_step_the_optimizer(monkeypatch, make, host_state, steppable):
    """What the engine passes to the auto split as ``steppable`` (host_budget.device_steppable): under a compact
    host_state a CompactAdamW steps on the GPU, so a state the host cannot hold is split instead of refused."""
    engine = _tiny_engine(monkeypatch)
    engine.config = engine.config.replace(host_state=host_state)  # the choice is mocked: only the option is read
    seen = {}

    def choose(module, batch, **kwargs):
        seen.update(steppable=kwargs["steppable"])
        return 0, "mocked"

    monkeypatch.setattr(first_batch, "choose_gpu_optimizer_groups", choose)
    engine.place_for_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, grad_accum=1,
                           optimizers=[make(engine.module.parameters())], custom_clipping=False, chunked_loss=True)
    assert seen == {"steppable": steppable}


def test_refusals_suggest_only_a_smaller_state_than_the_runs():
    """The HINT's smaller state: ``compact`` (and Muon) to an fp32 run, ``compact`` to the other layouts, nothing to
    a run already on ``compact``."""
    assert host_store.smaller_state_hint("compact") == ""
    for host_state in ("fp32", "int8_moments", "compact_kahan"):
        hint = host_store.smaller_state_hint(host_state)
        start = "host_state='compact' with torch.optim.AdamW and precision='bf16-mixed' (6.03 B/param"
        assert hint.startswith(start) and hint.endswith(", ")
        assert ("Muon" in hint) == (host_state == "fp32")
