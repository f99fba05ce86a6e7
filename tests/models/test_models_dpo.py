"""DPOModule on the CPU: the chunked sequence log-probabilities and each preference loss (DPO, IPO, SimPO, ORPO)
against a plain-PyTorch implementation over full logits, in loss and every gradient; and the argument errors."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_megatrain.models import DPOModule, sequence_logps
from lightning_megatrain.models.preference_loss import default_beta, preference_loss

BETA, SMOOTHING, GAMMA = 0.5, 0.2, 0.3


def build(config, attn="sdpa", **kwargs) -> DPOModule:
    torch.manual_seed(0)
    module = DPOModule(config=config, attn_implementation=attn, **kwargs)
    module.configure_model()
    return module


def pair_batch(pairs=2, seq=12, seed=0) -> dict[str, torch.Tensor]:
    """``2 * pairs`` right-padded rows (chosen first) with shared prompts and response-only labels."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (2 * pairs, seq), generator=gen)  # [2B, T]
    input_ids[pairs:, :4] = input_ids[:pairs, :4]  # a 4-token prompt shared by each pair's two rows
    lengths = torch.randint(6, seq + 1, (2 * pairs,), generator=gen)  # [2B] real tokens per row
    attention_mask = (torch.arange(seq) < lengths.unsqueeze(1)).long()  # [2B, T]
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :4] = -100  # the prompt is not trained
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def plain_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probabilities and counts from the full ``[2B, T, V]`` logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()  # [2B, T, V]
    targets = batch["labels"][:, 1:]  # [2B, T-1]
    mask = targets != -100
    token_logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(1), mask.sum(1)


def plain_loss(model, batch, reference, loss_type) -> torch.Tensor:
    """Each loss as its paper writes it, over full logits."""
    logps, tokens = plain_logps(model, batch)
    pairs = logps.shape[0] // 2
    c, r, nc, nr = logps[:pairs], logps[pairs:], tokens[:pairs], tokens[pairs:]
    log_sigmoid = lambda x: torch.log(torch.sigmoid(x))
    if loss_type == "sigmoid":
        z = BETA * ((c - reference[:, 0]) - (r - reference[:, 1]))
        return (-(1 - SMOOTHING) * log_sigmoid(z) - SMOOTHING * log_sigmoid(-z)).mean()
    if loss_type == "ipo":
        z = (c - reference[:, 0]) - (r - reference[:, 1])
        return ((z - 1 / (2 * BETA)) ** 2).mean()
    if loss_type == "simpo":
        z = BETA * (c / nc - r / nr) - GAMMA
        return (-(1 - SMOOTHING) * log_sigmoid(z) - SMOOTHING * log_sigmoid(-z)).mean()
    p_chosen, p_rejected = torch.exp(c / nc), torch.exp(r / nr)
    log_odds_ratio = torch.log((p_chosen / (1 - p_chosen)) / (p_rejected / (1 - p_rejected)))
    return -c.sum() / nc.sum() - BETA * log_sigmoid(log_odds_ratio).mean()


def grads_of(module, loss) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in module.model.named_parameters()}


