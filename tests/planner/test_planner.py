"""lightning_megatrain.planner: parameter counts, memory formulas, search, warnings and the CLI (CPU, no downloads)."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_megatrain import _hardware, planner
from lightning_megatrain.cli import main, plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.discovery import find_layer_stack, tensor_slots
from lightning_megatrain.planner import Machine

from helpers.shapes import LLAMA_3B

_COMMON = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "use_cache": False}
CONFIGS = {
    "llama_tied": dict(model_type="llama", intermediate_size=176, tie_word_embeddings=True, **_COMMON),
    "llama_untied": dict(model_type="llama", intermediate_size=176, tie_word_embeddings=False, **_COMMON),
    "qwen3": dict(model_type="qwen3", intermediate_size=176, tie_word_embeddings=True, **_COMMON),
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    output_router_logits=False, **_COMMON),
    "gemma2": dict(model_type="gemma2", intermediate_size=176, sliding_window=8, **_COMMON),
    # attention sinks, sliding and full layers, biased experts with a clamped SwiGLU, a router that is no nn.Linear
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, output_router_logits=False, **_COMMON),
}
BIG = Machine(host_ram_gib=1024, gpu_mem_gib=139, cpu_cores=16)
# The engine without its "auto" choices (eager layers, serial host step, no device groups): what these numbers pin.
SERIAL = EngineConfig(overlap_optimizer=False, compile_layers=False, gpu_optimizer_groups=0)


def _plan(*args, **kwargs) -> planner.Plan:
    kwargs.setdefault("config", SERIAL)
    return planner.plan(*args, **kwargs)
# Qwen3.5 hybrid stack: Gated DeltaNet (linear attention) layers and gated full-attention layers. Value head dim !=
# key head dim != hidden, so that every term of the formula has its own size.
HYBRID = dict(model_type="qwen3_5_text", intermediate_size=176, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=24, tie_word_embeddings=False,
              layer_types=["linear_attention", "full_attention", "linear_attention"], **_COMMON)
needs_qwen3_5 = pytest.mark.skipif(not hasattr(transformers, "Qwen3_5TextConfig"),
                                   reason="this transformers has no Qwen3.5 (qwen3_5_text)")


def _config(d: dict, **overrides):
    kw = {**d, **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _unique(params) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_match_the_real_model(name):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(CONFIGS[name]))
    _, stack = find_layer_stack(model)
    residents = [s.get() for s in tensor_slots(model, skip=stack) if s.is_param]
    p = _plan(CONFIGS[name], seq_len=32, micro_batch=2, machine=BIG)
    assert p.n_params == _unique(model.parameters())
    assert p.layer_params == _unique(stack.parameters())
    assert p.max_layer_params == max(_unique(layer.parameters()) for layer in stack)
    assert p.resident_params == _unique(residents)
    assert p.n_layers == 3


def test_tied_embeddings_counted_once():
    tied = _plan(CONFIGS["llama_tied"], seq_len=16, machine=BIG)
    untied = _plan(CONFIGS["llama_untied"], seq_len=16, machine=BIG)
    assert untied.n_params - tied.n_params == 128 * 64


def test_moe_active_params():
    p = _plan(CONFIGS["mixtral"], seq_len=16, machine=BIG)
    experts = 4 * 3 * 64 * 48  # per layer: 4 experts x (gate, up, down) x H x I
    assert p.n_params - p.active_params == 3 * experts // 2  # top-2 of 4 experts


@pytest.mark.parametrize("optimizer, per_param", [("adamw", 16), ("sgd", 8), ("sgd_momentum", 12)])
def test_host_state_bytes_per_param(optimizer, per_param):
    p = _plan(CONFIGS["llama_untied"], seq_len=16, optimizer=optimizer, machine=BIG)
    assert p.host_state_bytes_per_param == per_param
    assert p.host_bytes_per_param > per_param  # slabs, staging, offload, process come on top


def test_gpu_independent_of_depth_host_linear():
    plans = {n: _plan(LLAMA_3B | {"num_hidden_layers": n}, seq_len=4096, micro_batch=4, machine=BIG)
             for n in (4, 8, 16)}
    assert plans[4].gpu == plans[8].gpu == plans[16].gpu
    assert plans[4].max_micro_batch == plans[16].max_micro_batch
    layer = plans[4].max_layer_params
    for key, per_layer in (("masters", 4 * layer), ("grads", 4 * layer), ("optimizer states", 8 * layer),
                           ("activation offload", 4 * 3072 * 4 * 4096)):
        assert plans[8].host[key] - plans[4].host[key] == 4 * per_layer
        assert plans[16].host[key] - plans[8].host[key] == 8 * per_layer
    # without offload every layer's input stays on the GPU
    no = {n: _plan(LLAMA_3B | {"num_hidden_layers": n}, seq_len=4096, micro_batch=4, offload_activations=False,
                          machine=BIG) for n in (4, 8)}
    assert no[8].gpu_total - no[4].gpu_total == 4 * 4 * 4096 * 3072 * 4
    assert no[4].host["activation offload"] == 0


def _saved_bytes_of_one_layer(config, batch: int, seq: int, bf16: bool = True) -> int:
    """Bytes autograd saves inside decoder layer 0 (bf16 weights as in a slot, fp32 stream, CPU autocast; or fp32
    throughout), excluding the layer's inputs and the weights: the recompute's activations. Counted once the forward
    is done, over the saved tensors the graph still holds: a branch whose result nothing uses frees what it saved
    (and a later tensor may then reuse its address)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    layer = model.model.layers[0]
    if bf16:
        for p in layer.parameters():
            p.data = p.data.to(torch.bfloat16)
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed: list[weakref.ref] = []
    inside = [False]

    def pre(module, args, kwargs):
        for value in [*args, *kwargs.values()]:
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    exclude.add(t.untyped_storage().data_ptr())
        inside[0] = True

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in exclude:
            packed.append(weakref.ref(t))
        return t

    layer.register_forward_pre_hook(pre, with_kwargs=True)
    layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    ids = torch.randint(3, config.vocab_size, (batch, seq))
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=bf16)):
        out = model.model(input_ids=ids, use_cache=False)  # keeps the graph, and so its saved tensors, alive
    alive = [t for t in (ref() for ref in packed) if t is not None]
    saved = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
    del out
    return sum(saved.values())


