"""install_chunked_hf_loss: HF's own loss and gradients without [B, T, V] logits; fallbacks; removal; Lightning.

Tolerances (fp32 on the CPU; both sides run HF's backbone on the same inputs, only the loss differs): the loss to
``rtol=1e-6`` (seen: <= 2e-7, one or two ulps), every parameter's gradient to ``rtol=1e-5`` with ``atol`` 1e-5 of that
gradient's largest entry (seen: <= 1.1e-6 of it; the softmax - one-hot cancellation is in fp32 on both sides), as in
test_models_causal_lm.py. Under bf16 autocast the loss to ``rtol=1e-4`` and each gradient to 2e-2 norm-wise (HF
soft-caps bf16 logits, the chunked loss fp32 ones). Fallbacks run HF's own forward, so they are compared bitwise.
Tests taking ``as_on_a_gpu`` (tests/models/conftest.py) run the loss's GPU layout on the CPU (all positions, masked: see
[Note: target rows] in models/loss.py) under a guard that fails on any op that would sync a GPU; the tolerances above
hold for it too.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BambaForCausalLM,
    BartForCausalLM,
    CohereForCausalLM,
    Gemma2ForCausalLM,
    GPTJForCausalLM,
    GraniteForCausalLM,
    LlamaForCausalLM,
    MiniCPM3ForCausalLM,
    MixtralForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.models import install_chunked_hf_loss
from lightning_megatrain.models.hf_forms import HeadForm, RouterAux, head_form

from helpers.dispatch import LargestTensor

VOCAB = 128
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# name -> (model_type, config overrides, attn_implementation); no dropout, so two forwards compute the same
ARCHS = {
    "llama_tied": ("llama", {"tie_word_embeddings": True}, "sdpa"),  # tied embeddings: one weight, two uses
    "qwen3": ("qwen3", {}, "sdpa"),
    # a small cap and a large init so that the final-logit soft-cap bends the logits (checked below)
    "gemma2": ("gemma2", {"final_logit_softcapping": 2.0, "initializer_range": 0.2}, "eager"),
    "gemma3_text": (
        "gemma3_text",
        {"final_logit_softcapping": 2.0, "initializer_range": 0.2, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"]},
        "sdpa",
    ),
    # MoE: the forward holds the router auxiliary loss, off here (output_router_logits=False; on in
    # test_router_aux_loss_matches_hf)
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}, "sdpa"),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, "sdpa"),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}, "eager"),
    "phi3": ("phi3", {"resid_pdrop": 0.0, "embd_pdrop": 0.0}, "sdpa"),
}
SOFTCAPPED = ("gemma2", "gemma3_text")
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5


def build(arch: str = "llama_tied", seed: int = 0) -> nn.Module:
    model_type, overrides, attn = ARCHS[arch]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)


def padded_batch(batch: int = 3, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left padding in row 0, right padding in row 1 (labels -100 there), and a fifth of the other labels -100."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, seq), generator=gen)  # [B, T]
    attention_mask = torch.ones(batch, seq, dtype=torch.long)  # [B, T]
    attention_mask[0, :4] = 0
    attention_mask[1, -5:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # [B, T]
    labels[torch.rand(batch, seq, generator=gen) < 0.2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model: nn.Module, *args, **kwargs) -> tuple[CausalLMOutputWithPast, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(out, grads, ref, ref_grads) -> None:
    torch.testing.assert_close(out.loss, ref.loss, rtol=LOSS_RTOL, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=GRAD_RTOL, atol=GRAD_RTOL * scale, msg=name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_loss_and_grads_match_hf(arch):
    model = build(arch)
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(model, **batch, output_hidden_states=True)

    handle = install_chunked_hf_loss(model, chunk_size=5)  # several chunks
    out, grads = loss_and_grads(model, **batch, output_hidden_states=True)

    assert handle.models == {"": type(model).__name__} and not handle.skipped
    assert type(out) is type(ref) and out.logits is None and ref.logits.shape == (3, 16, VOCAB)
    assert_same_loss_and_grads(out, grads, ref, ref_grads)
    for hidden, ref_hidden in zip(out.hidden_states, ref.hidden_states, strict=True):  # HF's outputs pass through
        torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=0)
    if arch == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied case: one weight, both grads in it
    if arch in SOFTCAPPED:  # the cap matters: a chunked loss that dropped it would fail the comparison above
        handle.remove()
        cap, model.config.final_logit_softcapping = model.config.final_logit_softcapping, None
        uncapped = model(**batch).loss
        model.config.final_logit_softcapping = cap
        assert abs(uncapped.item() - ref.loss.item()) > 1e-2


def test_never_materialises_or_saves_full_logits():
    # V = 4096 dominates: B*T*V = 128 * 4096 logits, 4x the [V, H] head weight and 16x a [chunk, V] chunk
    model_type, overrides, attn = ARCHS["llama_tied"]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **overrides, "vocab_size": 4096})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    batch, seq, chunk, vocab, hidden = 4, 32, 8, 4096, _COMMON["hidden_size"]
    input_ids = torch.randint(3, vocab, (batch, seq))  # [B, T]

    def largest(**kwargs) -> tuple[int, int]:
        saved = [0]

        def pack(t):
            saved[0] = max(saved[0], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LargestTensor() as mode:
            model(input_ids=input_ids, labels=input_ids, **kwargs).loss.backward()
        return mode.max_numel, saved[0]

    hf_made, hf_saved = largest()
    install_chunked_hf_loss(model, chunk_size=chunk)
    made, saved = largest()
    assert hf_made >= batch * seq * vocab and hf_saved >= batch * seq * vocab  # HF's path: the test sees the logits
    assert made <= max(chunk * vocab, vocab * hidden) < batch * seq * vocab
    assert saved <= vocab * hidden  # the chunked loss saves its two gradients: [B, T, H] and [V, H]


@pytest.mark.parametrize("arch", ["llama_tied", "gemma2"])
def test_bf16_autocast_is_close_and_evaluation_needs_no_grad(arch):
    # bf16 logits: both project in bf16; HF soft-caps the bf16 logits where the chunked loss caps in fp32, so Gemma's
    # grads differ by up to ~1% norm-wise (seen 0.86%; bf16 has 8 mantissa bits); the loss is fp32 on both sides
    model = build(arch)
    batch = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = loss_and_grads(model, **batch)
        handle = install_chunked_hf_loss(model)
        out, grads = loss_and_grads(model, **batch)
    assert out.logits is None and out.loss.dtype == ref.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=0)
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() <= 2e-2 * ref_grads[name].norm(), name

    with torch.no_grad():  # validation: no gradients computed, the same loss
        hf_loss = type(model).forward(model, **batch).loss  # the class's forward: HF's own
        torch.testing.assert_close(model(**batch).loss, hf_loss, rtol=LOSS_RTOL, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(model(**batch).loss, hf_loss, rtol=LOSS_RTOL, atol=0)
    handle.remove()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_router_aux_loss_matches_hf(arch):
    # output_router_logits=True: HF's forward adds router_aux_loss_coef times its load-balancing loss of the router
    # logits (over the unpadded positions: the attention mask) to the loss; the chunked loss adds HF's own aux_loss
    model = build(arch)
    model.router_aux_loss_coef = 0.5  # a large share, so that a dropped or doubled term fails the comparison
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(model, **batch, output_router_logits=True)
    plain = model(**batch).loss  # the config's output_router_logits=False: no router loss

    install_chunked_hf_loss(model, chunk_size=5)
    out, grads = loss_and_grads(model, **batch, output_router_logits=True)

    assert out.logits is None and torch.equal(out.aux_loss, ref.aux_loss)
    assert_same_loss_and_grads(out, grads, ref, ref_grads)
    torch.testing.assert_close(out.loss - plain, 0.5 * ref.aux_loss, rtol=1e-5, atol=0)
    assert ref.aux_loss > 0.5  # the Switch-style loss is E * sum(f_i * P_i), about top_k where routing is balanced
    with torch.no_grad():  # the config's flag decides when the call does not say
        model.config.output_router_logits = True
        torch.testing.assert_close(model(**batch).loss, ref.loss, rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("num_items", [23, torch.tensor(23), torch.tensor([23.0])])
def test_num_items_in_batch_divides_the_sum_as_hf(num_items):
    model = build("qwen3")
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(model, **batch, num_items_in_batch=num_items)
    install_chunked_hf_loss(model, chunk_size=7)
    out, grads = loss_and_grads(model, **batch, num_items_in_batch=num_items)
    assert out.logits is None and out.loss.shape == ref.loss.shape
    assert_same_loss_and_grads(out, grads, ref, ref_grads)


def test_custom_ignore_index_positional_inputs_and_embeddings():
    model = build("gemma2")
    batch = padded_batch()
    labels = batch["labels"].masked_fill(batch["labels"] == -100, 0)  # 0 marks "no target" with ignore_index=0
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach()  # [B, T, H]
    ref, ref_grads = loss_and_grads(model, batch["input_ids"], batch["attention_mask"], labels=labels, ignore_index=0)
    ref_e, ref_e_grads = loss_and_grads(model, inputs_embeds=embeds, labels=batch["labels"])

    install_chunked_hf_loss(model)
    out, grads = loss_and_grads(model, batch["input_ids"], batch["attention_mask"], labels=labels, ignore_index=0)
    out_e, e_grads = loss_and_grads(model, inputs_embeds=embeds, labels=batch["labels"])

    assert out.logits is None and out_e.logits is None
    assert_same_loss_and_grads(out, grads, ref, ref_grads)
    assert_same_loss_and_grads(out_e, e_grads, ref_e, ref_e_grads)


def _hooked_head(model):
    model.lm_head.register_forward_hook(lambda module, args, output: output * 2.0)


def _own_loss_function(model):
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()


def _new_backbone(model):
    model.model = copy.deepcopy(model.model)  # not the module hooked at install


# case -> (arch, extra call kwargs as a function of the batch, a change to the model after install)
FALLBACKS = {
    "logits_to_keep": ("llama_tied", lambda b: {"logits_to_keep": torch.arange(b["labels"].shape[1])}, None),
    "shift_labels": ("llama_tied", lambda b: {"shift_labels": b["labels"]}, None),
    "return_dict": ("llama_tied", lambda b: {"return_dict": False}, None),
    "num_items_vector": ("llama_tied", lambda b: {"num_items_in_batch": torch.tensor([20.0, 30.0])}, None),
    "hooked_head": ("llama_tied", lambda b: {}, _hooked_head),
    "own_loss_function": ("llama_tied", lambda b: {}, _own_loss_function),
    "new_backbone": ("llama_tied", lambda b: {}, _new_backbone),
}


# case -> the reason logged
REASONS = {
    "logits_to_keep": "logits_to_keep",
    "shift_labels": "shift_labels",
    "return_dict": "return_dict=False",
    "num_items_vector": "num_items_in_batch of several elements",
    "hooked_head": "lm_head that is not a bias-free nn.Linear without hooks",
    "own_loss_function": "loss_function other than HF's ForCausalLMLoss",
    "new_backbone": "backbone 'model' replaced since install",
}


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else out.to_tuple()


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallbacks_return_exactly_hf_output(case, caplog):
    arch, extra, change = FALLBACKS[case]
    model = build(arch)
    batch = padded_batch()
    kwargs = {**batch, **extra(batch)}
    handle = install_chunked_hf_loss(model)
    if change is not None:
        change(model)
    with caplog.at_level("INFO", logger="lightning_megatrain"):
        out = model(**kwargs)
        model(**kwargs)  # the reason is logged once per model
    handle.remove()
    ref = model(**kwargs)  # HF's own forward

    assert type(out) is type(ref)
    for got, want in zip(as_tuple(out), as_tuple(ref), strict=True):  # loss, logits, ...
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all())
    messages = [r.getMessage() for r in caplog.records if "HF's own forward computes the loss" in r.getMessage()]
    assert len(messages) == 1 and REASONS[case] in messages[0], messages


@pytest.mark.parametrize("on_gpu_path", [False, True])
def test_no_target_gives_hf_nan_and_zero_grads_without_a_fallback(on_gpu_path, request):
    # HF's mean over no target is 0 / 0: NaN, with zero gradients; the chunked loss returns the same without counting
    # the targets on the host (with num_items_in_batch HF's sum / num is 0, and so is this)
    model = build("gemma2")
    batch = {**padded_batch(), "labels": torch.full((3, 16), -100)}
    ref, ref_grads = loss_and_grads(model, **batch)
    ref_num, ref_num_grads = loss_and_grads(model, **batch, num_items_in_batch=torch.tensor(5))
    install_chunked_hf_loss(model, chunk_size=7)
    if on_gpu_path:
        request.getfixturevalue("as_on_a_gpu")
    out, grads = loss_and_grads(model, **batch)
    out_num, num_grads = loss_and_grads(model, **batch, num_items_in_batch=torch.tensor(5))

    assert out.logits is None and out_num.logits is None  # the chunked loss ran: no fallback
    assert ref.loss.isnan() and out.loss.isnan() and out.loss.dtype == ref.loss.dtype
    assert ref_num.loss == 0 and out_num.loss == 0
    for got, want in ((grads, ref_grads), (num_grads, ref_num_grads)):
        assert got.keys() == want.keys()
        assert all(torch.count_nonzero(g) == 0 and torch.equal(g, want[name]) for name, g in got.items())


@pytest.mark.parametrize("arch", ["llama_tied", "gemma2"])
@pytest.mark.parametrize("num_items", [None, 23, torch.tensor(23)])
def test_gpu_layout_matches_hf_and_the_wrapper_never_syncs(arch, num_items, as_on_a_gpu):
    # the guard is armed for the whole call and its backward except inside the backbone (HF's code: its masks may sync)
    model = build(arch)
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(model, **batch, num_items_in_batch=num_items)
    install_chunked_hf_loss(model, chunk_size=5)
    guard = as_on_a_gpu()
    model.model.register_forward_pre_hook(lambda module, args: setattr(guard, "armed", False))
    model.model.register_forward_hook(lambda module, args, output: setattr(guard, "armed", True))
    with guard:
        out, grads = loss_and_grads(model, **batch, num_items_in_batch=num_items)
    assert guard.armed and out.logits is None
    assert_same_loss_and_grads(out, grads, ref, ref_grads)


def test_the_sync_guard_sees_the_target_rows_of_the_cpu_layout(as_on_a_gpu, monkeypatch):
    # the harness above can fail: on the CPU layout the loss's nonzero runs after the backbone, where the guard is armed
    monkeypatch.undo()  # rows=None selects the target rows again
    model = build("llama_tied")
    batch = padded_batch()
    install_chunked_hf_loss(model)
    guard = as_on_a_gpu()
    model.model.register_forward_pre_hook(lambda module, args: setattr(guard, "armed", False))
    model.model.register_forward_hook(lambda module, args, output: setattr(guard, "armed", True))
    with pytest.raises(AssertionError, match=r"aten.nonzero.default would sync a GPU"), guard:
        model(**batch)


def _assert_compiled_matches(model, batch, ref, ref_grads):
    """``torch.compile`` of the wrapped model (dynamo and AOT autograd, no C++ compiler needed) gives HF's loss and
    gradients, without logits."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    out, _ = loss_and_grads(compiled, **batch)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert out.logits is None
    assert_same_loss_and_grads(out, grads, ref, ref_grads)
    torch._dynamo.reset()


