"""The model shape the planner's formulas read: parameters counted exactly on the ``meta`` device, the layer stack and
the residents split exactly as the engine splits them (``engine.discovery``), and per layer what its activations
depend on (norms, stream readers, MLP width, MoE, sliding window, linear attention).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_megatrain.engine.discovery import check_layers_independent, find_layer_stack, tensor_slots
from lightning_megatrain.engine.folded_norms import folded_attention, folded_norms

# Names of Linear modules that write back to the stream (not readers of it); the MLP ones give the intermediate width.
_DOWN_PROJ = ("down_proj", "fc2", "w2", "dense_4h_to_h", "c_proj")
_OUT_PROJ = ("o_proj", "out_proj", "wo", "dense", *_DOWN_PROJ)


@dataclass
class _Layer:
    numel: int  # parameters of this layer
    active: int  # parameters a token passes through (MoE: shared + k/E of the experts)
    readers: int  # nn.Linear modules reading the H-wide stream (outside experts)
    norms: int  # H-wide norm modules
    qk_norm: bool
    dense_i: int  # intermediate width of the dense (or shared-expert) MLP
    gated: bool
    moe: bool
    window: int | None  # sliding window, None = full causal attention
    linear: bool = False  # token mixer is linear attention (Gated DeltaNet, layer_types "linear_attention")
    out_gate: bool = False  # q_proj also computes a sigmoid gate on the attention output (Qwen3.5, Qwen3-Next)
    # the position-wise block (MLP or MoE), which seq_tile runs a tile of positions at a time (engine/tiling.py)
    mlp_readers: int = 0  # of ``readers``, those in that block (gate, up; a MoE router)
    mlp_active: int = 0  # parameters a token passes through in that block (MoE: shared + router + k/E of the experts)
    folded_norm: bool = False  # the norm before that block runs inside its tiles (engine/folded_norms.py)
    # the norm before attention runs inside the tiles of the attention's input projections (folded_attention): how
    # many projections (of ``readers``: q, k, v or Phi-3's qkv; 0 where unfolded) and their parameters
    folded_attn: int = 0
    folded_attn_params: int = 0


@dataclass
class _LinearAttn:
    """Gated DeltaNet shapes (config ``linear_*``); ``chunk`` is transformers' chunked delta rule block size."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int  # causal depthwise conv kernel over the q/k/v channels
    chunk: int = 64


@dataclass
class _Shape:
    name: str
    tied: bool
    n_params: int
    layers: list[_Layer]
    resident_params: int
    embedding_params: int
    resident_buffer_bytes: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_i: int
    attn: str
    attn_softcap: bool
    logit_softcap: bool
    linear_attn: _LinearAttn | None = None