def assert_grads_close(grads, expected, rtol=1e-6):
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(grad, expected[name], rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: soft-capped logits
def test_sequence_logps_match_full_logits(arch, tiny_archs):
    config, attn = tiny_archs[arch]
    module = build(config, attn)
    batch = pair_batch(pairs=3)
    hidden = module._decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    softcap = getattr(module.model.config, "final_logit_softcapping", None)
    logps, tokens = sequence_logps(hidden, module._lm_head_weight(), batch["labels"], chunk_size=5, softcap=softcap)
    weights = torch.linspace(-1.0, 2.0, logps.shape[0])  # a loss that weighs each sequence differently
    grads = grads_of(module, (weights * logps).sum())
    expected_logps, expected_tokens = plain_logps(module.model, batch)
    expected = grads_of(module, (weights * expected_logps).sum())
    torch.testing.assert_close(logps, expected_logps.detach(), rtol=1e-6, atol=0)
    assert tokens.tolist() == expected_tokens.tolist()
    assert_grads_close(grads, expected)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo", "orpo"])
def test_each_loss_and_its_gradients_match_plain_pytorch(loss_type, tiny_archs):
    config, attn = tiny_archs["llama"]
    smoothing = SMOOTHING if loss_type in ("sigmoid", "simpo") else 0.0
    module = build(config, attn, loss_type=loss_type, beta=BETA, label_smoothing=smoothing, simpo_gamma=GAMMA,
                   loss_chunk_size=7)
    batch = pair_batch()
    with torch.no_grad():  # a reference that differs from the policy, [B, 2] (chosen, rejected)
        reference = torch.stack(plain_logps(module.model, batch)[0].split(2), dim=1) + torch.tensor(
            [[0.3, -0.4], [-0.2, 0.5]]
        )
    with warnings.catch_warnings():  # self.log without a Trainer only warns
        warnings.simplefilter("ignore")
        loss = module.training_step({**batch, "reference_logps": reference})
    grads = grads_of(module, loss)
    expected_loss = plain_loss(module.model, batch, reference, loss_type)
    expected = grads_of(module, expected_loss)
    # DPO and IPO subtract summed log-probabilities of about -40, whose last bits (4e-6 at 40) differ between the
    # chunked and the full-logits sums: up to 5e-6 of IPO's loss and 4e-6 of a gradient here (SimPO and ORPO,
    # on means, agree to 6e-7); a wrong mask, pair or formula is off by 1e-2 or more
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert_grads_close(grads, expected, rtol=1e-5)


def test_rewards_and_metrics():
    c, r = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.0, -2.5])
    ref_c, ref_r = torch.tensor([-3.5, -4.0, -2.0]), torch.tensor([-3.0, -4.5, -3.0])
    n = torch.tensor([2, 4, 1])
    dpo = preference_loss(c, r, n, n, ref_c, ref_r, beta=0.1)
    chosen, rejected = 0.1 * (c - ref_c), 0.1 * (r - ref_r)  # 0.05, -0.1, 0 and -0.1, 0.05, 0.05
    torch.testing.assert_close(dpo.chosen_rewards, chosen)
    metrics = dpo.metrics()
    torch.testing.assert_close(metrics["rewards/accuracies"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["rewards/margins"], (chosen - rejected).mean())
    torch.testing.assert_close(metrics["rewards/rejected"], rejected.mean())
    simpo = preference_loss(c, r, n, n * 2, loss_type="simpo", beta=2.0)
    torch.testing.assert_close(simpo.rejected_rewards, 2.0 * r / (n * 2))


def test_orpo_log_odds_stay_finite_near_certain_responses():
    c = torch.tensor([-1e-7, -20.0], requires_grad=True)
    r = torch.tensor([-30.0, -1e-6])
    loss = preference_loss(c, r, torch.ones(2), torch.ones(2), loss_type="orpo").loss
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(c.grad).all()


def test_orpo_stays_finite_at_a_mean_log_probability_of_zero():
    c = torch.tensor([0.0, -2.0], requires_grad=True)
    r = torch.tensor([-3.0, 0.0], requires_grad=True)
    loss = preference_loss(c, r, torch.ones(2), torch.ones(2), loss_type="orpo", beta=0.1).loss
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(c.grad).all() and torch.isfinite(r.grad).all()


def test_beta_defaults_per_loss():
    assert [default_beta(loss) for loss in ("sigmoid", "ipo", "simpo", "orpo")] == [0.1, 0.1, 2.0, 0.1]
    assert DPOModule(config={"model_type": "llama"}, loss_type="simpo").beta == 2.0
    assert DPOModule(config={"model_type": "llama"}, loss_type="simpo", beta=2.5).beta == 2.5
    c, r, n = torch.tensor([-2.0]), torch.tensor([-4.0]), torch.ones(1)
    simpo = preference_loss(c, r, n, n, loss_type="simpo")
    torch.testing.assert_close(simpo.chosen_rewards, 2.0 * c)


GPT2 = {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "bos_token_id": 1, "eos_token_id": 2}  # nn.Dropout modules, from resid_pdrop, embd_pdrop and attn_pdrop


@pytest.mark.parametrize("disable_dropout", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # llama: functional attention dropout (attention_dropout)
def test_dropout_is_off_in_training_unless_kept(arch, disable_dropout, tiny_archs):
    config, attn = ({**tiny_archs["llama"][0], "attention_dropout": 0.5}, "sdpa") if arch == "llama" else (GPT2, "sdpa")
    module = build(config, attn, disable_dropout=disable_dropout)
    batch = pair_batch(pairs=2)
    module.eval()
    with torch.no_grad():
        reference, _ = module._sequence_logps(batch)  # as the reference pass computes it
        module.train()
        trained, _ = module._sequence_logps(batch)
    dropouts = [m.p for m in module.model.modules() if isinstance(m, torch.nn.Dropout)]
    if disable_dropout:
        torch.testing.assert_close(trained, reference, rtol=1e-6, atol=0)
        assert all(p == 0 for p in dropouts)
        assert module.hf_config.get_text_config().to_dict().get("attention_dropout", 0) == 0
    else:
        assert not torch.allclose(trained, reference)


def test_predict_step_returns_the_policy_logps(tiny_archs):
    config, attn = tiny_archs["llama"]
    module = build(config, attn)
    batch = {**pair_batch(pairs=3), "pair_index": torch.tensor([4, 0, 2])}
    output = module.predict_step(batch)
    logps, tokens = plain_logps(module.model, batch)
    torch.testing.assert_close(torch.cat([output["chosen_logps"], output["rejected_logps"]]), logps.detach(),
                               rtol=1e-6, atol=0)
    assert torch.cat([output["chosen_tokens"], output["rejected_tokens"]]).tolist() == tokens.tolist()
    assert output["pair_index"].tolist() == [4, 0, 2]


def test_reference_losses_need_reference_logps(tiny_archs):
    config, attn = tiny_archs["llama"]
    module = build(config, attn)
    with pytest.raises(ValueError, match=r"loss_type='sigmoid' needs the reference model's log-probabilities"):
        module._preference(pair_batch())
    with pytest.raises(ValueError, match=r"a batch has 3 rows; it needs 2B"):
        module._preference({k: v[:3] for k, v in pair_batch().items()})


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError) as info:
        DPOModule(config={"model_type": "llama"}, loss_type="kto", beta=0, label_smoothing=0.7, simpo_gamma="0.5",
                  reference_cache=3, disable_dropout="yes")
    message = str(info.value)
    assert "loss_type='kto': must be one of ['sigmoid', 'ipo', 'simpo', 'orpo']" in message
    assert "beta=0: must be a number > 0" in message
    assert "label_smoothing=0.7: must be in [0, 0.5)" in message
    assert "simpo_gamma='0.5': must be a number" in message
    assert "reference_cache=3: must be a file path (a string) or None" in message
    assert "disable_dropout='yes': must be True or False" in message
    with pytest.raises(ValueError, match=r"label_smoothing=0.1: applies to loss_type 'sigmoid' and 'simpo' only"):
        DPOModule(config={"model_type": "llama"}, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"reference_cache='r.pt': loss_type='orpo' reads no reference"):
        DPOModule(config={"model_type": "llama"}, loss_type="orpo", reference_cache="r.pt")
    # CausalLMModule adds the MoE router loss; the preference losses do not, so the flag is refused
    with pytest.raises(ValueError, match=r"DPOModule: output_router_logits=True in the mixtral config, but the "
                                         r"preference losses add no MoE router auxiliary loss.*HINT: set"):
        DPOModule(config={"model_type": "mixtral", "output_router_logits": True})


@pytest.mark.parametrize("attn", ["sdpa", "packed_sdpa"])
def test_right_padded_batches_run_without_their_mask(attn, tiny_archs, transformers_finds):
    config, _ = tiny_archs["llama"]
    module = build(config, attn)
    batch = pair_batch(pairs=3)  # right-padded rows of different lengths
    prepared = module.on_before_batch_transfer({**batch, "reference_logps": torch.zeros(3, 2)}, 0)
    assert prepared["causal_only"] is True
    rows, length = batch["input_ids"].shape
    assert torch.equal(prepared["position_ids"], torch.arange(length).expand(rows, length))  # host, bound at transfer
    moved = module.transfer_batch_to_device(prepared, torch.device("cpu"), 0)
    with torch.no_grad():
        without_mask = module._sequence_logps(moved)
        assert transformers_finds == [], "the bound position_ids must not reach transformers' own finder"
        with_mask = module._sequence_logps(batch)
    torch.testing.assert_close(without_mask, with_mask, rtol=1e-6, atol=0)
    left_padded = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    assert "causal_only" not in module.on_before_batch_transfer({**left_padded, "reference_logps": torch.zeros(3, 2)},
                                                                0)


def test_sequence_logps_refuses_mismatched_shapes_and_bad_options():
    hidden, weight, labels = torch.zeros(2, 5, 8), torch.zeros(16, 8), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden must be \[B, T, H\], got shape \(2, 5\)"):
        sequence_logps(hidden[..., 0], weight, labels)
    with pytest.raises(ValueError, match=r"labels must be \[B, T\] = \(2, 5\) to match hidden, got \(2, 4\)"):
        sequence_logps(hidden, weight, labels[:, :4])
    with pytest.raises(ValueError, match=r"weight must be \[V, 8\] to match hidden, got \(16, 4\)"):
        sequence_logps(hidden, weight[:, :4], labels)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer, got 0"):
        sequence_logps(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"softcap must be positive or None, got -1.0"):
        sequence_logps(hidden, weight, labels, softcap=-1.0)