def test_compiled_gpu_layout_is_one_graph_and_matches_hf(as_on_a_gpu):
    model = build("llama_tied")
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(model, **batch)
    install_chunked_hf_loss(model, chunk_size=5)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**batch)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    _assert_compiled_matches(model, batch, ref, ref_grads)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("num_items", [None, torch.tensor(23)])  # a host tensor: copied without a sync
def test_cuda_wrapper_never_syncs(num_items):
    # CUDA's own sync check (set_sync_debug_mode) raises on a synchronizing call anywhere but inside the backbone
    # (HF's code); the first call compiles the chunk math (_nll_and_grad_fused) and is not checked
    model = build("gemma2").cuda()
    batch = {name: t.cuda() for name, t in padded_batch().items()}
    ref = type(model).forward(model, **batch, num_items_in_batch=num_items).loss  # HF's own
    install_chunked_hf_loss(model, chunk_size=5)
    model(**batch, num_items_in_batch=num_items).loss.backward()
    model.model.register_forward_pre_hook(lambda module, args: torch.cuda.set_sync_debug_mode("default"))
    model.model.register_forward_hook(lambda module, args, output: torch.cuda.set_sync_debug_mode("error"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(**batch, num_items_in_batch=num_items)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref, rtol=1e-4, atol=0)


def test_logits_are_none_only_when_the_chunked_loss_applied():
    model = build("llama_tied")
    batch = padded_batch()
    install_chunked_hf_loss(model)
    assert model(**batch).logits is None  # applied
    assert model(input_ids=batch["input_ids"]).logits.shape == (3, 16, VOCAB)  # no labels: HF's forward
    assert model(**batch, shift_labels=batch["labels"]).logits.shape == (3, 16, VOCAB)  # a fallback


def test_generation_and_forward_without_labels_are_untouched():
    model = build("llama_tied").eval()
    prompt = padded_batch()["input_ids"][:, :5]  # [B, 5]
    signature = inspect.signature(model.forward)
    ref_tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    ref_logits = model(input_ids=prompt).logits

    install_chunked_hf_loss(model)
    assert inspect.signature(model.forward) == signature  # generate inspects it
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), ref_tokens)
    assert torch.equal(model(input_ids=prompt).logits, ref_logits)


