"""Tiny random-init configs of real causal-LM architectures for the CPU parity tests.

Each factory returns a fresh ``transformers`` config (build the model with
``AutoModelForCausalLM.from_config``). Sizes are tiny so that a 3-step Lightning run
takes about a second on two CPU cores. Only constructor arguments that exist in both
transformers 5.17 and 5.24 are used (e.g. gpt-oss ``swiglu_limit`` is 5.24-only).

Attention (and, for MoE, experts) implementations are pinned per family in the config;
all are deterministic on CPU. Dropout is 0 everywhere except ``llama_untied``
(``attention_dropout=0.1``), which exercises RNG replay in layer recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import transformers
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 128
SEQ = 16  # the harness' sequence length; sliding windows below are smaller than it

# Shared by every family. bos/eos/pad are set explicitly because several defaults
# (e.g. phi3 pad_token_id=32000) lie outside the tiny vocabulary.
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.02,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _cfg(cls, attn: str, **kw) -> PretrainedConfig:
    args = {**_COMMON, **kw}
    return cls(attn_implementation=attn, **args)


def llama_tied() -> PretrainedConfig:
    return _cfg(LlamaConfig, "sdpa", intermediate_size=64, head_dim=8, tie_word_embeddings=True)


def llama_untied() -> PretrainedConfig:
    # The one family with dropout: recompute must replay the dropout masks.
    return _cfg(
        LlamaConfig,
        "eager",
        intermediate_size=64,
        head_dim=8,
        tie_word_embeddings=False,
        attention_dropout=0.1,
    )


def qwen2() -> PretrainedConfig:
    # Qwen2 always has q/k/v biases (no config switch).
    return _cfg(Qwen2Config, "sdpa", intermediate_size=64)


def qwen3() -> PretrainedConfig:
    # q_norm / k_norm RMSNorms over head_dim.
    return _cfg(Qwen3Config, "eager", intermediate_size=64, head_dim=8, tie_word_embeddings=True)


def mistral() -> PretrainedConfig:
    # Window 8 < SEQ 16: the sliding mask really drops keys.
    return _cfg(MistralConfig, "sdpa", intermediate_size=64, head_dim=8, sliding_window=8)


def gemma2() -> PretrainedConfig:
    # sdpa cannot softcap, so eager. Per-layer windows are expressed by `layer_types`.
    return _cfg(
        Gemma2Config,
        "eager",
        intermediate_size=64,
        head_dim=8,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        query_pre_attn_scalar=16,  # != head_dim, so the scaling path is distinguishable
        attn_logit_softcapping=5.0,  # small so that it actually bends the logits
        final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh",
    )


def gemma3() -> PretrainedConfig:
    # Text-only Gemma3ForCausalLM: q/k norm, sliding/full layers with *different* rotary
    # embeddings per layer type, 4 norms per layer.
    return _cfg(
        Gemma3TextConfig,
        "sdpa",
        intermediate_size=64,
        head_dim=8,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
        query_pre_attn_scalar=16,
        final_logit_softcapping=3.0,
    )


def phi3() -> PretrainedConfig:
    # Fused qkv_proj and gate_up_proj.
    return _cfg(Phi3Config, "sdpa", intermediate_size=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


def mixtral() -> PretrainedConfig:
    # 8 experts, top-2; experts are fused 3D parameters in transformers 5.x. "eager" experts
    # loop over the experts that received tokens and skip the others.
    return _cfg(
        MixtralConfig,
        "sdpa",
        experts_implementation="eager",
        intermediate_size=32,
        head_dim=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=False,
        router_jitter_noise=0.0,
    )


def qwen3_moe() -> PretrainedConfig:
    # grouped_mm is the transformers 5.x default experts implementation (empty groups for
    # experts without tokens).
    return _cfg(
        Qwen3MoeConfig,
        "eager",
        experts_implementation="grouped_mm",
        intermediate_size=64,
        moe_intermediate_size=32,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )


def gpt_oss() -> PretrainedConfig:
    # Attention sinks + biases; eager is the only non-flex implementation (no sdpa).
    return _cfg(
        GptOssConfig,
        "eager",
        experts_implementation="grouped_mm",
        intermediate_size=32,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        # YaRN like the real model, rescaled so that factor == max_pos / original_max_pos
        # (the default original_max_position_embeddings=4096 makes transformers warn).
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 150000.0,
        },
        output_router_logits=False,
    )


def qwen3_5() -> PretrainedConfig:
    # Hybrid stack: Gated DeltaNet linear-attention layers (causal conv + recurrent delta rule, torch fallback on
    # CPU) alternating with gated full-attention layers, per `layer_types`. Needs transformers with Qwen3.5.
    from transformers import Qwen3_5TextConfig

    return _cfg(
        Qwen3_5TextConfig,
        "sdpa",
        intermediate_size=64,
        head_dim=8,
        num_hidden_layers=4,
        full_attention_interval=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=True,
    )


FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama_tied": llama_tied,
    "llama_untied": llama_untied,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "mistral": mistral,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "phi3": phi3,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
}
if hasattr(transformers, "Qwen3_5TextConfig"):  # newer than some supported transformers releases
    FAMILIES["qwen3_5"] = qwen3_5

MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")

# Router auxiliary-loss weight of the router-loss runs: the configs' default is 0.001; 0.1 makes the router loss's share
# of each router's gradient large (over 5%, tests/engine/test_recorded.py checks it), so a dropped, doubled or misplaced
# router-loss gradient is far outside the parity tolerance.
ROUTER_AUX_COEF = 0.1


def with_router_aux(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with the MoE router auxiliary loss on (``output_router_logits``), weighted ``ROUTER_AUX_COEF``."""
    config.output_router_logits = True
    config.router_aux_loss_coef = ROUTER_AUX_COEF
    return config