@pytest.mark.parametrize("name, attn, tolerance", [
    ("llama_untied", "sdpa", 0.02), ("qwen3", "sdpa", 0.1), ("mixtral", "sdpa", 0.25), ("gemma2", "eager", 0.25),
    # gpt-oss: the formula is 7% low at this shape. Varying one width at a time here, gpt-oss saves per routed token
    # about 4 B more per unit of expert width than the Mixtral-derived MoE term (the clamped SwiGLU keeps more
    # intermediates) and about 1 B less per hidden unit, and 4 B less per expert (no fp32 router logits): about
    # 34 KB/token more at the 120B shape, 2% of the 1.84 MB that eager attention saves per token at 4,096 positions
    ("gpt_oss", "eager", 0.1)])
def test_activation_formula_matches_saved_tensors(name, attn, tolerance):
    batch, seq = 2, 32
    d = CONFIGS[name] | {"num_hidden_layers": 1, "attn_implementation": attn}
    if name == "gemma2":
        d |= {"layer_types": ["full_attention"], "attn_logit_softcapping": 50.0}
    config = _config(d)
    measured = _saved_bytes_of_one_layer(config, batch, seq) / (batch * seq)
    p = _plan(_config(d), seq_len=seq, micro_batch=batch, machine=BIG)
    assert p.activation_per_token["saved"] == pytest.approx(measured, rel=tolerance)


