"""MoE router auxiliary losses through the streamed engine (engine/recorded.py, [Note: recorded outputs]): the router
logits transformers records inside each layer become outputs of the layer's node, so the load-balancing loss trains
the routers. Losses, every gradient (the routers' included) and the post-step weights must equal plain Lightning's."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import recorded as recorded_module
from lightning_megatrain.engine.recorded import Recorded, find_recorded, merge_tiles

from helpers.families import FAMILIES, MOE_FAMILIES, ROUTER_AUX_COEF
from helpers.parity import ParityLM, Record, assert_records_close, make_data, run
from helpers.trainers import cpu_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*smaller than the logging interval.*"
)

# accumulation over 2 micro-batches and clipping that fires: 0.05 is far below these grads' global norms (checked)
TRAIN = {"steps": 2, "accumulate": 2, "clip": 0.05}

# The router of each family and where it sits in a layer (what transformers' recorders record from).
ROUTERS = {"mixtral": "mlp.gate", "qwen3_moe": "mlp.gate", "gpt_oss": "mlp.router"}


@functools.cache
def reference(family: str, router_aux: bool = True) -> Record:
    """Plain Lightning, the exact-kernel reference (fused AdamW, as ``cpu_adam="torch"``); do not mutate."""
    return run("auto", family, optimizer="adamw_fused", router_aux=router_aux, **TRAIN)


def _global_norm(grads: dict) -> float:
    return float(torch.stack([g.norm() for g in grads.values() if g is not None]).norm())


def _router_grads(rec: Record, family: str, step: int = 0) -> list[torch.Tensor]:
    return [g for name, g in rec.grads[step].items() if f".{ROUTERS[family]}.weight" in name]


# Every layer recomputed (the default on the CPU), kept (keep_layers=1: layer 0 keeps its graph), in recompute
# segments (replayed inputs), in sequence tiles (the router called per tile, its logits merged). Untiled the records
# are plain Lightning's to fp32 re-association; tiles change the MoE block's summation order: the first step within
# 1e-6, later ones after an Adam update, which normalises rounding noise in small grads, within HOST_ADAM_RTOL's 1e-3
# (1.1e-4 measured, Qwen3-MoE's k_proj).
VARIANTS = {
    "recomputed": ({"keep_layers": 0}, 1e-5, 1e-5),
    "kept": ({"keep_layers": 1}, 1e-5, 1e-5),
    "segments": ({"keep_layers": 0, "segment_layers": 2}, 1e-5, 1e-5),
    "tiles": ({"keep_layers": 1, "seq_tile": 5}, 1e-6, 1e-3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_aux_loss_matches_plain_lightning(family, variant):
    options, rtol, rtol_updated = VARIANTS[variant]
    ref = reference(family)
    assert all(_global_norm(g) > TRAIN["clip"] for g in ref.grads)  # clipping bites
    got = run(MegaTrainStrategy(cpu_adam="torch", **options), family, router_aux=True, **TRAIN)
    assert_records_close(got, ref, rtol=rtol, rtol_updated=rtol_updated)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_loss_is_trained(family):
    """The router loss is on and moves the loss and the routers' gradients: by a share far outside the parity
    tolerance, so the parity above fails without its gradient (what the engine gave before [Note: recorded outputs]:
    the loss's value, not its gradient)."""
    with_aux, without = reference(family), reference(family, router_aux=False)
    assert with_aux.losses[0] > without.losses[0] + ROUTER_AUX_COEF  # + coef * aux, aux about top_k = 2 here
    routers = _router_grads(with_aux, family)
    assert len(routers) == FAMILIES[family]().num_hidden_layers
    for got, plain in zip(routers, _router_grads(without, family), strict=True):
        assert (got - plain).norm() > 0.05 * plain.norm()


def test_hf_own_loss_with_the_router_loss_matches_plain_lightning():
    """A module calling the model with labels, HF's own loss (no chunked loss on either side): HF adds the router
    loss to its loss in its forward, from the router logits the post-hook gave back."""
    def module():
        return ParityLM("mixtral", optimizer="adamw_fused", router_aux=True, chunked_loss=False)

    ref = run("auto", None, module=module, **TRAIN)
    got = run(MegaTrainStrategy(cpu_adam="torch", chunked_hf_loss=False), None, module=module, **TRAIN)
    assert_records_close(got, ref)
    # the chunked loss adds the same router loss; its cross-entropy sums in another order, which the Adam update
    # amplifies in small grads (2.4e-5 measured in the second step)
    assert_records_close(got, reference("mixtral"), rtol=1e-5, rtol_updated=1e-4)


# compile_layers (inductor on the CPU): a call that records runs its layers uncompiled, in forward, recompute and
# replay ([Note: recorded outputs]): gpt-oss adds its experts' biases in place, which the selective checkpoint of a
# compiled layer that broke its graph at transformers' recording hook refused ("Tensor cached during selective
# activation checkpoint has been mutated"). Same tolerances as tests/strategy/test_parity.py's compiled runs.
def test_compiled_layers_record_uncompiled():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    strategy = MegaTrainStrategy(cpu_adam="torch", keep_layers=1, compile_layers=True)
    got = run(strategy, "gpt_oss", router_aux=True, **TRAIN)
    assert counters["stats"]["unique_graphs"] == 1  # the setup's probe that torch.compile works: no layer compiled
    assert_records_close(got, reference("gpt_oss"), rtol=1e-4, rtol_updated=1e-3)


class _Validated(ParityLM):
    """Also records, per validation batch, the router-logits tensors HF returns and its router loss (with the
    attention mask: the load-balancing loss then needs each tensor to cover every position of the batch)."""

    def __init__(self) -> None:
        super().__init__("mixtral", router_aux=True)
        self.seen: list[tuple[list[tuple[int, ...]], float]] = []

    def validation_step(self, batch, batch_idx):
        out = self.model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
        self.seen.append(([tuple(t.shape) for t in out.router_logits], float(out.aux_loss)))

    def val_dataloader(self):
        return DataLoader(make_data()[:4], batch_size=2)


def test_validation_records_one_router_tensor_per_layer_in_tiles():
    """A forward without grad in sequence tiles records one merged tensor per layer, as untiled (the router runs per
    tile: transformers' list would hold one per tile, which the masked load-balancing loss cannot broadcast)."""
    seen = {}
    for name, strategy in (("plain", "auto"), ("tiled", MegaTrainStrategy(cpu_adam="torch", seq_tile=5))):
        seen[name] = (module := _Validated()).seen
        cpu_trainer(strategy=strategy).validate(module)
    assert len(seen["tiled"]) == len(seen["plain"]) == 2
    for (shapes, aux), (ref_shapes, ref_aux) in zip(seen["tiled"], seen["plain"]):
        assert shapes == ref_shapes == [(2 * 16, 8)] * 3  # [B * T, E] for each of the 3 layers
        assert abs(aux - ref_aux) <= 1e-6 * ref_aux


def test_find_recorded_hooks_what_transformers_records_and_uninstall_removes_every_hook():
    from transformers import AutoModelForCausalLM

    for family, router in ROUTERS.items():
        model = AutoModelForCausalLM.from_config(FAMILIES[family]())
        found = find_recorded(model, "model.layers", model.model.layers)
        names = {n: r.key for n, m in model.named_modules() for r_module, r in found.recorders if m is r_module}
        # the routers' logits, and the attention weights (recorded under output_attentions); not the layers' outputs
        assert names == {f"model.layers.{i}.{name}": key for i in range(3)
                         for name, key in ((router, "router_logits"), ("self_attn", "attentions"))}, names
        assert found.keys == {"router_logits", "attentions"} and found.ancestors == [model, model.model]
        hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731
        before = hooks()
        found.install()
        assert hooks() == before + 2 * 3 + 2 * 2  # one per recorder, a pre- and a post-hook per ancestor
        found.uninstall()
        assert hooks() == before
    dense = AutoModelForCausalLM.from_config(FAMILIES["llama_tied"]())
    assert {r.key for _, r in find_recorded(dense, "model.layers", dense.model.layers).recorders} == {"attentions"}


class _AttentionLoss(ParityLM):
    """Qwen3 (eager attention) trained on its loss plus its attention weights' mean square, which transformers records
    from inside the layers (``output_attentions=True``): the same mechanism as the router logits."""

    def __init__(self) -> None:
        super().__init__("qwen3", optimizer="adamw_fused")

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch, labels=batch, output_attentions=True)
        return out.loss + sum(a.pow(2).mean() for a in out.attentions)