def test_remove_restores_and_install_is_idempotent():
    model = build("gemma2")
    batch = padded_batch()
    ref = model(**batch)
    first = install_chunked_hf_loss(model)
    wrapper = model.forward
    second = install_chunked_hf_loss(model)  # wraps nothing twice

    assert second.models == {} and model.forward is wrapper and len(model.model._forward_hooks) == 1
    assert model(**batch).logits is None
    second.remove()  # removes nothing of the first
    assert model.forward is wrapper
    first.remove()
    first.remove()  # idempotent
    assert "forward" not in model.__dict__ and not model.model._forward_hooks
    out = model(**batch)
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.logits, ref.logits)
    assert install_chunked_hf_loss(model).models == {"": "Gemma2ForCausalLM"}  # installable again


def test_removed_wrapper_under_another_wrapper_passes_through():
    model = build("llama_tied")
    batch = padded_batch()
    handle = install_chunked_hf_loss(model)
    inner = model.forward
    model.forward = lambda *args, **kwargs: inner(*args, **kwargs)  # someone wrapped ours after install
    handle.remove()
    assert model(**batch).logits is not None  # ours is off, theirs stays


def test_enabled_false_changes_nothing():
    model = build("llama_tied")
    handle = install_chunked_hf_loss(model, enabled=False)
    assert handle.models == {} and handle.skipped == {} and "forward" not in model.__dict__
    assert model(**padded_batch()).logits is not None