@needs_qwen3_5
@pytest.mark.parametrize("layer_type, precision, seq, tolerance", [
    ("linear_attention", "bf16-mixed", 128, 0.005),
    ("linear_attention", "bf16-mixed", 100, 0.005),  # padded to 2 chunks of 64
    ("linear_attention", "32-true", 128, 0.05),
    ("full_attention", "bf16-mixed", 128, 0.1),  # output gate; q/k norms compute in fp32 (not modelled)
])
def test_hybrid_activation_formula_matches_saved_tensors(layer_type, precision, seq, tolerance):
    d = HYBRID | {"num_hidden_layers": 1, "layer_types": [layer_type], "attn_implementation": "sdpa"}
    batch = 2
    measured = _saved_bytes_of_one_layer(_config(d), batch, seq, bf16=precision == "bf16-mixed") / (batch * seq)
    p = _plan(_config(d), seq_len=seq, micro_batch=batch, precision=precision, machine=BIG)
    assert p.activation_per_token["saved"] == pytest.approx(measured, rel=tolerance)


@needs_qwen3_5
def test_hybrid_stack_layers_counts_and_flops():
    model = AutoModelForCausalLM.from_config(_config(HYBRID))
    _, stack = find_layer_stack(model)
    s = planner.describe(_config(HYBRID))
    assert s.n_params == _unique(model.parameters())
    assert [ly.numel for ly in s.layers] == [_unique(layer.parameters()) for layer in stack]
    assert [ly.linear for ly in s.layers] == [True, False, True]
    assert [ly.out_gate for ly in s.layers] == [False, True, False]  # q_proj is 2 x heads x head_dim wide
    assert (s.linear_attn.k_heads, s.linear_attn.v_heads, s.linear_attn.k_dim, s.linear_attn.v_dim) == (2, 4, 16, 24)
    # linear attention costs the same per token at any length, full causal attention grows with it
    linear, full = s.layers[0], s.layers[1]
    assert planner._attn_flops(s, linear, 512) == planner._attn_flops(s, linear, 8192) > 0
    assert planner._attn_flops(s, full, 8192) == 16 * planner._attn_flops(s, full, 512)
    # the larger of the two layer kinds sets the GPU activation phase
    p = _plan(_config(HYBRID), seq_len=256, micro_batch=2, machine=BIG)
    per_kind = [sum(planner.layer_activation(s, ly, 256, 2)) for ly in (linear, full)]
    assert sum(p.activation_per_token.values()) == max(per_kind) == per_kind[0]
    assert any("linear-attention (Gated DeltaNet)" in w for w in p.warnings)
    assert not any("Gated DeltaNet" in w
                   for w in _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG).warnings)


def test_attn_implementation_override():
    d = CONFIGS["qwen3"]
    config = _config(d)
    eager = _plan(config, seq_len=256, micro_batch=2, attn_implementation="eager", machine=BIG)
    sdpa = _plan(config, seq_len=256, micro_batch=2, machine=BIG)
    assert eager.assumptions["attn_implementation"] == "eager" and sdpa.assumptions["attn_implementation"] == "sdpa"
    # eager keeps fp32 scores and bf16 probabilities over all T keys (heads * T * 6 bytes per token) and 4 bf16
    # [A]-wide tensors, sdpa q, k, v, output and a fp32 logsumexp (A = 4 x 16, K = 2 x 16)
    A, K, heads, T = 64, 32, 4, 256
    assert (eager.activation_per_token["saved"] - sdpa.activation_per_token["saved"]
            == 4 * 2 * A + heads * T * 6 - (2 * (2 * A + 2 * K) + 4 * heads))
    assert config._attn_implementation == "sdpa"  # the caller's config is not changed


