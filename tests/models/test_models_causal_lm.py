"""CausalLMModule: loss/gradient parity with HF, Trainer integration, optimizer, loading, errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_megatrain.models import CausalLMModule, causal_lm_loss
from lightning_megatrain.models.causal_lm import warmup_cosine_factor


def build(config, attn="sdpa", **kwargs) -> CausalLMModule:
    torch.manual_seed(0)
    module = CausalLMModule(config=config, attn_implementation=attn, **kwargs)
    module.configure_model()
    return module


def train_loss(module, batch):
    with warnings.catch_warnings():  # self.log without a Trainer only warns
        warnings.simplefilter("ignore")
        return module.training_step(batch)


def param_grads(module, loss):
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in module.model.named_parameters()}


def random_batch(seq=12, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (batch, seq), generator=gen)  # [B, T]
    labels = input_ids.clone()
    labels[torch.rand(batch, seq, generator=gen) < 0.25] = -100
    return input_ids, labels


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_loss_and_grads_match_hf(arch, tiny_archs):
    config, attn = tiny_archs[arch]
    module = build(config, attn, loss_chunk_size=5)
    input_ids, labels = random_batch()

    loss = train_loss(module, {"input_ids": input_ids, "labels": labels})
    grads = param_grads(module, loss)
    ref = module.model(input_ids=input_ids, labels=labels).loss
    ref_grads = param_grads(module, ref)

    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_gemma2_softcapping_and_embedding_scale_are_applied(tiny_archs):
    config, attn = tiny_archs["gemma2"]
    module = build(config, attn)
    input_ids, labels = random_batch()
    decoder = module.model.get_decoder()
    with torch.no_grad():
        hidden = decoder(input_ids=input_ids).last_hidden_state  # [B, T, H]
        weight = module.model.get_output_embeddings().weight  # [V, H]
        capped = causal_lm_loss(hidden, weight, labels, softcap=2.0)
        uncapped = causal_lm_loss(hidden, weight, labels)
        ref = module.model(input_ids=input_ids, labels=labels).loss
        scaled = decoder.embed_tokens(input_ids)
        plain = torch.nn.functional.embedding(input_ids, decoder.embed_tokens.weight)

    torch.testing.assert_close(capped, ref, rtol=1e-5, atol=0)
    assert abs(uncapped - ref) > 1e-2
    torch.testing.assert_close(scaled, plain * math.sqrt(config["hidden_size"]))


def test_default_labels_ignore_padding(tiny_archs):
    config, _ = tiny_archs["llama"]
    module = build(config)
    input_ids, _ = random_batch()
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -4:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    loss = train_loss(module, {"input_ids": input_ids, "attention_mask": attention_mask})
    ref = module.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)


def test_forward_returns_hf_logits(tiny_archs):
    config, _ = tiny_archs["qwen3"]
    module = build(config)
    input_ids, _ = random_batch()
    torch.testing.assert_close(module(input_ids), module.model(input_ids=input_ids).logits)


class _RecordLR(Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append([group["lr"] for group in trainer.optimizers[0].param_groups])


def test_fit_three_steps(tiny_archs, token_loader, trainer_kwargs):
    config, _ = tiny_archs["llama"]
    module = build(config, learning_rate=1e-3, weight_decay=0.1, warmup_steps=1, min_lr_ratio=0.2)
    record = _RecordLR()
    trainer = Trainer(max_steps=3, callbacks=[record], **trainer_kwargs)

    trainer.fit(module, token_loader(n=6), token_loader(n=4, seed=1))

    metrics = trainer.callback_metrics
    assert trainer.global_step == 3
    assert math.isfinite(metrics["train_loss"].item())
    assert metrics["train_loss"].item() < 2 * math.log(128)
    assert metrics["train_tokens"].item() == 3 * 2 * 15
    assert module.tokens_trained == 90
    torch.testing.assert_close(metrics["val_ppl"], torch.exp(metrics["val_loss"]))
    # warmup_steps=1 -> peak at steps 0 and 1, then cosine halfway (progress 1/2) at step 2.
    expected = [1e-3, 1e-3, 1e-3 * (0.2 + 0.8 * 0.5)]
    for step_lrs, lr in zip(record.lrs, expected, strict=True):
        assert step_lrs == pytest.approx([lr, lr])


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_eval_loss_is_token_weighted(stage, tiny_archs, trainer_kwargs):
    config, _ = tiny_archs["llama"]
    module = build(config)
    ids_a, labels_a = random_batch(seed=1)
    ids_b, labels_b = random_batch(seed=2)
    labels_b[:, 2:] = -100  # second batch: 2 targets vs ~16 in the first
    batches = [
        {"input_ids": ids_a, "labels": labels_a},
        {"input_ids": ids_b, "labels": labels_b},
    ]
    with torch.no_grad():
        losses = [module.model(input_ids=b["input_ids"], labels=b["labels"]).loss for b in batches]
    counts = [(b["labels"][:, 1:] != -100).sum() for b in batches]
    expected = sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)

    trainer = Trainer(**trainer_kwargs)
    (result,) = getattr(trainer, stage)(module, DataLoader(batches, batch_size=None), verbose=False)

    prefix = {"validate": "val", "test": "test"}[stage]
    assert set(result) == {f"{prefix}_loss", f"{prefix}_ppl"}
    assert result[f"{prefix}_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert result[f"{prefix}_ppl"] == pytest.approx(math.exp(expected.item()), rel=1e-5)


def test_validation_and_test_metrics_are_separate(tiny_archs):
    config, _ = tiny_archs["llama"]
    module = build(config)
    input_ids, labels = random_batch()
    with torch.no_grad():
        module.validation_step({"input_ids": input_ids, "labels": labels})
    assert module.test_loss_mean is not module.val_loss_mean
    assert module.val_loss_mean.tokens.item() > 0 and module.test_loss_mean.tokens.item() == 0


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_predict_step_scores_each_row_like_hf(arch, tiny_archs, trainer_kwargs):
    config, attn = tiny_archs[arch]
    module = build(config, attn, loss_chunk_size=5)
    input_ids, labels = random_batch(batch=3, seed=3)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -5:] = 0  # right padding, not trained
    labels[1, -5:] = -100
    labels[2, 1:] = -100  # a row without targets
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    with torch.no_grad():
        expected = [
            module.model(input_ids=input_ids[i : i + 1], attention_mask=attention_mask[i : i + 1],
                         labels=labels[i : i + 1]).loss
            for i in range(2)
        ]

    trainer = Trainer(**trainer_kwargs)
    (prediction,) = trainer.predict(module, DataLoader([batch], batch_size=None))

    assert set(prediction) == {"loss", "tokens"}
    assert prediction["loss"].shape == prediction["tokens"].shape == (3,)
    assert prediction["tokens"].tolist() == [(labels[i, 1:] != -100).sum().item() for i in range(3)]
    torch.testing.assert_close(prediction["loss"][:2], torch.stack(expected), rtol=1e-5, atol=0)
    assert prediction["loss"][2].item() == 0.0  # no targets: 0, not nan
    # The token-weighted mean of the rows is the batch loss that training and evaluation use.
    with torch.no_grad():
        batch_loss = module.model(**batch).loss
    weighted = (prediction["loss"] * prediction["tokens"]).sum() / prediction["tokens"].sum()
    torch.testing.assert_close(weighted, batch_loss, rtol=1e-5, atol=0)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_optimizer_groups_and_schedule(tiny_archs, trainer_kwargs):
    config, _ = tiny_archs["llama"]
    lr, warmup, total, min_ratio = 1e-3, 10, 100, 0.1
    module = build(
        config, learning_rate=lr, weight_decay=0.1, warmup_steps=warmup, min_lr_ratio=min_ratio
    )
    module.trainer = Trainer(max_epochs=-1, max_steps=total, **trainer_kwargs)

    out = module.configure_optimizers()
    optimizer, scheduler = out["optimizer"], out["lr_scheduler"]["scheduler"]
    decay, no_decay = optimizer.param_groups

    assert out["lr_scheduler"]["interval"] == "step"
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    lrs = {0: scheduler.get_last_lr()[0]}
    for step in range(1, total + 1):
        scheduler.step()
        lrs[step] = scheduler.get_last_lr()[0]
    assert lrs[0] == pytest.approx(lr / warmup)
    assert lrs[warmup - 1] == pytest.approx(lr)
    assert lrs[warmup] == pytest.approx(lr)
    assert lrs[55] == pytest.approx(lr * (min_ratio + (1 - min_ratio) * 0.5))
    assert lrs[total] == pytest.approx(lr * min_ratio)
    for step, value in lrs.items():
        factor = warmup_cosine_factor(
            step, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio
        )
        assert value == pytest.approx(lr * factor)


def test_unbounded_training_has_no_schedule(tiny_archs, trainer_kwargs):
    config, _ = tiny_archs["llama"]
    module = build(config)
    module.trainer = Trainer(max_epochs=-1, max_steps=-1, **trainer_kwargs)
    with pytest.raises(ValueError, match="estimated_stepping_batches=inf; set Trainer"):
        module.configure_optimizers()


def test_from_pretrained_directory(tiny_archs, tmp_path):
    config, _ = tiny_archs["qwen3"]
    config.pop("model_type")
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **config))
    hf_model.save_pretrained(tmp_path / "qwen3")

    module = CausalLMModule(model=str(tmp_path / "qwen3"))
    module.configure_model()
    loaded = module.model
    module.configure_model()

    assert module.model is loaded
    assert module.hparams.tokenizer is None
    assert module.model.config.use_cache is False
    assert next(module.model.parameters()).dtype == torch.float32
    expected = hf_model.state_dict()
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, r"exactly one of `model`.*got model=None, config=None"),
        ({"model": "x", "config": {"model_type": "llama"}}, "exactly one of `model`"),
        ({"config": {"hidden_size": 8}}, "config needs a 'model_type' key"),
        ({"config": {"model_type": "llama"}, "loss_chunk_size": 0}, "loss_chunk_size must be"),
        ({"config": {"model_type": "llama"}, "min_lr_ratio": 2.0}, "min_lr_ratio must be"),
        ({"config": {"model_type": "cohere"}}, r"cohere rescales its logits \(logit_scale="),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CausalLMModule(**kwargs)


_MOE_TINY = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 128, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.5,
}
MOE_ARCHS = {
    "mixtral": ({"model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 32, **_MOE_TINY}, "sdpa"),
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 16, **_MOE_TINY}, "sdpa"),
    "gpt_oss": ({"model_type": "gpt_oss", "num_local_experts": 4, "intermediate_size": 32, **_MOE_TINY}, "eager"),
}


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_router_aux_loss_matches_hf(arch):
    # output_router_logits=True: training adds the router loss as HF's forward does with labels (coef 0.5 times the
    # load-balancing loss of the unpadded positions); evaluation reports the plain NLL
    config, attn = MOE_ARCHS[arch]
    module = build(config, attn, loss_chunk_size=5)
    input_ids, labels = random_batch()
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0
    labels = labels.masked_fill(attention_mask == 0, -100)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    loss = train_loss(module, batch)
    grads = param_grads(module, loss)
    ref = module.model(**batch)
    ref_grads = param_grads(module, ref.loss)

    assert module.router_aux is not None and ref.aux_loss > 0.5
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
    nll, _ = module._loss(batch)  # what validation, test and predict see
    torch.testing.assert_close(loss - nll, 0.5 * ref.aux_loss, rtol=1e-5, atol=0)


def test_router_logits_of_a_model_without_router_loss_or_with_an_unread_one():
    common = {**_MOE_TINY, "intermediate_size": 32}
    # DeepSeek-V3's routers balance without an auxiliary loss: its forward adds none, and neither does training here
    module = build({"model_type": "deepseek_v3", **common, "n_routed_experts": 4, "moe_intermediate_size": 16,
                    "q_lora_rank": None, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                    "v_head_dim": 8, "head_dim": 4, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1})
    input_ids, labels = random_batch()
    assert module.router_aux is None
    torch.testing.assert_close(train_loss(module, {"input_ids": input_ids, "labels": labels}),
                               module.model(input_ids=input_ids, labels=labels).loss, rtol=1e-5, atol=0)
    # Doge's forward is not a form models/hf_loss.py reads (in 5.17 its router loss, in 5.24 its first statement):
    # which router loss it adds is unknown, so it is refused
    module = CausalLMModule(config={"model_type": "doge", **common, "num_experts": 16, "is_moe": True})
    with pytest.raises(ValueError, match=r"output_router_logits=True in the doge config: .* cannot read which loss "
                                         r"that forward adds: .*HINT: set output_router_logits to false"):
        module.configure_model()


def test_host_computed_target_rows_give_the_same_loss_grads_and_count(tiny_archs):
    # on_before_batch_transfer adds the loss's target positions while the batch is on the host, so on a GPU neither
    # the loss's row selection nor the token count syncs the device; the numbers are those of the in-loss selection
    config, attn = tiny_archs["llama"]
    module = build(config, attn, loss_chunk_size=5)
    input_ids, labels = random_batch()
    batch = {"input_ids": input_ids, "labels": labels}
    moved = module.on_before_batch_transfer(batch, 0)
    rows = moved["target_rows"]
    flat_targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1).flatten()  # [B*T] shifted
    assert rows.tolist() == (flat_targets != -100).nonzero().flatten().tolist()
    assert "target_rows" not in batch  # the caller's dict is not changed

    loss, count = module._loss(moved)
    ref, ref_count = module._loss(batch)
    assert isinstance(count, int) and count == int(ref_count) == int((labels[:, 1:] != -100).sum())
    assert torch.equal(loss, ref)
    assert all(torch.equal(a, b) for a, b in zip(param_grads(module, loss).values(), param_grads(module, ref).values()))
    assert module.on_before_batch_transfer(input_ids, 0) is input_ids  # other batch types pass through


@pytest.mark.parametrize("experts", [None, "eager", "grouped_mm"])
def test_experts_implementation_reaches_the_model(experts):
    """``experts_implementation`` goes to transformers as its own keyword (an option, for the experts' eager loop); None
    leaves transformers' choice, which is grouped_mm in transformers 5 where torch has it."""
    config = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    module = build(config, experts_implementation=experts)
    assert module.hparams.experts_implementation == experts
    assert module.model.config._experts_implementation == (experts or "grouped_mm")
