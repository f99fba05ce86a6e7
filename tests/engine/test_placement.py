"""The "auto" options' decisions (engine/placement.py, [Note: auto placement]), on the CPU: the CUDA device, Triton,
the GPU's size and the host's cores are stand-ins."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import GptOssConfig, LlamaConfig

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import memo_choice, placement
from lightning_megatrain.planner import Machine, plan

CUDA = torch.device("cuda", 0)
# The Llama-3.2-3B shape (3.21B parameters), as tests/planner/test_planner.py plans it
LLAMA_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def test_auto_resolves_per_device_and_explicit_values_stay(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        cpu = placement.resolve(EngineConfig(), torch.device("cpu"))
    assert (cpu.compile_layers, cpu.overlap_optimizer, cpu.gpu_optimizer_groups) == (False, False, 0)
    assert "compile_layers=False (auto: CPU compute device)" in caplog.text

    monkeypatch.setattr(placement, "_triton_usable", lambda: True)
    cuda = placement.resolve(EngineConfig(), CUDA)
    assert (cuda.compile_layers, cuda.overlap_optimizer, cuda.gpu_optimizer_groups) == (True, True, "auto")
    monkeypatch.setattr(placement, "_triton_usable", lambda: False)
    assert placement.resolve(EngineConfig(), CUDA).compile_layers is False
    explicit = EngineConfig(compile_layers=False, overlap_optimizer=False, gpu_optimizer_groups=3,
                            update_during_backward=False)
    assert placement.resolve(explicit, CUDA) == explicit


def _gpt_oss(**kwargs) -> GptOssConfig:
    return GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=128, **kwargs)


@pytest.mark.parametrize("experts", [None, "grouped_mm", "eager"])
def test_gpt_oss_with_grouped_mm_experts_stays_eager(monkeypatch, caplog, experts):
    """gpt-oss whose experts run grouped_mm (transformers' default: ``None``) is not compiled by "auto" on a GPU, and
    the plan prices it so (engine/compiled.py, ``compile_hazard``); eager experts and other models compile; an
    explicit ``compile_layers=True`` stays, with a warning."""
    monkeypatch.setattr(placement, "_triton_usable", lambda: True)
    hf = _gpt_oss(experts_implementation=experts) if experts else _gpt_oss()
    hazard = experts != "eager"
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        chosen = placement.resolve(EngineConfig(), CUDA, hf)
    assert chosen.compile_layers is (not hazard)
    assert ("compile_layers=False (auto: gpt-oss experts through transformers' grouped_mm" in caplog.text) is hazard
    assert placement.resolve(EngineConfig(), CUDA, LlamaConfig(**LLAMA_3B)).compile_layers is True
    assert placement.resolve(EngineConfig(), torch.device("cpu"), hf).compile_layers is False
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_megatrain"):
        assert placement.resolve(EngineConfig(compile_layers=True), CUDA, hf).compile_layers is True
    assert ("compile_layers=True as given" in caplog.text) is hazard
    assert plan(hf, seq_len=256, micro_batch=1).assumptions["compile_layers"] is (not hazard)
    as_dict = {k: v for k, v in hf.to_dict().items() if k != "experts_implementation"}  # a dict or path: the same
    if experts:
        as_dict["experts_implementation"] = experts
    assert plan(as_dict, seq_len=256, micro_batch=1).assumptions["compile_layers"] is (not hazard)


def test_update_during_backward_follows_the_overlapped_step(caplog):
    """``"auto"`` stays "auto" (on, skipping the step after a clipped one) with the overlapped step on a GPU and fp32
    host state, else False with the reason; ``True`` turns an "auto" overlapped step on, also on a CPU device."""
    assert placement.resolve(EngineConfig(), CUDA).update_during_backward == "auto"
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        assert placement.resolve(EngineConfig(), torch.device("cpu")).update_during_backward is False
        assert placement.resolve(EngineConfig(host_state="compact"), CUDA).update_during_backward is False
    assert "update_during_backward=False (auto: no overlapped step)" in caplog.text
    assert "update_during_backward=False (auto: host_state='compact' steps CompactAdamW)" in caplog.text
    forced = placement.resolve(EngineConfig(update_during_backward=True), torch.device("cpu"))
    assert (forced.update_during_backward, forced.overlap_optimizer) == (True, True)


def test_token_shape_of_common_batches():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert placement.token_shape({"input_ids": ids, "labels": ids}) == (4, 16)
    assert placement.token_shape(ids) == (4, 16)
    assert placement.token_shape((torch.zeros(4, 16), ids)) == (4, 16)  # the first 2-D integer tensor
    assert placement.token_shape({"x": torch.zeros(4, 16)}) is None


class _WithConfig(nn.Module):
    def __init__(self, **config) -> None:
        super().__init__()
        self.config = LlamaConfig(**config)


def _choose(module, batch, **overrides):
    kwargs = dict(config=EngineConfig(overlap_optimizer=True, compile_layers=True), device=CUDA,
                  compute_dtype=torch.bfloat16, grad_accum=1, steppable=True, custom_clipping=False, chunked_loss=False)
    return placement.choose_gpu_optimizer_groups(module, batch, **{**kwargs, **overrides})


def test_auto_groups_are_the_planners_suggestion(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 139 * 2**30))
    monkeypatch.setattr("lightning_megatrain.planner.planning.cpu_cores", lambda: 16)
    batch = {"input_ids": torch.zeros(32, 1024, dtype=torch.long)}
    n, why = _choose(_WithConfig(**LLAMA_3B), batch)
    expected = plan(LlamaConfig(**LLAMA_3B), seq_len=1024, micro_batch=32, loss="naive",
                    config=EngineConfig(overlap_optimizer=True, compile_layers=True, gpu_optimizer_groups=0),
                    machine=Machine(gpu_mem_gib=139, cpu_cores=16)).suggested_gpu_optimizer_groups
    assert n == expected and n > 0 and "32 x 1024 tokens" in why
    # the host Adam hides by itself on many cores; a GPU too small for any group gives 0 too
    monkeypatch.setattr("lightning_megatrain.planner.planning.cpu_cores", lambda: 512)
    assert _choose(_WithConfig(**LLAMA_3B), batch)[0] == 0
    monkeypatch.setattr("lightning_megatrain.planner.planning.cpu_cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * 2**30, 24 * 2**30))
    assert _choose(_WithConfig(**LLAMA_3B), batch) == (
        0,
        "at 32 x 1024 tokens x 1 micro-batches no count both hides the host Adam behind the forward and fits the GPU",
    )


@pytest.mark.parametrize(
    ("overrides", "module", "reason"),
    [
        (dict(config=EngineConfig(overlap_optimizer=False)), _WithConfig, "not overlapped"),
        (dict(steppable=False), _WithConfig, "not one Adam/AdamW optimizer"),
        (dict(custom_clipping=True), _WithConfig, "clipping by value or by the module's configure_gradient_clipping"),
        ({}, nn.Linear, "no HF config"),
    ],
)
def test_auto_groups_are_zero_where_they_do_not_apply(overrides, module, reason):
    m = module(**LLAMA_3B) if module is _WithConfig else module(2, 2)
    n, why = _choose(m, torch.zeros(2, 8, dtype=torch.long), **overrides)
    assert n == 0 and reason in why
    assert _choose(_WithConfig(**LLAMA_3B), {"x": torch.zeros(2, 8)}) == (0, "no [B, T] token ids in the batch")


def test_auto_groups_are_zero_where_the_planner_cannot_build_the_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 139 * 2**30))
    from transformers import T5Config

    module = nn.Module()
    module.config = T5Config()  # an encoder-decoder: AutoModelForCausalLM has no class for it
    n, why = _choose(module, torch.zeros(2, 8, dtype=torch.long))
    assert n == 0 and why.startswith("the planner cannot describe this model (ValueError")


# The Llama-2-7B shape (6.74B parameters, 32 layers of multi-head attention)
LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32)
GIB = 2**30


def _checkpoints(shape, seq_len, gpu_gib, host_gib, **options):
    return placement.choose_checkpoints(LlamaConfig(**shape), 1, seq_len, 2, config=EngineConfig(**options),
                                        limits=_limits(gpu_gib, host_gib))


def _limits(gpu_gib: float, host_gib: float, dtype: torch.dtype = torch.bfloat16) -> placement.PlacementLimits:
    return placement.PlacementLimits(dtype, chunked_loss=True, gpu_bytes=int(gpu_gib * GIB),
                                     host_bytes=int(host_gib * GIB))


def test_auto_checkpoints_one_per_layer_on_the_host_where_they_fit():
    k, n, m, why = _checkpoints(LLAMA_3B, 4096, 139, 50)
    assert (k, n, m) == (1, 0, 1)
    assert why == ("all 28 layer-input checkpoints of 48.0 MiB (4 B x hidden 3072 x 1 x 4,096 tokens) fit pinned "
                   "host memory: 28 offloaded (1.3 GiB of 50.0 GiB free); planned for 1 x 4096 tokens x 2 "
                   "micro-batches")


def test_auto_checkpoints_go_to_the_gpu_when_the_host_is_short():
    # 28 x 3 GiB do not fit 60 GiB: the fewest on the GPU with which the rest fit the host, 8, on 139 GiB and 110 alike
    # (as many as fit beside the planned peak put all 28 there on 139 GiB, 22 on 110)
    for gpu_gib in (139, 110):
        k, n, _, why = _checkpoints(LLAMA_3B, 262_144, gpu_gib, 60)
        assert (k, n) == (1, 8)
        assert ("exceed the 60.0 GiB of pinned host memory free: the last 8 stay on the GPU, the fewest the host "
                "needs; 20 offloaded (60.0 GiB of 60.0 GiB free)") in why
    # a GPU that does not hold those 8 beside its peak (46.2 GiB with 5, 55.2 with 8; 61.6 with the norm before
    # attention untiled, when 60 was below it): segments of 2, whose 14 checkpoints all fit the host
    assert _checkpoints(LLAMA_3B, 262_144, 56, 60)[:2] == (1, 8)
    assert _checkpoints(LLAMA_3B, 262_144, 55, 60)[:2] == (2, 0)


def test_auto_checkpoints_take_segments_when_neither_holds_one_per_layer():
    k, n, m, why = _checkpoints(LLAMA_7B, 262_144, 141, 20.5)
    assert (k, n, m) == (2, 11, 1)  # 5 of the 16 on the host, the rest on the GPU (all 16 before)
    assert why.startswith("one checkpoint per layer does not fit with the fewest on the GPU; segments of 2 layers")
    # the longest flat (445,440 and (4, 5) with the norm before attention untiled, 404,480 with neither norm folded)
    assert _checkpoints(LLAMA_7B, 479_232, 141, 20.5)[:3] == (4, 6, 1)
    # past it, nested: segments of 6 layers in sub-segments of 2 hold 3 regenerated inputs at once, not 5
    k, n, m, why = _checkpoints(LLAMA_7B, 524_288, 141, 20.5)
    assert (k, n, m) == (6, 4, 2) and "nested in sub-segments of 2" in why


def test_explicit_checkpoint_options_are_checked():
    assert _checkpoints(LLAMA_7B, 404_480, 141, 20.5, segment_layers=4, device_checkpoints=5)[:2] == (4, 5)
    assert _checkpoints(LLAMA_7B, 131_072, 141, 20.5, segment_layers=32, device_checkpoints=100)[:2] == (32, 1)
    assert _checkpoints(LLAMA_7B, 131_072, 141, 20.5, device_checkpoints=3)[:2] == (3, 3)
    assert _checkpoints(LLAMA_7B, 524_288, 141, 20.5, segment_layers=8, sub_segment_layers=3,
                        device_checkpoints=2)[:3] == (8, 2, 3)
    with pytest.raises(RuntimeError, match=r"fit neither host nor GPU with segment_layers=4, "
                       r"sub_segment_layers='auto', device_checkpoints=0: 8 of 6\.2 GiB .*HINT: the longest "
                       r"sequence that fits this machine at micro-batch 1 is 167,936 tokens \(planned with "
                       r"seq_tile='auto', segment_layers=4, "
                       r"sub_segment_layers='auto', device_checkpoints=0"):
        _checkpoints(LLAMA_7B, 404_480, 141, 20.5, segment_layers=4, device_checkpoints=0)


def test_no_checkpoint_placement_fits_raises_with_the_numbers():
    with pytest.raises(RuntimeError) as error:
        _checkpoints(LLAMA_7B, 524_288, 141, 20.5, sub_segment_layers=1)  # flat segments only
    text = str(error.value)
    for part in ("MegaTrainStrategy cannot place the first training micro-batch (1 x 524288 tokens)",
                 "32 of 8.0 GiB (4 B x hidden 4096 x 1 x 524,288 tokens), 256.0 GiB in all",
                 "the host holds 2 (20.5 GiB of pinned host memory free)",
                 "the GPU's 141.0 GiB leave 51.8 GiB beside its 89.2 GiB peak",
                 "HINT: the longest sequence that fits this machine at micro-batch 1 is 479,232 tokens"):
        assert part in text, part
    with pytest.raises(RuntimeError, match=r"HINT: not even 1,024 tokens fit this machine at micro-batch 1"):
        _checkpoints(LLAMA_7B, 524_288, 8, 20.5)  # 8 GiB: not even the slots, residents and reserve with a layer


def test_checkpoints_unchecked_where_the_planner_cannot_build_the_model():
    from transformers import T5Config

    k, n, m, why = placement.choose_checkpoints(T5Config(), 1, 4096, 1, config=EngineConfig(device_checkpoints=2),
                                             limits=_limits(139, 100))
    assert (k, n, m) == (1, 2, 1) and why.startswith("the planner cannot describe this model (ValueError")


def test_checkpoint_options_resolve_on_a_cpu_compute_device(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        cpu = placement.resolve(EngineConfig(), torch.device("cpu"))
    assert (cpu.segment_layers, cpu.device_checkpoints, cpu.sub_segment_layers, cpu.seq_tile) == (1, 0, 1, "auto")
    assert "segment_layers=1 (auto: CPU compute device, layer inputs stay in host memory)" in caplog.text
    assert placement.resolve(EngineConfig(segment_layers=3), torch.device("cpu")).segment_layers == 3
    cuda = placement.resolve(EngineConfig(), CUDA)
    assert (cuda.segment_layers, cuda.device_checkpoints) == ("auto", "auto")  # decided at the first micro-batch


@pytest.fixture
def h200_host(monkeypatch):
    """The plans of ``choose_attention_memo`` read this machine's host RAM and cores: the H200's here."""
    from lightning_megatrain.planner import planning

    monkeypatch.setattr(planning, "host_ram_gib", lambda: 125.85)
    monkeypatch.setattr(planning, "cpu_cores", lambda: 16)


def _memo(seq_len, gpu_gib=139.7, host_gib=16.7, dtype=torch.bfloat16, shape=LLAMA_7B):
    config = EngineConfig(compile_layers=True, overlap_optimizer=True, gpu_optimizer_groups=0)  # as on the H200
    return memo_choice.choose_attention_memo(LlamaConfig(**shape), 1, seq_len, 1, config=config,
                                           limits=_limits(gpu_gib, host_gib, dtype))


def test_auto_memo_where_it_fits_and_pays(h200_host):
    # the Llama-2-7B shape on the H200's limits (16.7 GiB of pinned host memory free for checkpoints, as the 131,072
    # run had): at 131,072 and 262,144 tokens the memos fit beside the checkpoints placed with them and plan +18% and
    # +13% (the plan `megatrain plan` names); at 4,096 they cannot gain 5%; at 524,288 they do not fit beside the
    # checkpoints, nor at 131,072 on a GPU of 60 GiB; fp32 compute does not run cuDNN's kernel
    on, why = _memo(131_072)
    assert on and why.startswith("at 1 x 131072 tokens the memos (32.5 GiB on the GPU) plan +18% tokens/s (2,539 -> ")
    assert _memo(262_144)[0]
    # with the 8.5 GiB of pinned host memory the 262,144 run measured (14 checkpoints on the GPU) every layer's memos
    # need longer segments and plan +4%; the log names the explicit partial memos that fit the GPU memory left and
    # pay, which "auto" does not take
    off, why = _memo(262_144, host_gib=8.5)
    assert not off and why.startswith("at 1 x 262144 tokens the memos (65.0 GiB) plan +4% tokens/s, under the 5%")
    assert why.endswith("; attention_memo=10 (the last 10 layers' memos, 20.3 GiB in the GPU memory the checkpoints "
                        "leave) plans +5%, not taken by 'auto'")
    off, why = _memo(4096)
    assert not off and why.startswith("at 1 x 4096 tokens the memos (1.0 GiB) plan +") and "under the 5%" in why
    off, why = _memo(524_288)
    assert not off and why.startswith("the memos do not fit beside the checkpoints: ") and "attention_memo=" not in why
    off, why = _memo(131_072, gpu_gib=60)
    assert not off and "the GPU peak is 61.2 GiB of 60.0 GiB" in why
    assert _memo(131_072, dtype=torch.float32) == (
        False, "fp32 compute: cuDNN's attention kernel, the one the memo calls, runs fp16 and bf16")
    from transformers import T5Config

    off, why = memo_choice.choose_attention_memo(T5Config(), 1, 4096, 1, config=EngineConfig(),
                                               limits=_limits(139, 1))
    assert not off and why.startswith("the planner cannot describe this model (ValueError")


def test_auto_memo_is_off_on_a_cpu_compute_device_and_outside_training(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        assert placement.resolve(EngineConfig(), torch.device("cpu")).attention_memo is False
    assert "attention_memo=False (auto: CPU compute device" in caplog.text
    assert placement.resolve(EngineConfig(), CUDA).attention_memo == "auto"  # decided at the first micro-batch
    assert placement.resolve(EngineConfig(attention_memo=True), torch.device("cpu")).attention_memo is True
    assert EngineConfig().for_stage(False, None).attention_memo is False
    assert EngineConfig().for_stage(True, None).attention_memo == "auto"


def test_a_longer_micro_batch_places_the_checkpoints_again(monkeypatch):
    # the checkpoints are placed for the first training micro-batch's tokens and again, "auto" still "auto", for any
    # longer one; shorter or equal ones reuse the placement. The engine is driven directly (its CUDA caller,
    # MegaTrainStrategy.training_step, needs a GPU): the chooser and the device query are stubbed.
    import lightning as L

    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain.engine import engine as engine_module
    from lightning_megatrain.engine import first_batch

    from helpers.parity import ParityLM, make_data
    from helpers.trainers import cpu_trainer

    calls = []

    def choose(hf_config, micro_batch, seq_len, grad_accum, *, config, **kwargs):
        calls.append((micro_batch, seq_len, config.segment_layers, config.device_checkpoints,
                      config.sub_segment_layers, config.attention_memo))
        return 2, 1, 3, "stub"

    # the memos are decided first ("auto" still "auto" at the longer micro-batch) and the checkpoints placed with
    # them; off at a longer micro-batch, they are not decided again at a still longer one (keep_layers="auto"
    # measured its GPU budget at the first micro-batch)
    memos = []

    def choose_memo(hf_config, micro_batch, seq_len, grad_accum, *, config, **kwargs):
        memos.append((seq_len, config.attention_memo))
        return seq_len != 32, "stub"

    monkeypatch.setattr(first_batch, "choose_checkpoints", choose)
    monkeypatch.setattr(first_batch, "choose_attention_memo", choose_memo)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 40))
    resolve = engine_module.resolve  # as on a GPU: a CPU compute device resolves them to 1 and 0 (and no memo)
    monkeypatch.setattr(engine_module, "resolve", lambda config, device, hf: resolve(config, device, hf).replace(
        segment_layers="auto", device_checkpoints="auto", sub_segment_layers="auto", attention_memo="auto"))

    class Drive(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.strategy.engine
            short, first, longer = (torch.zeros(2, n, dtype=torch.long) for n in (8, 16, 32))
            assert not engine.checkpoints_outgrown(first)  # nothing placed yet: the first placement is elsewhere
            engine.place_checkpoints(first, 1, trainer.strategy.optimizers, True)
            self.memo = [engine.streamed.memo is not None]
            self.outgrown = [engine.checkpoints_outgrown(b) for b in (short, first, longer)]
            engine.place_checkpoints(longer, 1, trainer.strategy.optimizers, True)
            self.memo.append(engine.streamed.memo is not None)
            engine.place_checkpoints(torch.zeros(2, 64, dtype=torch.long), 1, trainer.strategy.optimizers, True)
            self.memo.append(engine.streamed.memo is not None)
            segments = engine.streamed.segments
            self.segments = (segments.layers, segments.device_checkpoints, segments.sub)

    drive = Drive()
    cpu_trainer(strategy=MegaTrainStrategy(cpu_adam="torch"), max_steps=1, callbacks=[drive]).fit(
        ParityLM("llama_tied"), torch.utils.data.DataLoader(make_data()[:2], batch_size=2)
    )
    assert drive.outgrown == [False, False, True]
    assert calls == [(2, 16, "auto", "auto", "auto", True), (2, 32, "auto", "auto", "auto", False),
                     (2, 64, "auto", "auto", "auto", False)]
    assert memos == [(16, "auto"), (32, "auto")] and drive.memo == [True, False, False]
    assert drive.segments == (2, 1, 3)