def test_llama_3b_shape_counts_and_calibration():
    p = _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG)
    assert p.n_params == 3_212_749_824  # Llama-3.2-3B: 3.21B
    assert p.max_layer_params == 100_669_440
    # BENCHMARKS.md (2026-11-29), 32K tokens: 28 x (43.3 ms fwd+bwd + 14.3 ms recompute) + 150 ms head = 1763 ms,
    # i.e. 515 TFLOP/s on the executed FLOPs the planner counts (8N + causal attention + 6VH)
    at_515 = _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG.replace(achieved_tflops=515))
    assert at_515.time["GPU compute"] == pytest.approx(1.763, rel=0.02)
    assert p.time["GPU compute"] == pytest.approx(at_515.time["GPU compute"] * 515 / 450)
    # saved activations of one layer: 4.2 GiB measured at 32K tokens (no recompute) vs 4.57 GiB from the formula
    assert p.activation_per_token["saved"] * 32768 / 2**30 == pytest.approx(4.2, rel=0.15)
    assert p.transfers_hidden and [w for w in p.warnings if "CPU optimizer" not in w] == []
    assert not _plan(LLAMA_3B, seq_len=4096, micro_batch=8, grad_accum=4, machine=BIG).warnings
    assert p.gpu_total < 139 * 2**30 and p.max_micro_batch >= 8


def test_max_micro_batch_search_is_monotone_and_respects_the_limit():
    previous = 0
    for gib in (4, 8, 16, 32, 64, 128):
        p = _plan(LLAMA_3B, seq_len=4096, micro_batch=1, machine=Machine(host_ram_gib=1024, gpu_mem_gib=gib))
        assert p.max_micro_batch >= previous
        previous = p.max_micro_batch
        if p.max_micro_batch:
            at = _plan(LLAMA_3B, seq_len=4096, micro_batch=p.max_micro_batch,
                              machine=Machine(host_ram_gib=1024, gpu_mem_gib=gib))
            assert at.gpu_total <= gib * 2**30
            over = _plan(LLAMA_3B, seq_len=4096, micro_batch=p.max_micro_batch + 1,
                                machine=Machine(host_ram_gib=1024, gpu_mem_gib=gib))
            assert over.gpu_total > gib * 2**30
    assert previous > 0
    host = _plan(LLAMA_3B, seq_len=4096, micro_batch=1, machine=Machine(host_ram_gib=64, gpu_mem_gib=139))
    assert 0 < host.max_micro_batch_host < host.max_micro_batch  # offloaded inputs grow host RAM with the batch
    at = _plan(LLAMA_3B, seq_len=4096, micro_batch=host.max_micro_batch_host,
                      machine=Machine(host_ram_gib=64, gpu_mem_gib=139))
    assert at.host_total <= 64 * 2**30 and not any("host RAM" in w for w in at.warnings)


def test_warnings():
    assert not _plan(LLAMA_3B, seq_len=4096, micro_batch=8, grad_accum=4, machine=BIG).warnings
    few = _plan(LLAMA_3B, seq_len=512, micro_batch=1, machine=BIG)
    assert not few.transfers_hidden and few.min_micro_batch_to_hide > 1
    assert any("too few tokens" in w for w in few.warnings)
    host = _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG.replace(host_ram_gib=32))
    [w] = [w for w in host.warnings if "host RAM too small" in w]
    assert "32.0 GiB" in w and f"{host.host_total / 2**30:.1f} GiB" in w
    gpu = _plan(LLAMA_3B, seq_len=4096, micro_batch=64, machine=BIG.replace(gpu_mem_gib=24))
    assert any("GPU memory too small" in w and f"largest micro-batch that fits: {gpu.max_micro_batch}" in w
               for w in gpu.warnings)
    naive = _plan(LLAMA_3B, seq_len=4096, micro_batch=8, loss="naive", machine=BIG)
    assert naive.gpu_total > _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG).gpu_total + 40 * 2**30
    slow = _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG.replace(cpu_cores=2))
    assert any("CPU optimizer" in w for w in slow.warnings)


def test_32_true_streams_fp32():
    p = _plan(CONFIGS["llama_untied"], seq_len=16, precision="32-true", machine=BIG)
    assert p.gpu["slots (2 x largest layer)"] == 2 * p.max_layer_params * 4
    assert p.host["grad slabs"] == 3 * p.max_layer_params * 4


