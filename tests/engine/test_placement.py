"""The "auto" options' decisions (engine/placement.py, [Note: auto placement]), on the CPU: the CUDA device, Triton,
the GPU's size and the host's cores are stand-ins."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import placement
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
    explicit = EngineConfig(compile_layers=False, overlap_optimizer=False, gpu_optimizer_groups=3)
    assert placement.resolve(explicit, CUDA) == explicit


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
                  compute_dtype=torch.bfloat16, grad_accum=1, adam_only=True, custom_clipping=False, chunked_loss=False)
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
        (dict(adam_only=False), _WithConfig, "not one Adam/AdamW optimizer"),
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