def test_finds_models_inside_a_module_and_skips_what_it_cannot_reproduce(caplog):
    class Wrapping(LlamaForCausalLM):  # a user subclass whose forward wraps HF's: refused
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            config = build("llama_tied").config
            self.student = LlamaForCausalLM(config)
            self.other = Wrapping(config)
            self.replaced = LlamaForCausalLM(config)
            self.replaced.forward = self.replaced.forward  # a bound method on the instance (a hook library's)

    holder = Holder()
    with caplog.at_level("INFO", logger="lightning_megatrain"):
        handle = install_chunked_hf_loss(holder)
    assert handle.models == {"student": "LlamaForCausalLM"}
    assert handle.skipped.keys() == {"other", "replaced"}
    assert ("takes no labels or logits_to_keep" in handle.skipped["other"]
            and "already replaced" in handle.skipped["replaced"])
    assert sum("keeps HF's own loss" in r.getMessage() for r in caplog.records) == 2
    assert holder.other(**padded_batch()).logits is not None


class OlderLlama(LlamaForCausalLM):
    """Llama's forward as transformers 4.5x wrote its head: ``slice_indices`` and ``[:, slice_indices, :]``."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden_states = outputs.last_hidden_state
        # Only compute necessary logits, and do not upcast them to float if we are not computing the loss
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


class ScaledLlama(LlamaForCausalLM):
    """Scales its logits (as Cohere or Granite do): not a form the chunked loss reproduces."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        logits = logits * 0.5
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