def test_main_report_and_json(tmp_path, capsys):
    _config(CONFIGS["llama_tied"]).save_pretrained(tmp_path)
    args = ["--model", str(tmp_path), "--seq-len", "64", "--micro-batch", "2", "--host-ram", "64", "--gpu-mem", "80"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "Host RAM" in out and "GPU memory" in out and "tokens/s" in out
    assert main(["plan", *args, "--json", "--optimizer", "sgd"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_params"] == _plan(CONFIGS["llama_tied"], seq_len=64, machine=BIG).n_params
    assert d["host_state_bytes_per_param"] == 8 and d["gpu_limit"] == 80 * 2**30
    inline = json.dumps(CONFIGS["qwen3"])
    assert plan_main(["--model", inline, "--seq-len", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_layers"] == 3


def test_formula_matches_h200_measurement_of_the_3b_layer():
    # benchmarks/planner_gpu_check.py on the H200 (2026-11-29, torch 2.11): one Llama-3.2-3B layer, bf16 weights,
    # fp32 input, autocast: saved 149,608 B/token; backward peak 194,664 B/token + the incoming grad (4H) before it.
    p = _plan(LLAMA_3B, seq_len=4096, micro_batch=8, machine=BIG)
    assert p.activation_per_token["saved"] == 149_608
    assert sum(p.activation_per_token.values()) == 194_664 + 4 * 3072


def test_pinned_rounding():
    # torch's caching host allocator gives a 402,653,184-byte pinned request a 536,870,912-byte block (measured on
    # the H200): before engine/pinned.py a 3B layer's fp32 master and grad flats paid 1/3 more each, and until
    # session 13 every offloaded layer input did. Now every pinned buffer has its exact size.
    shape = LLAMA_3B | {"num_hidden_layers": 2}
    old = _plan(shape, seq_len=4096, micro_batch=8, machine=BIG.replace(pinned_pow2_rounding=True))
    new = _plan(shape, seq_len=4096, micro_batch=8, machine=BIG)
    stash = 4 * 3072 * 8 * 4096  # 384 MiB per layer input -> a 512 MiB block
    assert new.host["pinned pow2 rounding"] == 0 and new.host["activation offload"] == 2 * stash
    per_layer = 2**29 - 4 * old.max_layer_params
    assert old.host["pinned pow2 rounding"] >= 2 * (2**29 - stash) + 4 * per_layer  # the inputs, masters + grads
    no_offload = _plan(shape, seq_len=4096, micro_batch=8, offload_activations=False, machine=BIG)
    assert no_offload.host["pinned pow2 rounding"] == 0


def test_gpu_optimizer_groups_move_state_and_adam_to_the_gpu():
    kw = dict(seq_len=1024, micro_batch=32, loss="naive", machine=BIG)
    # no host updates during backward: the host step left is linear in the host's parameters (test_updates_during_
    # backward_*: with them)
    groups = lambda n: SERIAL.replace(overlap_optimizer=True, gpu_optimizer_groups=n, update_during_backward=False)
    base = _plan(LLAMA_3B, config=groups(0), **kw)
    p = _plan(LLAMA_3B, config=groups(6), **kw)  # residents (394M) + 5 layers (100.7M each)
    on_gpu = p.resident_params + 5 * 100_669_440
    assert base.host["optimizer states"] - p.host["optimizer states"] == 8 * on_gpu
    assert p.gpu["optimizer groups on the GPU"] == 8 * p.resident_params + 18 * 5 * 100_669_440
    hidden = lambda plan: plan.time["CPU optimizer (beyond the next forward)"]
    assert hidden(base) - hidden(p) == pytest.approx(on_gpu / (planner.TORCH_ADAM_GPARAMS * 1e9), rel=1e-6)
    assert p.time["transfers exposed"] <= base.time["transfers exposed"]  # 5 layers fewer to upload
    # the suggestion is the first count that hides the host Adam
    g = base.suggested_gpu_optimizer_groups
    assert g is not None and hidden(_plan(LLAMA_3B, config=groups(g), **kw)) == 0.0
    assert hidden(_plan(LLAMA_3B, config=groups(g - 1), **kw)) > 0.0
    with pytest.raises(ValueError, match=r"gpu_optimizer_groups must be in \[0, 29\]"):
        _plan(LLAMA_3B, config=groups(30), **kw)
    with pytest.raises(ValueError, match="steps Adam/AdamW on the GPU"):
        _plan(LLAMA_3B, config=SERIAL.replace(gpu_optimizer_groups=1), optimizer="sgd", seq_len=1024)


def test_compile_layers_plans_the_compiled_rate():
    kw = dict(seq_len=1024, micro_batch=32, loss="naive")
    compile_layers = SERIAL.replace(compile_layers=True)
    eager = _plan(LLAMA_3B, machine=BIG, **kw)
    compiled = _plan(LLAMA_3B, config=compile_layers, machine=BIG, **kw)
    assert compiled.assumptions["achieved_tflops"] == planner.COMPILED_TFLOPS > planner.ACHIEVED_TFLOPS
    ratio = planner.ACHIEVED_TFLOPS / planner.COMPILED_TFLOPS
    assert compiled.time["GPU compute"] == pytest.approx(eager.time["GPU compute"] * ratio, rel=1e-9)
    assert compiled.gpu == eager.gpu and compiled.host == eager.host  # memory stays planned for eager layers
    # an explicit rate and 32-true are left alone
    assert _plan(LLAMA_3B, config=compile_layers, machine=BIG.replace(achieved_tflops=300),
                        **kw).assumptions["achieved_tflops"] == 300
    fp32 = _plan(LLAMA_3B, config=compile_layers, precision="32-true", machine=BIG, **kw)
    assert fp32.assumptions["achieved_tflops"] == planner.FP32_TFLOPS
    # a faster forward hides less of the host Adam: more groups step on the GPU (15 -> 18 for this shape; 18 was the
    # fastest of 12, 15, 18 and 21 measured with compiled layers on the H200, without host updates during backward)
    suggested = lambda during: [_plan(LLAMA_3B, machine=BIG, **kw, config=SERIAL.replace(
        overlap_optimizer=True, compile_layers=c, update_during_backward=during)).suggested_gpu_optimizer_groups
        for c in (False, True)]
    assert suggested(False) == [15, 18]
    assert suggested("auto") == [15, 18]  # counted without them (search.py): they may not run every step


def test_machine_collects_every_problem_and_reads_this_machine_for_none():
    with pytest.raises(ValueError, match=r"Invalid Machine arguments:\n- host_ram_gib=0: .*\n- cpu_cores=2.5: .*\n"
                       r"- pcie_h2d_gbps=-1: .*\n- process_gib=-1: .*\n- pinned_pow2_rounding='yes': "):
        Machine(host_ram_gib=0, cpu_cores=2.5, pcie_h2d_gbps=-1, process_gib=-1, pinned_pow2_rounding="yes")
    with pytest.raises(ValueError, match="achieved_tflops=0: need a number > 0"):
        BIG.replace(achieved_tflops=0)
    assert BIG.replace(cpu_cores=2).cpu_cores == 2 and BIG.cpu_cores == 16  # frozen: replace() copies
    p = _plan(CONFIGS["llama_tied"], seq_len=16)  # EngineConfig() and Machine(): this machine's sizes
    assert p.assumptions["cpu_cores"] == _hardware.cpu_cores() and p.assumptions["num_slots"] == 2
    assert p.host_limit == int(_hardware.host_ram_gib() * 2**30)
    assert p.gpu_limit == int((_hardware.gpu_mem_gib() or planner.GPU_REF_GIB) * 2**30)
