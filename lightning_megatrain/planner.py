"""Memory and throughput model of the MegaTrain engine: what ``megatrain plan`` prints (DESIGN principle 8).

``plan(model, seq_len=..., micro_batch=...)`` builds the model on the ``meta`` device (no allocation), splits it into
the streamed layer stack and the residents exactly as the engine does (``engine.discovery``), and models:

- host RAM (bytes): fp32 masters 4 + fp32 grads 4 (both page-locked at their exact size) + optimizer states (AdamW 8,
  SGD 0, SGD+momentum 4; none for ``gpu_optimizer_groups``) per parameter, 3 grad slabs, offloaded layer inputs
  (page-locked at their exact size too) and the process itself;
- GPU memory (bytes): slots, residents, ``gpu_optimizer_groups`` state, saved layer inputs, the runtime reserve, plus
  the larger of two phases that never overlap: the backward of one layer (its recompute activations and grads) and
  the loss;
- time (seconds) per optimizer step: GPU compute, PCIe transfers (busy and exposed), host optimizer, resident traffic.

Activation bytes per token of one decoder layer recomputed with grad (``c`` = compute itemsize, 2 under bf16-mixed,
4 under 32-true; the residual stream is fp32 because embeddings and norms are fp32 residents under autocast). Derived
op by op from HF's Llama/Qwen/Gemma/Mixtral layers and checked against the tensors autograd saves
(tests/test_planner.py counts them with ``saved_tensors_hooks``; exact for Llama/Mixtral/Qwen3 with sdpa)::

    saved = 4H                         fp32 residual after attention (saved by the 2nd norm)
          + n_norm * (4H + 4)          each H-wide RMSNorm saves its fp32 normalised value (+ rsqrt)
          + (n_norm - 2) * 4H          Gemma-style post-norms also save an fp32 copy of their bf16 input
          + n_read * 2H   (c = 2)      autocast copy of the fp32 stream for every Linear reading it (q,k,v,gate,up)
          + c*(2A + 2K) + 4*nh         sdpa/flash inputs q,k,v and output, fp32 logsumexp
            [eager: 4cA + nh*T*(4 + c (+c with attention logit softcap)): probabilities over all T keys]
          + (4 + c)*(A + K) + 4(nh+nkv) q/k RMSNorm over head_dim (Qwen3, Gemma3)
          + 2cA                        output gate (Qwen3.5): sigmoid(gate) and the gated output o_proj reads
            [linear attention (Gated DeltaNet layers of Qwen3.5) instead of sdpa/eager: ``_linear_attn_saved``]
          + 4cI (gated MLP: gate, act, up, product) or 2cI (fc1/act/fc2)
          + MoE: 4E + 12k + k*(H(c + 4) + 5cI_e + 20)   router logits/top-k, per routed token gathered input,
                                                         expert intermediates, weighted fp32 output
    transient = 8H + 2c*max(I, k*I_e)   recompute output and incoming grad (fp32), grads of the MLP intermediates

with H hidden, A = heads*head_dim, K = kv_heads*head_dim, I intermediate, E experts, k experts per token.
Llama-3.2-3B on the H200 (benchmarks/planner_gpu_check.py, 2026-11-29, torch 2.11, flash sdpa): 149,608 B/token
saved, measured = formula to the byte; backward peak 194,664 B/token + the incoming grad 4H allocated before it
= 206,952 = saved + transient, exactly (plus one weight grad, down_proj's, as a constant).

FLOPs (per token): layers 8*N_active (6N fwd+bwd, Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
+2N for the forward recomputed in backward), attention 16*A*T_k per layer (PaLM, Chowdhery et al. 2022, app. B,
counts 12*H*T for fwd+bwd over all T keys; we count the keys a causal mask leaves, T_k ~ T/2, because flash kernels
skip masked blocks, and add one forward 4*A*T_k for the recompute), LM head 6*V*H. MFU uses the BENCHMARKS.md
convention: 6 * (non-embedding active params incl. the LM head matmul) * tokens / time / 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_megatrain._hardware import GIB, H100_BF16_PEAK_FLOPS, meminfo_bytes
from lightning_megatrain.engine.device_state import gpu_bytes_per_param
from lightning_megatrain.engine.discovery import (
    check_layers_independent,
    find_layer_stack,
    tensor_slots,
)

# --- Constants: BENCHMARKS.md, lent nvidia-h200 (H200 + 16-core host), measured 2026-11-29 unless stated -----------
PCIE_H2D_GBPS = 55.4  # pinned H2D, GB/s (1e9 B/s)
PCIE_D2H_GBPS = 55.3  # pinned D2H, GB/s
PCIE_DUPLEX_GBPS = 97.0  # both directions at once, GB/s in total
# Sustained rate on *executed* FLOPs (8N + attention + head). BENCHMARKS.md's bf16 3B layer (14.3 ms fwd, 43.3 ms
# fwd+bwd at 32K tokens, seq 4096 as in benchmarks/core_gpu.py) and chunked head (150 ms) both run at ~515 counted this
# way (457 counting 6N only). The engine's own path (fp32 residual stream, autocast without cache, bf16 slot weights)
# measured 425-437 for fwd+bwd on the H200 (benchmarks/planner_gpu_check.py, 2026-11-29, 5 iterations): 450 default.
ACHIEVED_TFLOPS = 450.0
# compile_layers: plain GPU training with every decoder layer compiled ran 1.29x its eager rate on the same FLOPs
# (3.21B on the H200: 21,459 / 16,589 tokens/s at 32K tokens, 21,672 / 16,802 at 64K with the chunked loss;
# benchmarks/results/2026-11-29-llama-3.2-3b-h200.json); applied to the whole step: 450 x 1.29.
COMPILED_TFLOPS = 580.0
FP32_TFLOPS = 50.0  # 32-true: H200 datasheet fp32 (non-tensor) ~67 TFLOP/s; assumed ~75% achieved, not measured
PEAK_TFLOPS = H100_BF16_PEAK_FLOPS / 1e12  # dense bf16 datasheet peak (H100/H200); MFU is quoted against it
CPU_ADAM_GPARAMS = 3.6  # DeepSpeedCPUAdam, 16 threads, fp32, Gparam/s
TORCH_ADAM_GPARAMS = 3.1  # torch fused AdamW on the CPU, same machine (what the overlapped step runs)
CPU_REF_CORES = 16
HOST_COPY_GBPS = 79.0  # host memory copy, 16 threads, read+write GB/s
HOST_REF_GIB = 128.0  # host RAM of the lent nvidia-h200 machine
GPU_REF_GIB = 139.0  # usable GPU memory of the lent nvidia-h200 (device tool: "about 139 GiB")
PROCESS_GIB = 3.0  # CUDA context, libraries, Python (engine estimate)
GPU_RESERVE_GIB = 2.0  # CUDA context, cuBLAS workspaces, allocator fragmentation (estimate)
# Names of Linear modules that write back to the stream (not readers of it); the MLP ones give the intermediate width.
_DOWN_PROJ = ("down_proj", "fc2", "w2", "dense_4h_to_h", "c_proj")
_OUT_PROJ = ("o_proj", "out_proj", "wo", "dense", *_DOWN_PROJ)
# optimizer -> (host state bytes/param, Gparam/s at CPU_REF_CORES). Adam moves 28 B/param (read p,g,m,v; write p,m,v);
# SGD is assumed to run at the same bytes/s: 12 B/param (p,g,p), with momentum 20 B/param. Derived, not measured.
OPTIMIZERS = {"adamw": (8, CPU_ADAM_GPARAMS), "adam": (8, CPU_ADAM_GPARAMS),
              "sgd": (0, CPU_ADAM_GPARAMS * 28 / 12), "sgd_momentum": (4, CPU_ADAM_GPARAMS * 28 / 20)}
PRECISIONS = {"bf16-mixed": 2, "32-true": 4}  # compute itemsize


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


@dataclass
class Plan:
    """Result of :func:`plan`. Bytes are bytes, times are seconds per optimizer step, rates per second."""

    model: str
    precision: str
    optimizer: str
    loss: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    offload_activations: bool
    n_params: int
    n_layers: int
    layer_params: int  # all layers together
    max_layer_params: int
    resident_params: int
    active_params: int  # per token: residents + shared layer weights + k/E of the experts
    host: dict[str, int]
    host_limit: int
    gpu: dict[str, int]  # items; the "phase:" ones are alternatives (peak = persistent + the larger phase)
    gpu_limit: int
    max_micro_batch: int  # largest micro-batch that fits gpu_limit (0: none)
    max_micro_batch_host: int  # largest whose host RAM (offloaded activations grow with it) fits host_limit
    activation_per_token: dict[str, float]  # one layer recomputed with grad: saved, transient (bytes/token)
    time: dict[str, float]
    transfers_hidden: bool
    min_micro_batch_to_hide: int | None
    tokens_per_step: int
    tokens_per_s: float
    model_tflops: float
    mfu: float
    mfu_with_attention: float
    assumptions: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # overlap_optimizer only: the fewest gpu_optimizer_groups whose host Adam no longer outlasts the next forward
    suggested_gpu_optimizer_groups: int | None = None

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def host_state_bytes_per_param(self) -> float:
        """Masters + grads + optimizer states per parameter (16 with AdamW)."""
        return (self.host["masters"] + self.host["grads"] + self.host["optimizer states"]) / self.n_params

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_total / self.n_params

    @property
    def gpu_total(self) -> int:
        return _gpu_peak(self.gpu)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(host_total=self.host_total, gpu_total=self.gpu_total, host_bytes_per_param=self.host_bytes_per_param,
                 host_state_bytes_per_param=self.host_state_bytes_per_param)
        return d

    def report(self) -> str:
        """A readable table (GiB = 2**30 bytes)."""
        g = lambda b: f"{b / GIB:9.2f} GiB"
        lines = [
            f"MegaTrain plan: {self.model}  ({self.precision}, {self.optimizer}, {self.loss} loss)",
            (f"  params {self.n_params / 1e9:.3f}B = {self.n_layers} layers x {self.max_layer_params / 1e6:.1f}M (max)"
            f" + {self.resident_params / 1e6:.1f}M resident; active per token {self.active_params / 1e9:.3f}B"),
            (f"  tokens/step {self.tokens_per_step:,} = micro-batch {self.micro_batch} x seq {self.seq_len} x accum "
            f"{self.grad_accum}; activation offload {'on' if self.offload_activations else 'off'}"),
            "", "  Host RAM", *(f"    {k:<28}{g(v)}" for k, v in self.host.items()),
            (f"    {'total':<28}{g(self.host_total)}  of {self.host_limit / GIB:.1f} GiB  "
            f"({self.host_bytes_per_param:.2f} B/param; state {self.host_state_bytes_per_param:.0f} B/param)"),
            "", "  GPU memory (peak = persistent + the larger phase)",
            *(f"    {k:<48}{g(v)}" for k, v in self.gpu.items()),
            (f"    {'peak':<48}{g(self.gpu_total)}  of {self.gpu_limit / GIB:.1f} GiB; "
            f"largest micro-batch that fits: {self.max_micro_batch} (host RAM: {self.max_micro_batch_host})"),
            (f"    activations of one layer: {self.activation_per_token['saved']:,.0f} B/token saved + "
            f"{self.activation_per_token['transient']:,.0f} transient"),
            "", "  Time per optimizer step",
            *(f"    {k:<36}{v * 1e3:10.1f} ms" for k, v in self.time.items()),
            f"    transfers hidden behind compute: {'yes' if self.transfers_hidden else 'NO'}"
            + (f" (needs micro-batch >= {self.min_micro_batch_to_hide})" if self.min_micro_batch_to_hide else ""),
            (f"  Throughput {self.tokens_per_s:,.0f} tokens/s, {self.model_tflops:.0f} model TFLOP/s, "
            f"MFU {self.mfu:.1%} ({self.mfu_with_attention:.1%} with attention) vs {PEAK_TFLOPS:.0f} TFLOP/s"),
        ]
        suggested = self.suggested_gpu_optimizer_groups
        if suggested is not None and suggested != self.assumptions.get("gpu_optimizer_groups"):
            lines.append(f"  gpu_optimizer_groups={suggested} is the fewest with which the host Adam no longer "
                         "outlasts the next forward")
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ model description
def load_config(model: Any):
    """A HF config from a config object, a dict (``model_type`` + attributes), inline JSON, a .json file, a local
    directory with config.json, or a hub name (needs network or the HF cache)."""
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
    return AutoConfig.from_pretrained(str(model))


def _unique_numel(params) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def describe(model: Any, name: str = "", attn_implementation: str | None = None) -> _Shape:
    """Count parameters exactly on the ``meta`` device and read the layer shapes the formulas need.

    ``attn_implementation`` overrides the config's (as ``model.attn_implementation`` does in the CLI)."""
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    kwargs = {}
    if attn_implementation:
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
    layers = []
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
        layers.append(_Layer(
            numel=numel,
            active=numel - expert + (expert * top_k // experts if experts else 0),
            readers=len(readers),
            norms=sum(1 for _, m in layer.named_modules() if "norm" in type(m).__name__.lower()
                      and getattr(m, "weight", None) is not None and m.weight.numel() == hidden),
            qk_norm=any(n.endswith(("q_norm", "q_layernorm")) for n, _ in layer.named_modules()),
            dense_i=dense_i, gated=gate_up >= 2 * dense_i > 0, moe=expert > 0, window=window if sliding else None,
            linear=i < len(layer_types) and layer_types[i] == "linear_attention",
            out_gate=q_proj is not None and q_proj.out_features == 2 * heads * head_dim))
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


# ---------------------------------------------------------------------------------------------------- the formulas
def _keys(seq_len: int, window: int | None) -> float:
    """Average keys a causal (optionally sliding-window) query attends to."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window * (1 - window / (2 * seq_len))


def layer_activation(s: _Shape, layer: _Layer, seq_len: int, c: int) -> tuple[float, float]:
    """(saved, transient) bytes per token of one layer recomputed with grad (formula: module docstring)."""
    H, A, K = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    saved = 4 * H + layer.norms * (4 * H + 4) + max(layer.norms - 2, 0) * 4 * H
    saved += layer.readers * 2 * H if c < 4 else 0
    if layer.linear:
        saved += _linear_attn_saved(s.linear_attn, seq_len, c)
    elif s.attn == "eager":
        # q, repeated k and v, output; fp32 softmax + low-precision probs over all T keys (+ tanh with softcap)
        saved += 4 * c * A + s.heads * seq_len * (4 + c + (c if s.attn_softcap else 0))
    else:
        saved += c * (2 * A + 2 * K) + 4 * s.heads
    if layer.out_gate:  # sigmoid(gate) and the gated output that o_proj reads (else o_proj reads the attention output)
        saved += 2 * c * A
    if layer.qk_norm:
        saved += (4 + c) * (A + K) + 4 * (s.heads + s.kv_heads)
    saved += (4 if layer.gated else 2) * c * layer.dense_i
    widest = layer.dense_i
    if layer.moe:
        k = s.top_k
        saved += 4 * s.experts + 12 * k + k * (H * (c + 4) + 5 * c * s.expert_i + 20)
        widest = max(widest, k * s.expert_i)
    return saved, 8 * H + 2 * c * widest


def _linear_attn_saved(la: _LinearAttn, seq_len: int, c: int) -> float:
    """Bytes per token that one Gated DeltaNet mixer saves for backward, op by op, in transformers' PyTorch chunked
    delta rule (``torch_chunk_gated_delta_rule``, the path without flash-linear-attention / causal-conv1d; their
    fused kernels save less). Checked against the tensors autograd saves (tests/test_planner.py).

    q = k = v_heads * k_dim (q and k repeated to the value heads), v = v_heads * v_dim, C = chunk; under autocast
    (c = 2) every matmul in the chunk loop saves compute-dtype copies of its inputs (no autocast cache), under
    32-true the fp32 tensors, most of which are saved anyway."""
    hv, C, autocast = la.v_heads, la.chunk, c < 4
    q, v = hv * la.k_dim, hv * la.v_dim
    chunks = -(-seq_len // C)
    pad = chunks * C / seq_len  # tensors from the padding to whole chunks on are chunks * C long
    # chunk 0 reads a zero state (its k_cumdecay and query products save no copy); the state update after the last
    # chunk feeds nothing, so autograd frees what it saved
    later = (chunks - 1) / chunks
    state = hv * la.k_dim * la.v_dim / C  # one [v_heads, k_dim, v_dim] fp32 recurrent state per chunk
    unpadded = (c * (2 * la.k_heads * la.k_dim + v) * (2 + (la.conv - 1) / seq_len)  # conv1d input, SiLU input
                + c * hv + 8 * hv  # sigmoid(b); fp32 softplus input and output of the decay g
                + 2 * (4 * q + 4 * hv)  # l2norm of q and of k: fp32 input, rsqrt
                + (12 + 2 * c) * v + 4 * hv  # gated RMSNorm: fp32 input, rsqrt, normed, weighted, fp32 z, SiLU(z)
                + c * v)  # out_proj input
    padded = (4 * hv + 4 * v + 4 * q  # beta and value (v_beta), normalised key (k_beta)
              + 4 * hv * C + 2 * c * hv * C  # exp of the pairwise decays [C, C]; k_beta k^T and q k^T products
              + 4 * c * q  # copies of k_beta, key (twice) and query that those two 5-D matmuls save
              + 4 * hv + 4 * q  # exp(cumulative decay), fp32 k_beta (decayed_k_beta)
              + 4 * hv * C + 4 * v + 4 * q  # triangular solves: the system, new values, k_cumdecay
              + 8 * hv + 4 * q)  # decays applied to query and key, the scaled query
    if autocast:  # chunk loop: copies of k_cumdecay, query, key, intra-chunk attention, v_new (twice), state (twice);
        # the fp32 state itself is saved only by its decay product, so not the last chunk's
        loop = 3 * c * q * later + c * hv * C + c * v * (1 + later) + (2 * c + 4 * later) * state
    else:  # decayed query and key, intra-chunk attention, v_new, state
        loop = 8 * q * (chunks > 1) + 4 * hv * C + 4 * v + 4 * state
    return unpadded + (padded + loop) * pad


def _attn_flops(s: _Shape, layer: _Layer, seq_len: int) -> float:
    """Forward token-mixer FLOPs per token of one layer: attention QK^T and PV over the keys a causal mask leaves;
    linear attention, per value head and chunk row: k_beta k^T and q k^T (4 C k_dim), the two triangular solves
    (C (k_dim + v_dim)), the intra-chunk product (2 C v_dim) and three state matmuls (6 k_dim v_dim)."""
    if layer.linear:
        la = s.linear_attn
        return la.v_heads * (5 * la.chunk * la.k_dim + 3 * la.chunk * la.v_dim + 6 * la.k_dim * la.v_dim)
    return 4 * s.heads * s.head_dim * _keys(seq_len, layer.window)


def _device_numels(s: _Shape, groups: int) -> tuple[int, list[int]]:
    """(resident params, [params of each layer]) that ``gpu_optimizer_groups=groups`` keeps on the GPU."""
    return (s.resident_params if groups >= 1 else 0), [ly.numel for ly in s.layers[: max(groups - 1, 0)]]


def _gpu_peak(gpu: dict[str, int]) -> int:
    persistent = sum(v for k, v in gpu.items() if not k.startswith("phase"))
    backward = sum(v for k, v in gpu.items() if k.startswith("phase backward"))
    loss = sum(v for k, v in gpu.items() if k.startswith("phase loss"))
    return persistent + max(backward, loss)


def gpu_bytes(s: _Shape, micro_batch: int, seq_len: int, *, c: int, offload: bool, loss: str, loss_chunk: int,
              num_slots: int, reserve_gib: float, gpu_groups: int = 0) -> tuple[dict[str, int], tuple[float, float]]:
    """GPU items in bytes for one micro-batch, and the (saved, transient) activation bytes per token."""
    tokens, H, V = micro_batch * seq_len, s.hidden, s.vocab
    max_layer = max(layer.numel for layer in s.layers)
    act = max((layer_activation(s, layer, seq_len, c) for layer in s.layers), key=sum)
    stream = 4 * H * tokens  # one layer's input: fp32 residual stream [B, T, H]
    if loss == "chunked":  # models/loss.py: [C, V] fp32 logits + exp/softmax temporaries, bf16 copies
        chunk = min(loss_chunk, tokens) * V * (8 + (4 if s.logit_softcap else 0))
        head = V * H * (4 + (4 if c < 4 else 0)) + chunk  # fp32 dL/dW accumulator (+ bf16 W copy, bf16 product)
    else:  # HF loss: bf16 logits, fp32 upcast, log_softmax output, its grad and the grad of the logits
        head = tokens * V * 12
    gpu = {
        f"slots ({num_slots} x largest layer)": num_slots * max_layer * (4 + (c if c < 4 else 0)),
        "residents (fp32 copy + grad)": 8 * s.resident_params + s.resident_buffer_bytes,
        # engine/device_state.py: the residents' two moments; a layer's fp32 mirror, grad, moments (+ compute copy)
        "optimizer groups on the GPU": gpu_bytes_per_param(c, resident=True) * _device_numels(s, gpu_groups)[0]
        + gpu_bytes_per_param(c, resident=False) * sum(_device_numels(s, gpu_groups)[1]),
        "saved layer inputs": (2 if offload else len(s.layers)) * stream + 8 * s.head_dim * tokens,
        "runtime reserve": int(reserve_gib * GIB),
        "phase backward: one layer's activations": int(sum(act) * tokens),
        # autograd's per-parameter grads + the torch.cat pack + its fp32 cast (direct D2H into the host grads)
        "phase backward: one layer's weight grads": max_layer * (2 * c + (4 if c < 4 else 0)),
        # final norm saves 8H, its output 4H, dL/dh kept in ctx 4H (+ its scaled copy in backward)
        "phase loss: head + loss": int(20 * H * tokens + head),
    }
    return gpu, act


def host_bytes(s: _Shape, micro_batch: int, seq_len: int, *, c: int, optimizer: str, offload: bool,
               process_gib: float, pinned_pow2: bool, gpu_groups: int = 0) -> dict[str, int]:
    """Host items in bytes (engine/host_store.py, transfer.py, residents.py)."""
    n, max_layer = s.n_params, max(layer.numel for layer in s.layers)
    groups = [4 * layer.numel for layer in s.layers] + [4 * s.resident_params]  # one master and one grad flat each
    stash = 4 * s.hidden * micro_batch * seq_len if offload else 0
    # page-locked at their exact size (engine/pinned.py; the offloaded inputs since session 13); through torch's
    # power-of-two caching host allocator before that
    rounded = ([stash] * len(s.layers) if offload else []) + groups * 2 + [4 * s.resident_params] + [max_layer * c] * 3
    rounded = rounded if pinned_pow2 else []
    pow2 = lambda b: 1 << (int(b) - 1).bit_length() if b > 0 else 0
    return {
        "masters": 4 * n,
        "grads": 4 * n,
        "optimizer states": OPTIMIZERS[optimizer][0] * (n - _device_numels(s, gpu_groups)[0]
                                                        - sum(_device_numels(s, gpu_groups)[1])),
        "grad slabs": 3 * max_layer * c,
        # the residents' grads go straight into their host grads; a staging buffer exists only in the old engine
        "resident grad staging": 4 * s.resident_params if pinned_pow2 else 0,
        "activation offload": stash * len(s.layers),
        "pinned pow2 rounding": sum(pow2(b) - b for b in rounded),
        "process": int(process_gib * GIB),
    }


def step_time(s: _Shape, micro_batch: int, seq_len: int, *, c: int, grad_accum: int, offload: bool, tflops: float,
              h2d: float, d2h: float, duplex: float, num_slots: int, opt_rate: float,
              overlap_optimizer: bool = False, gpu_groups: int = 0) -> dict[str, float]:
    """Seconds per optimizer step. Transfers overlap compute layer by layer (exposed = what exceeds it); with
    ``overlap_optimizer`` the host Adam runs beside the next step's first forward (engine/overlap.py), which it paces
    when it is the slower of the two. ``gpu_groups`` (engine/device_state.py): those groups neither upload weights
    nor step on the host (their GPU step, ~28 B/param at HBM speed, is not counted)."""
    on_gpu_resident, on_gpu_layers = _device_numels(s, gpu_groups)
    tok, H, rate = micro_batch * seq_len, s.hidden, tflops * 1e12
    both = min(h2d, d2h, duplex / 2) * 1e9  # per direction while both directions are busy
    fwd = [(2 * ly.active + _attn_flops(s, ly, seq_len)) * tok / rate for ly in s.layers]
    bwd = [3 * f for f in fwd]  # recompute (1x forward) + backward (2x forward)
    up = [4 * ly.numel / (h2d * 1e9) for ly in s.layers]  # fp32 masters stream and are cast on the GPU
    up = [0.0] * len(on_gpu_layers) + up[len(on_gpu_layers):]
    act = 4 * H * tok if offload else 0
    # Grads go D2H in fp32 straight into the pinned host grads. The 1st micro-batch of a step writes them; later ones
    # first upload them (H2D, fp32) and write back the sum made on the device (transfer.py [Note: gradient drain]).
    grads = [4 * ly.numel for ly in s.layers]
    grads_up = [[0] * len(s.layers), [0] * len(on_gpu_layers) + grads[len(on_gpu_layers):]]  # device groups sum there
    L, exposed, fill = len(s.layers), 0.0, 0.0
    for m in range(grad_accum):
        for i in range(L):  # forward: upload i+1 and offload input i while i computes
            exposed += max(0.0, max(up[i + 1] if i + 1 < L else 0, act / (d2h * 1e9)) - fwd[i])
        for i in reversed(range(L)):  # backward: upload i-1 (not for the layers still in slots), restore its input
            load = (4 * s.layers[i - 1].numel if len(on_gpu_layers) <= i - 1 < L - num_slots else 0)
            load += act if i > 0 else 0
            load += grads_up[min(m, 1)][i]
            exposed += max(0.0, max(load / both, grads[i] / both) - bwd[i])
        fill += up[0] + grads[0] / (d2h * 1e9)  # the first upload and the last drain are never hidden
    head = 6 * s.vocab * H * tok / rate
    compute = sum(fwd) + sum(bwd) + head
    r = s.resident_params
    optimizer_s = (s.n_params - on_gpu_resident - sum(on_gpu_layers)) / (opt_rate * 1e9)
    return {
        "GPU compute": grad_accum * compute,
        "  of which layers": grad_accum * (sum(fwd) + sum(bwd)),
        "  of which LM head + loss": grad_accum * head,
        "H2D busy": grad_accum * (sum(up) + sum(up[: max(L - num_slots, 0)]) + act * L / (h2d * 1e9))
        + (grad_accum - 1) * sum(grads) / (h2d * 1e9),
        "D2H busy": grad_accum * (sum(grads) + act * L) / (d2h * 1e9),
        "transfers exposed": exposed,
        "pipeline fill + last drain": fill,
        "residents up + drain (serial)": (0 if on_gpu_resident else r * 4 / (h2d * 1e9)) + r * 4 / (d2h * 1e9)
        + r * 12 / (HOST_COPY_GBPS * 1e9),
        **({"CPU optimizer (beyond the next forward)": max(0.0, optimizer_s - sum(fwd) - head / 3)}
           if overlap_optimizer else {"CPU optimizer (serial)": optimizer_s}),
    }


# ------------------------------------------------------------------------------------------------------------ plan
def plan(model: Any, *, seq_len: int, micro_batch: int = 1, precision: str = "bf16-mixed",
         host_ram_gib: float | None = None, gpu_mem_gib: float | None = None, optimizer: str = "adamw",
         loss: str = "chunked", cpu_cores: int | None = None, grad_accum: int = 1, offload_activations: bool = True,
         num_slots: int = 2, loss_chunk_size: int = 4096, achieved_tflops: float | None = None,
         pcie_h2d_gbps: float = PCIE_H2D_GBPS, pcie_d2h_gbps: float = PCIE_D2H_GBPS,
         pcie_duplex_gbps: float = PCIE_DUPLEX_GBPS, process_gib: float = PROCESS_GIB,
         gpu_reserve_gib: float = GPU_RESERVE_GIB, pinned_pow2_rounding: bool = False,
         attn_implementation: str | None = None, overlap_optimizer: bool = False,
         gpu_optimizer_groups: int = 0, compile_layers: bool = False) -> Plan:
    """Plan host RAM, GPU memory and throughput of ``Trainer(strategy="megatrain")`` for one model and batch shape.

    Args:
        model: HF config, dict for ``AutoConfig.for_model``, inline JSON, .json file, local dir or hub name.
        seq_len, micro_batch, grad_accum: tokens per micro-batch = ``micro_batch * seq_len``; per step x grad_accum.
        precision: "bf16-mixed" or "32-true".
        host_ram_gib / gpu_mem_gib: limits in GiB; default this machine's MemTotal (else 128) / its GPU (else 139).
        optimizer: "adamw", "adam", "sgd", "sgd_momentum". loss: "chunked" (CausalLMModule) or "naive" (HF).
        cpu_cores: cores for the host optimizer (default this machine's); its rate scales linearly from 16 cores.
        offload_activations: layer inputs go to pinned host memory (the engine's CUDA path) instead of staying.
        achieved_tflops: sustained rate on executed FLOPs (default 450 under bf16, 580 under bf16 with
            ``compile_layers``, 50 under 32-true).
        pinned_pow2_rounding: model the engine before engine/pinned.py (commit b0ea63e), which took every pinned
            buffer (masters, grads, slabs) from torch's caching host allocator, rounded up to a power of two, as the
            2026-11-29 core runs measured. The offloaded layer inputs were rounded until session 13.
        attn_implementation: "sdpa", "eager", ... as ``CausalLMModule(attn_implementation=...)``; default the
            config's (transformers picks sdpa where the model supports it).
        overlap_optimizer: as ``MegaTrainStrategy(overlap_optimizer=True)``: Adam (torch fused) runs beside the next
            step's forward and only the part that outlasts it counts.
        gpu_optimizer_groups: as ``MegaTrainStrategy(gpu_optimizer_groups=...)``: the residents and the first
            ``gpu_optimizer_groups - 1`` layers keep their optimizer state on the GPU (engine/device_state.py).
        compile_layers: as ``MegaTrainStrategy(compile_layers=True)``: the bf16 rate becomes
            :data:`COMPILED_TFLOPS`. Memory stays planned for eager layers (compiled ones save less).
    """
    if precision not in PRECISIONS or optimizer not in OPTIMIZERS or loss not in ("chunked", "naive"):
        raise ValueError(f"precision in {list(PRECISIONS)}, optimizer in {list(OPTIMIZERS)}, loss in "
                         f"['chunked', 'naive']; got {precision!r}, {optimizer!r}, {loss!r}")
    if seq_len < 1 or micro_batch < 1 or grad_accum < 1:
        raise ValueError(f"seq_len, micro_batch, grad_accum must be >= 1; got {seq_len}, {micro_batch}, {grad_accum}")
    s = describe(model, "" if not isinstance(model, (str, Path)) or str(model).lstrip().startswith("{") else str(model),
                 attn_implementation)
    if not 0 <= gpu_optimizer_groups <= 1 + len(s.layers):
        raise ValueError(f"gpu_optimizer_groups must be in [0, {1 + len(s.layers)}] (the residents and {len(s.layers)} "
                         f"layers); got {gpu_optimizer_groups}")
    if gpu_optimizer_groups and optimizer not in ("adamw", "adam"):
        raise ValueError(f"gpu_optimizer_groups steps Adam/AdamW on the GPU; got optimizer={optimizer!r}")
    c = PRECISIONS[precision]
    tflops = achieved_tflops or (FP32_TFLOPS if c >= 4 else COMPILED_TFLOPS if compile_layers else ACHIEVED_TFLOPS)
    cores = cpu_cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    host_limit = int((host_ram_gib or _mem_total_gib() or HOST_REF_GIB) * GIB)
    gpu_limit = int((gpu_mem_gib or _gpu_total_gib() or GPU_REF_GIB) * GIB)
    gkw = {"c": c, "offload": offload_activations, "loss": loss, "loss_chunk": loss_chunk_size, "num_slots": num_slots,
               "reserve_gib": gpu_reserve_gib, "gpu_groups": gpu_optimizer_groups}
    opt_rate = TORCH_ADAM_GPARAMS if overlap_optimizer and optimizer in ("adamw", "adam") else OPTIMIZERS[optimizer][1]
    tkw = {"c": c, "grad_accum": grad_accum, "offload": offload_activations, "tflops": tflops, "h2d": pcie_h2d_gbps,
               "d2h": pcie_d2h_gbps, "duplex": pcie_duplex_gbps, "num_slots": num_slots,
               "opt_rate": opt_rate * cores / CPU_REF_CORES, "overlap_optimizer": overlap_optimizer,
               "gpu_groups": gpu_optimizer_groups}
    gpu, act = gpu_bytes(s, micro_batch, seq_len, **gkw)
    hkw = {"c": c, "optimizer": optimizer, "offload": offload_activations, "process_gib": process_gib,
               "pinned_pow2": pinned_pow2_rounding, "gpu_groups": gpu_optimizer_groups}
    host = host_bytes(s, micro_batch, seq_len, **hkw)
    t = step_time(s, micro_batch, seq_len, **tkw)
    max_host = _largest(lambda b: sum(host_bytes(s, b, seq_len, **hkw).values()) <= host_limit)
    max_mb = _largest(lambda b: _gpu_peak(gpu_bytes(s, b, seq_len, **gkw)[0]) <= gpu_limit)
    exposed = lambda tb: tb["transfers exposed"] > 0.01 * tb["GPU compute"]
    min_hide = None
    if exposed(t):  # the smallest micro-batch whose transfers hide (None: none up to 2**16)
        last = _largest(lambda b: exposed(step_time(s, b, seq_len, **tkw)), 1 << 16)
        min_hide = last + 1 if last < 1 << 16 else None
    step = sum(v for k, v in t.items() if not k.startswith(("  ", "H2D", "D2H")))
    t["step total"] = step
    tokens = micro_batch * seq_len * grad_accum
    active = sum(ly.active for ly in s.layers) + s.resident_params
    model_flops = 6 * (active - s.embedding_params + (s.vocab * s.hidden if s.tied else 0))  # non-embedding + head
    attn = 3 * sum(_attn_flops(s, ly, seq_len) for ly in s.layers)  # fwd + bwd, no recompute
    p = Plan(
        model=s.name, precision=precision, optimizer=optimizer, loss=loss, seq_len=seq_len, micro_batch=micro_batch,
        grad_accum=grad_accum, offload_activations=offload_activations, n_params=s.n_params, n_layers=len(s.layers),
        layer_params=sum(ly.numel for ly in s.layers), max_layer_params=max(ly.numel for ly in s.layers),
        resident_params=s.resident_params, active_params=active, host=host, host_limit=host_limit, gpu=gpu,
        gpu_limit=gpu_limit, max_micro_batch=max_mb, max_micro_batch_host=max_host,
        activation_per_token={"saved": act[0], "transient": act[1]}, time=t,
        transfers_hidden=not exposed(t), min_micro_batch_to_hide=min_hide, tokens_per_step=tokens,
        tokens_per_s=tokens / step, model_tflops=model_flops * tokens / step / 1e12,
        mfu=model_flops * tokens / step / (PEAK_TFLOPS * 1e12),
        mfu_with_attention=(model_flops + attn) * tokens / step / (PEAK_TFLOPS * 1e12),
        assumptions={"achieved_tflops": tflops, "pcie_h2d_gbps": pcie_h2d_gbps, "pcie_d2h_gbps": pcie_d2h_gbps,
                         "pcie_duplex_gbps": pcie_duplex_gbps, "cpu_cores": cores, "num_slots": num_slots,
                         "loss_chunk_size": loss_chunk_size, "attn_implementation": s.attn,
                         "optimizer_overlaps_gpu": overlap_optimizer, "pinned_pow2_rounding": pinned_pow2_rounding,
                         "gpu_optimizer_groups": gpu_optimizer_groups, "compile_layers": compile_layers})
    p.warnings = _warnings(p, s)
    if overlap_optimizer and optimizer in ("adamw", "adam"):
        p.suggested_gpu_optimizer_groups = _groups_to_hide_optimizer(s, micro_batch, seq_len, gkw, tkw, gpu_limit)
    return p


def _groups_to_hide_optimizer(s: _Shape, micro_batch: int, seq_len: int, gkw: dict, tkw: dict,
                              gpu_limit: int) -> int | None:
    """The fewest ``gpu_optimizer_groups`` with which the overlapped host Adam no longer outlasts the next forward
    and the GPU still fits one micro-batch; None when none does."""
    for groups in range(len(s.layers) + 2):
        hidden = step_time(s, micro_batch, seq_len, **{**tkw, "gpu_groups": groups})[
            "CPU optimizer (beyond the next forward)"] <= 0.0
        fits = _gpu_peak(gpu_bytes(s, micro_batch, seq_len, **{**gkw, "gpu_groups": groups})[0]) <= gpu_limit
        if not fits:
            return None
        if hidden:
            return groups
    return None


def _warnings(p: Plan, s: _Shape) -> list[str]:
    out, t = [], p.time
    if not p.transfers_hidden:
        need = f"micro-batch >= {p.min_micro_batch_to_hide}" if p.min_micro_batch_to_hide else "no micro-batch"
        out.append(f"too few tokens per micro-batch ({p.micro_batch * p.seq_len:,}) to hide PCIe: "
                   f"{t['transfers exposed'] * 1e3:.0f} ms of transfers exposed per step (uploading the largest "
                   f"layer takes {4 * p.max_layer_params / (p.assumptions['pcie_h2d_gbps'] * 1e6):.1f} ms); "
                   f"{need} hides them at seq {p.seq_len}")
    if p.host_total > p.host_limit:
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.host.items() if v >= 0.05 * p.host_total)
        out.append(f"host RAM too small: needs {p.host_total / GIB:.1f} GiB ({top} GiB; "
                   f"{p.host_bytes_per_param:.1f} B/param) but the limit is {p.host_limit / GIB:.1f} GiB")
    if p.gpu_total > p.gpu_limit:
        fix = (f"largest micro-batch that fits: {p.max_micro_batch}" if p.max_micro_batch else
               "not even micro-batch 1 fits: shorten the sequence, use loss='chunked' or a larger GPU")
        out.append(f"GPU memory too small: micro-batch {p.micro_batch} x {p.seq_len} needs "
                   f"{p.gpu_total / GIB:.1f} GiB but the limit is {p.gpu_limit / GIB:.1f} GiB; {fix}")
    if t.get("CPU optimizer (serial)", 0.0) > 0.25 * t["step total"]:
        out.append(f"the CPU optimizer ({t['CPU optimizer (serial)']:.2f} s on {p.assumptions['cpu_cores']} cores) "
                   f"is {t['CPU optimizer (serial)'] / t['step total']:.0%} of the step: it does not overlap the GPU "
                   "(overlap_optimizer=True lets the next forward hide it); or raise tokens per step to amortise it")
    if p.loss == "naive" and p.gpu["phase loss: head + loss"] > 0.25 * p.gpu_limit:
        out.append(f"HF's loss materialises [B, T, V] logits ({p.gpu['phase loss: head + loss'] / GIB:.1f} GiB): "
                   "use CausalLMModule's chunked loss")
    if s.attn == "eager":
        out.append("eager attention keeps [heads, T, T] probabilities per layer: activations grow with seq_len^2")
    if any(ly.linear for ly in s.layers):
        out.append(f"{sum(ly.linear for ly in s.layers)} linear-attention (Gated DeltaNet) layers are modelled as "
                   "transformers' PyTorch fallback of the chunked delta rule (used when flash-linear-attention is not "
                   "installed): fla's kernels save fewer activations; the time assumes fused kernels throughout")
    return out


def _largest(ok, hi: int = 1 << 24) -> int:
    """Largest b in [1, hi] with ok(b) for a monotone (True, then False) predicate; 0 if none. Doubling, then
    bisection: O(log b) evaluations."""
    lo, top = 0, 1
    while top <= hi and ok(top):
        lo, top = top, top * 2
    top = min(top, hi + 1)
    while top - lo > 1:
        mid = (lo + top) // 2
        lo, top = (mid, top) if ok(mid) else (lo, mid)
    return lo


def _mem_total_gib() -> float | None:
    total = meminfo_bytes("MemTotal")
    return None if total is None else total / GIB


def _gpu_total_gib() -> float | None:
    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


# ------------------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``megatrain plan --model NAME_OR_DIR_OR_JSON --seq-len L [--micro-batch B] ... [--json]``; returns 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog="megatrain plan", description="Host RAM, GPU memory and throughput of "
                                 "Trainer(strategy='megatrain') for a model (no weights are loaded).")
    ap.add_argument("--model", required=True, help="local dir with config.json, a .json file, inline JSON "
                    "('{\"model_type\": \"llama\", ...}') or a hub name")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--precision", choices=list(PRECISIONS), default="bf16-mixed")
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    ap.add_argument("--loss", choices=["chunked", "naive"], default="chunked")
    ap.add_argument("--attn-implementation", help="as model.attn_implementation, e.g. eager (default: the config's)")
    ap.add_argument("--host-ram", type=float, help="GiB (default: this machine's)")
    ap.add_argument("--gpu-mem", type=float, help="GiB (default: this machine's GPU, else 139 as on an H200)")
    ap.add_argument("--cpu-cores", type=int)
    ap.add_argument("--tflops", type=float,
                    help="achieved TFLOP/s on executed FLOPs (default 450 bf16, 580 with --compile-layers)")
    ap.add_argument("--no-offload", action="store_true", help="keep every layer's input on the GPU")
    ap.add_argument("--num-slots", type=int, default=2)
    ap.add_argument("--overlap-optimizer", action="store_true",
                    help="as MegaTrainStrategy(overlap_optimizer=True): Adam runs beside the next forward")
    ap.add_argument("--gpu-optimizer-groups", type=int, default=0,
                    help="as MegaTrainStrategy(gpu_optimizer_groups=N): the residents and N-1 layers step on the GPU")
    ap.add_argument("--compile-layers", action="store_true",
                    help="as MegaTrainStrategy(compile_layers=True): decoder layers through torch.compile")
    ap.add_argument("--loss-chunk-size", type=int, default=4096)
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    p = plan(a.model, seq_len=a.seq_len, micro_batch=a.micro_batch, grad_accum=a.grad_accum, precision=a.precision,
             optimizer=a.optimizer, loss=a.loss, host_ram_gib=a.host_ram, gpu_mem_gib=a.gpu_mem,
             cpu_cores=a.cpu_cores, achieved_tflops=a.tflops, offload_activations=not a.no_offload,
             num_slots=a.num_slots, loss_chunk_size=a.loss_chunk_size, attn_implementation=a.attn_implementation,
             overlap_optimizer=a.overlap_optimizer, gpu_optimizer_groups=a.gpu_optimizer_groups,
             compile_layers=a.compile_layers)
    print(json.dumps(p.to_dict(), indent=2) if a.json else p.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