MIXTRAL_AUX = RouterAux("load_balancing_loss_func", "num_experts", "num_experts_per_tok", "router_aux_loss_coef")


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (LlamaForCausalLM, HeadForm("model", False, False, True, None)),
        (Gemma2ForCausalLM, HeadForm("model", False, True, False, None)),
        (MixtralForCausalLM, HeadForm("model", False, False, False, MIXTRAL_AUX)),
        (GPTJForCausalLM, HeadForm("transformer", False, False, True, None)),
        (OlderLlama, HeadForm("model", False, False, True, None)),
        (ScaledLlama, "its logits or loss are not HF's plain causal-LM loss"),
        (CohereForCausalLM, "its logits or loss are not HF's plain causal-LM loss"),  # logit_scale
        (GraniteForCausalLM, "its logits or loss are not HF's plain causal-LM loss"),  # logits_scaling
        (MiniCPM3ForCausalLM, "it transforms the backbone's hidden states"),  # hidden / logits_scaling
        (BambaForCausalLM, "its logits or loss are not HF's plain causal-LM loss"),  # z-loss
        (BartForCausalLM, "its forward does not start with the backbone call"),  # self.model.decoder, no shift
    ],
)
def test_head_forms(cls, expected):
    form = head_form(cls)
    if isinstance(expected, str):
        assert isinstance(form, str) and form.startswith(expected), form
    else:
        assert form == expected