def test_recorded_attention_weights_train_too():
    ref = run("auto", None, module=_AttentionLoss, **TRAIN)
    plain = run("auto", "qwen3", optimizer="adamw_fused", **TRAIN)
    assert ref.losses[0] > plain.losses[0] + 1e-3  # the attention term is in the loss
    got = run(MegaTrainStrategy(cpu_adam="torch", keep_layers=1), None, module=_AttentionLoss, **TRAIN)
    assert_records_close(got, ref)


def test_tiles_that_record_differently_raise():
    a, b = torch.zeros(2), torch.ones(2)
    merged = merge_tiles([[Recorded(a, (a,))], [Recorded(b, (b,))]], torch.cat)
    assert len(merged) == 1 and torch.equal(merged[0].value, torch.tensor([0.0, 0, 1, 1]))
    assert merged[0].sources == (a, b)
    with pytest.raises(RuntimeError, match=r"tiles of one block recorded \[0, 1\] outputs.*HINT: use seq_tile=None"):
        merge_tiles([[Recorded(a, (a,))], []], torch.cat)


def test_a_recompute_that_records_differently_raises(monkeypatch):
    # the recorders capture nothing in backward: the recompute would pair the aux loss's gradients with nothing
    hook = recorded_module._RecordHook.__call__

    def forward_only(self, module, args, output):
        if torch._C._current_graph_task_id() == -1:
            hook(self, module, args, output)

    monkeypatch.setattr(recorded_module._RecordHook, "__call__", forward_only)
    with pytest.raises(RuntimeError, match=r"layer 2's recompute recorded 0 outputs \(router logits\), its forward 1"):
        run(MegaTrainStrategy(cpu_adam="torch", keep_layers=0), "mixtral", router_aux=True, steps=1)


def test_router_logits_the_engine_did_not_capture_raise(monkeypatch):
    # a transformers release whose recorders the engine would not find: the router logits reach the loss without a
    # graph, and the step raises instead of training a router loss that moves nothing
    monkeypatch.setattr(recorded_module, "_recorders", lambda model, name, module: [])
    with pytest.raises(RuntimeError, match=r"MixtralModel returned router logits without a gradient path.*HINT: set "
                                           r"output_router_logits=False"):
        run(MegaTrainStrategy(cpu_adam="torch"), "mixtral", router_aux=True, steps=1)