def load_config(model: Any):
    """A HF config from a config object, a dict (``model_type`` + attributes), inline JSON, a .json file, a local
    directory with config.json, or a hub name (needs network or the HF cache).

    Raises:
        FileNotFoundError: ``model`` looks like a path (:func:`_path_like`) that does not exist.
        OSError: a Hub name that neither the Hub nor the cache gives (one line: transformers' first).
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, str) and model.lstrip().startswith("{"):
        model = json.loads(model)
    elif isinstance(model, (str, Path)) and str(model).endswith(".json") and Path(model).is_file():
        model = json.loads(Path(model).read_text())
    if isinstance(model, dict):
        kwargs = dict(model)
        if "model_type" not in kwargs:
            raise ValueError(f"a config dict needs 'model_type' (e.g. 'llama'); got keys {sorted(kwargs)}")
        return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    name = str(model)
    if _path_like(name) and not Path(name).expanduser().exists():
        # transformers would take it for a Hub id and answer "Repo id must be in the form ..."
        raise FileNotFoundError(f"no such file or directory: {name}. HINT: pass a local directory with config.json, "
                                "a .json file (configs/hf/ has the ready configs' shapes), inline JSON or a Hub name")
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as err:
        if Path(name).expanduser().exists():
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"{name!r} is not a local path and its config could not be loaded from the Hugging Face Hub or "
                      f"its cache: {first} HINT: download its config.json and pass the file") from err


def _path_like(name: str) -> bool:
    """A ``--model`` that names a local path rather than a Hub id ("name" or "org/name"): absolute, relative to . or
    ~, a .json file, a backslash or more than one slash, or a first folder that exists here."""
    head = name.split("/", 1)[0]
    return (name.startswith(("/", ".", "~")) or name.endswith(".json") or "\\" in name or name.count("/") > 1
            or ("/" in name and Path(head).is_dir()))


def _unique_numel(params) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def describe(model: Any, name: str = "", attn_implementation: str | None = None) -> _Shape:
    """Count parameters exactly on the ``meta`` device and read the layer shapes the formulas need.

    ``attn_implementation`` overrides the config's (as ``model.attn_implementation`` does in the CLI); ``"auto"``
    plans transformers' default, whose sdpa ``CausalLMModule`` runs as ``packed_sdpa`` with the same memory."""
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    kwargs = {}
    if attn_implementation and attn_implementation != "auto":
        config = copy.deepcopy(config)  # from_config writes the implementation into the config it is given
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, **kwargs)
    text = config.get_text_config()
    _, stack = find_layer_stack(hf)
    residents = tensor_slots(hf, skip=stack)
    check_layers_independent(stack, residents)
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    experts = next((getattr(text, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(text, a, None)), 0)
    top_k = getattr(text, "num_experts_per_tok", 0) or 0
    expert_i = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0)
    layer_types = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    linear_attn = None
    if "linear_attention" in layer_types:  # hybrid stack: Gated DeltaNet layers between full-attention layers
        linear_attn = _LinearAttn(k_heads=text.linear_num_key_heads, v_heads=text.linear_num_value_heads,
                                  k_dim=text.linear_key_head_dim, v_dim=text.linear_value_head_dim,
                                  conv=text.linear_conv_kernel_dim)
    layers, folded, attention = [], folded_norms(stack), folded_attention(stack)
    for i, layer in enumerate(stack):
        numel = _unique_numel(layer.parameters())
        expert = _unique_numel(p for n, p in layer.named_parameters() if ".experts." in f".{n}")
        linears = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear) and ".experts." not in f".{n}."]
        readers = [(n, m) for n, m in linears if m.in_features == hidden and not n.endswith(_OUT_PROJ)]
        dense_i = sum(m.in_features for n, m in linears if n.endswith(_DOWN_PROJ))
        gate_up = sum(m.out_features for n, m in readers if "attn" not in n and "attention" not in n)
        if layer_types:
            sliding = i < len(layer_types) and "sliding" in str(layer_types[i])
        else:
            sliding = bool(window) and getattr(text, "use_sliding_window", True) is not False
        q_proj = next((m for n, m in linears if n.endswith("q_proj")), None)
        projections = attention[i][2] if attention[i] is not None else []
        mixer = lambda n: "attn" in n or "attention" in n  # the token mixer's modules; norms are neither block's
        mlp_dense = sum(p.numel() for n, p in layer.named_parameters()
                        if ".experts." not in f".{n}" and not mixer(n) and "norm" not in n)
        layers.append(_Layer(
            numel=numel,
            active=numel - expert + (expert * top_k // experts if experts else 0),
            readers=len(readers),
            norms=sum(1 for _, m in layer.named_modules() if "norm" in type(m).__name__.lower()
                      and getattr(m, "weight", None) is not None and m.weight.numel() == hidden),
            qk_norm=any(n.endswith(("q_norm", "q_layernorm")) for n, _ in layer.named_modules()),
            dense_i=dense_i, gated=gate_up >= 2 * dense_i > 0, moe=expert > 0, window=window if sliding else None,
            linear=i < len(layer_types) and layer_types[i] == "linear_attention",
            out_gate=q_proj is not None and q_proj.out_features == 2 * heads * head_dim,
            mlp_readers=sum(1 for n, _ in readers if not mixer(n)),
            mlp_active=mlp_dense + (expert * top_k // experts if experts else 0), folded_norm=folded[i] is not None,
            folded_attn=len(projections),
            folded_attn_params=_unique_numel(p for _, m in projections for p in m.parameters())))
    embeddings, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    return _Shape(
        name=name or getattr(config, "name_or_path", "") or config.model_type,
        tied=head is not None and embeddings is not None and head.weight is embeddings.weight,
        n_params=_unique_numel(hf.parameters()), layers=layers,
        resident_params=_unique_numel(s.get() for s in residents if s.is_param),
        embedding_params=embeddings.weight.numel() if embeddings is not None else 0,
        resident_buffer_bytes=sum(s.get().numel() * 4 for s in residents if not s.is_param),
        hidden=hidden, vocab=text.vocab_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        experts=experts, top_k=top_k, expert_i=expert_i,
        attn=getattr(hf.config, "_attn_implementation", None) or "sdpa",
        attn_softcap=bool(getattr(text, "attn_logit_softcapping", None)),
        logit_softcap=bool(getattr(text, "final_logit_softcapping", None)), linear_attn=linear_attn)


def _device_numels(s: _Shape, groups: int) -> tuple[int, list[int]]:
    """(resident params, [params of each layer]) that ``gpu_optimizer_groups=groups`` keeps on the GPU."""
    return (s.resident_params if groups >= 1 else 0), [ly.numel for ly in s.layers[: max(groups - 1, 0)]]