def test_older_form_matches_hf_and_a_scaled_head_keeps_hf_loss():
    config = build("llama_tied").config
    torch.manual_seed(0)
    older = OlderLlama(config)
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(older, **batch)
    handle = install_chunked_hf_loss(older)
    out, grads = loss_and_grads(older, **batch)
    assert handle.models == {"": "OlderLlama"} and out.logits is None
    assert_same_loss_and_grads(out, grads, ref, ref_grads)

    scaled = ScaledLlama(config)
    ref = scaled(**batch)
    handle = install_chunked_hf_loss(scaled)
    out = scaled(**batch)
    assert handle.models == {} and list(handle.skipped) == [""]
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.logits, ref.logits)


def test_state_dict_save_pretrained_copies_and_compile(tmp_path):
    model = build("qwen3")
    batch = padded_batch()
    ref, ref_grads = loss_and_grads(model, **batch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    install_chunked_hf_loss(model)

    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert "forward" not in reloaded.__dict__ and torch.equal(reloaded(**batch).loss, ref.loss)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # each wrapper follows its own model
        assert twin.forward.model is twin and twin.forward.backbone is twin.model
        out, grads = loss_and_grads(twin, **batch)
        assert out.logits is None
        assert_same_loss_and_grads(out, grads, ref, ref_grads)

    _assert_compiled_matches(model, batch, ref, ref_grads)


def test_a_backbone_that_was_not_captured_raises():
    model = build("llama_tied")
    install_chunked_hf_loss(model)
    model.model._forward_hooks.clear()  # the hook gone behind the handle's back
    with pytest.raises(RuntimeError, match=r"ran without calling its backbone 'model'.*HINT: reinstall"):
        model(**padded_batch())


def test_invalid_arguments_raise():
    with pytest.raises(TypeError, match=r"needs an nn.Module .*got <class 'str'>"):
        install_chunked_hf_loss("model")
    with pytest.raises(ValueError, match=r"enabled='yes': need True or False\n- chunk_size=0: need a positive int"):
        install_chunked_hf_loss(nn.Linear(2, 2), enabled="yes", chunk_size=0)


# --- under Trainer(strategy=MegaTrainStrategy(...)) on the CPU -----------------------------------------------------


class HFLossModule(LightningModule):
    """An unchanged plain-Lightning module: the HF model's own loss from ``labels``; records whether logits came."""

    def __init__(self, install: bool) -> None:
        super().__init__()
        self.install = install
        self.model = None
        self.logits_seen: list[bool] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build("llama_tied")
            if self.install:  # what the strategy will do at setup
                install_chunked_hf_loss(self)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.logits_seen.append(out.logits is not None)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        batches = [padded_batch(batch=2, seed=s) for s in range(3)]
        return DataLoader(batches, batch_size=None)


def fit(strategy, install: bool, steps: int = 3) -> tuple[HFLossModule, list[float]]:
    seed_everything(0, verbose=False)
    module = HFLossModule(install)
    losses = []

    class Losses(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()],
    )
    trainer.fit(module)
    return module, losses


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*smaller than the logging interval.*")
def test_megatrain_trainer_with_the_chunked_loss_matches_hf():
    ref_module, ref_losses = fit("auto", install=False)
    module, losses = fit(MegaTrainStrategy(cpu_adam="torch"), install=True)

    assert module.logits_seen == [False] * 3 and ref_module.logits_seen == [True] * 3
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    ref_params = dict(ref_module.named_parameters())
    for name, param in module.named_parameters():
        torch.testing.assert_close(param, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*smaller than the logging interval.*")
def test_megatrain_strategy_installs_the_chunked_loss_by_default():
    module, _ = fit(MegaTrainStrategy(cpu_adam="torch"), install=False, steps=1)
    assert module.logits_seen == [False] and "forward" not in module.model.__dict__  # removed at teardown
    module, _ = fit(MegaTrainStrategy(cpu_adam="torch", chunked_hf_loss=False), install=False, steps=1)
    assert module.logits_seen == [True]
