"""Packed rows' documents read on the host at transfer (models/document_spans.py, [Note: host document spans]): the
starts follow transformers' rule, the bound path gives the outputs and gradients of the path that reads the device,
reads nothing from the device itself, and falls back or fails loudly where the binding does not apply."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import find_packed_sequence_indices

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data.collate import PackedCollator
from lightning_megatrain.models import CausalLMModule
from lightning_megatrain.models import document_spans as ds
from lightning_megatrain.models import packed_attention as pa

from helpers import families
from helpers.families import with_router_aux
from helpers.packing import CONFIGS, document

ROWS = [[document(7, 1), document(12, 2), document(3, 3)], [document(9, 4), document(4, 5)], [document(20, 6)]]
COLLATE = PackedCollator(pad_token_id=0, pad_to_multiple_of=8)  # rows of 24 tokens; rows 2 and 3 get padding tails


def _model(arch: str, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    config = {**CONFIGS[arch], **config}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation=pa.PACKED_SDPA)


def _bound(batch: dict) -> dict:
    """``batch`` moved "to the CPU" by Lightning's default transfer, its documents bound on the way."""
    return ds.transfer_binding_spans(batch, lambda b: {k: v.clone() for k, v in b.items()})


def _run(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    """Logits and every parameter's gradient of one forward and backward."""
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    logits.square().mean().backward()
    return [logits.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("lengths", [[7, 12, 3, 2], [24], [1, 1, 22], [5, 5, 5, 9]])
def test_host_starts_follow_transformers_rule(lengths):
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, T]
    starts = ds.host_document_starts(torch.cat([position_ids, torch.arange(24)[None]]))  # a second, unpacked row
    index = find_packed_sequence_indices(position_ids)  # [1, T] document index, or None for one document
    expected = [0] if index is None else [0, *(torch.nonzero(index[0].diff()).flatten() + 1).tolist()]
    assert starts == (tuple(expected), (0,))
    ds.bind(position_ids, starts[:1])
    bound = ds.find_packed_sequence_indices(position_ids)  # the same answer, without reading the device
    assert (bound is None) == (index is None) and (index is None or torch.equal(bound, index))
    assert ds.take_bound_spans().starts == starts[:1]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_bound_spans_give_the_outputs_and_gradients_of_the_device_path(arch, transformers_finds, monkeypatch):
    model, batch = _model(arch), COLLATE(ROWS)
    spied = []
    def spy(module, query, key, value, attention_mask, **kwargs):
        spied.append(attention_mask)
        return pa.packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, pa.PACKED_SDPA, spy)
    reference = _run(model, batch)  # unbound: the starts read from the device
    assert len(transformers_finds) == 1
    got = _run(model, _bound(batch))
    assert len(transformers_finds) == 1, "the bound batch must not reach transformers' own finder"
    assert spied[0] == spied[-1] and spied[-1] is not spied[0]  # the same starts, one from the device, one bound
    assert spied[-1].starts == ((0, 7, 19, 22), (0, 9, 13), (0, 20))
    for a, b in zip(got, reference):
        assert torch.equal(a, b)


# Tensor methods that read a tensor's values to the host: a device sync for a tensor on a GPU
_READS = ("__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__", "numpy")
# aten ops that wait for the device on a GPU (a read to the host inside the kernel: a count, a scalar, an equality),
# and ``lift_fresh`` (a tensor made from Python data: ``torch.tensor(..., device=...)`` copies it to a GPU blocking;
# counted wherever it appears, to be safe); each a sync under torch.cuda.set_sync_debug_mode("error")
_SYNCING_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "equal", "_unique", "_unique2",
                "unique_dim", "unique_consecutive", "bincount", "repeat_interleave", "lift_fresh")


class _SyncingOps(TorchDispatchMode):
    """Records the aten ops of ``_SYNCING_OPS``, and ``index``/``index_put`` with a boolean index (a ``nonzero``)."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name in ("index", "index_put", "index_put_") else ()
        if name in _SYNCING_OPS or any(i is not None and i.dtype == torch.bool for i in indices):
            self.seen.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _reads():
    """The names of the tensor reads made inside the block, and of the aten ops that would sync a GPU (on the CPU,
    where they cost nothing, but each one would wait for the device in a GPU forward or backward)."""
    seen: list[str] = []

    def spy(name, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            seen.append(name)
            return method(*args, **kwargs)
        return wrapper

    with pytest.MonkeyPatch.context() as mp, _SyncingOps(seen):
        for name in _READS:
            mp.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
        mp.setattr(torch, "nonzero", spy("torch.nonzero", torch.nonzero))
        yield seen


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_bound_packed_forward_and_backward_read_nothing_from_the_device(arch):
    model, batch = _model(arch), COLLATE(ROWS)
    bound = _bound(batch)
    with _reads() as seen:
        _run(model, bound)
    assert seen == []
    with _reads() as seen:  # control: the same batch unbound reads the starts back
        _run(model, batch)
    assert {"__bool__", "nonzero", "tolist", "aten._local_scalar_dense", "aten.nonzero"} <= set(seen)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_causal_lm_module_loss_on_a_bound_batch_reads_nothing_from_the_device(arch):
    """The CPU side of ``test_causal_lm_module_loss_on_a_packed_batch_runs_without_a_sync`` (GPU): the module's own
    transfer binds the documents and its chunked loss counts targets on the host."""
    module = CausalLMModule(config=CONFIGS[arch])
    module.configure_model()
    batch = module.transfer_batch_to_device(module.on_before_batch_transfer(COLLATE(ROWS), 0), torch.device("cpu"), 0)
    with _reads() as seen:
        loss, _ = module._loss(batch)
        loss.backward()
    assert seen == [] and torch.isfinite(loss)


def test_the_device_check_takes_a_message_cuda_accepts(monkeypatch):
    """The check of bound spans against the probes (``torch._assert_async``) passes a message that CUDA's kernel
    takes: on a GPU a message of ``DEVICE_ASSERT_MESSAGE_LIMIT`` bytes or more raises on the host before the launch,
    which failed every bound forward there."""
    messages = []
    assert_async = torch._assert_async

    def cuda_like(condition, message=""):  # the host-side check of _assert_async_msg_cuda, then the CPU kernel
        messages.append(message)
        if len(message.encode()) >= pa.DEVICE_ASSERT_MESSAGE_LIMIT:
            raise RuntimeError(f"Message length must be smaller than {pa.DEVICE_ASSERT_MESSAGE_LIMIT}")
        return assert_async(condition, message)

    monkeypatch.setattr(torch, "_assert_async", cuda_like)
    for arch in sorted(CONFIGS):
        _run(_model(arch), _bound(COLLATE(ROWS)))
    assert messages == [pa._SPANS_DISAGREE] * len(CONFIGS)  # one check per forward (one mask for all layers)


def test_spans_that_disagree_with_the_mask_raise(transformers_finds):
    model, batch = _model("llama"), COLLATE(ROWS)
    ds.bind(batch["position_ids"], ((0, 7, 19), (0, 9, 13), (0, 20)))  # row 0 misses its padding tail
    with pytest.raises(RuntimeError, match="not causal within the documents read from the host position_ids"):
        _run(model, batch)


def test_a_replaced_or_modified_position_ids_falls_back(transformers_finds):
    model, batch = _model("llama"), COLLATE(ROWS)
    reference = _run(model, batch)
    bound = _bound(batch)
    replaced = {**bound, "position_ids": bound["position_ids"].clone()}
    assert ds.bound_spans(replaced["position_ids"]) is None
    bound["position_ids"].add_(0)  # in place: the version counter moves
    assert ds.bound_spans(bound["position_ids"]) is None
    for tried in (replaced, bound):
        for a, b in zip(_run(model, tried), reference):
            assert torch.equal(a, b)
    assert len(transformers_finds) == 3


@pytest.mark.parametrize("window, bound_path", [(4, False), (24, True)])
def test_a_sliding_window_shorter_than_a_document_takes_the_device_path(window, bound_path, transformers_finds):
    """Mistral attends within a sliding window: shorter than a document, the host cannot vouch for the spans and the
    mask builder reads its probes (the dense mask); covering every document, the bound spans hold."""
    config = {**CONFIGS["llama"], "model_type": "mistral", "sliding_window": window}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation=pa.PACKED_SDPA)
    batch = COLLATE(ROWS)
    reference = _run(model, batch)
    bound = _bound(batch)
    with _reads() as seen:
        got = _run(model, bound)
    assert (seen == []) == bound_path
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the dense mask sums in another order


class _Plain(LightningModule):
    """A module that keeps Lightning's own batch transfer."""


class _OwnTransfer(LightningModule):
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return {k: v.clone() for k, v in batch.items()}


@pytest.mark.parametrize("module, binds", [(_Plain, True), (_OwnTransfer, False), (CausalLMModule, True)])
def test_the_transfer_binds_the_moved_position_ids(module, binds):
    module = module(config=CONFIGS["llama"]) if module is CausalLMModule else module()
    strategy = MegaTrainStrategy()
    strategy._lightning_module = module
    moved = strategy.batch_to_device(COLLATE(ROWS), torch.device("cpu"))
    spans = ds.bound_spans(moved["position_ids"])
    assert (spans is not None) == binds
    if binds:
        assert spans.starts == ((0, 7, 19, 22), (0, 9, 13), (0, 20)) and spans.cu_seqlens.tolist() == [
            0, 7, 19, 22, 24, 33, 37, 48, 68, 72]
    padded = {**COLLATE(ROWS), "attention_mask": torch.ones(3, 24, dtype=torch.long)}
    assert ds.bound_spans(strategy.batch_to_device(padded, torch.device("cpu"))["position_ids"]) is None


def _right_padded_batch() -> dict:
    ids = torch.randint(3, 100, (3, 16), generator=torch.Generator().manual_seed(1))  # [3, 16]
    mask = (torch.arange(16) < torch.tensor([[16], [11], [5]])).long()  # rows of 16, 11 and 5 tokens, then padding
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_right_padded_batch_runs_causal_only_and_reads_nothing_from_the_device(arch, transformers_finds):
    module = CausalLMModule(config=CONFIGS[arch])
    module.configure_model()
    prepared = module.on_before_batch_transfer(_right_padded_batch(), 0)
    assert prepared[ds.CAUSAL_ONLY] is True and torch.equal(prepared["position_ids"], torch.arange(16).expand(3, 16))
    batch = module.transfer_batch_to_device(prepared, torch.device("cpu"), 0)
    with _reads() as seen:
        loss, _ = module._loss(batch)
        loss.backward()
    assert seen == [] and transformers_finds == []
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    masked, _ = module._loss({**batch, ds.CAUSAL_ONLY: False})  # the mask read: the same loss, the same gradients
    masked.backward()
    torch.testing.assert_close(loss, masked, rtol=1e-6, atol=0)
    for grad, p in zip(grads, module.parameters()):
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-7)


def test_the_mask_stays_where_it_is_not_right_padding_or_labels_train_after_padding():
    module = CausalLMModule(config=CONFIGS["llama"])
    module.configure_model()
    batch = _right_padded_batch()
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    assert ds.CAUSAL_ONLY not in module.on_before_batch_transfer(left, 0)
    given = {**batch, "position_ids": torch.arange(16).expand(3, 16)}  # the batch's own position_ids are kept as given
    assert ds.CAUSAL_ONLY not in module.on_before_batch_transfer(given, 0)
    # labels that train the padding (HF-style labels = input_ids): those targets are predicted from padding queries
    trained = {**batch, "labels": batch["input_ids"].clone()}
    assert ds.CAUSAL_ONLY not in module.on_before_batch_transfer(trained, 0)
    # the first padding position's label is predicted from the last real token: no padding query reads it
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[1, 11] = 7
    assert module.on_before_batch_transfer({**batch, "labels": labels}, 0)[ds.CAUSAL_ONLY] is True


def test_the_router_loss_is_the_same_without_the_padding_mask():
    torch.manual_seed(0)
    module = CausalLMModule(config=with_router_aux(families.mixtral()).to_dict())
    module.configure_model()
    prepared = module.on_before_batch_transfer(_right_padded_batch(), 0)
    assert module.router_aux is not None and prepared[ds.CAUSAL_ONLY] is True
    batch = module.transfer_batch_to_device(prepared, torch.device("cpu"), 0)
    with torch.no_grad():
        causal = module._loss_terms(batch, router_aux=True)
        masked = module._loss_terms({**batch, ds.CAUSAL_ONLY: False}, router_aux=True)
    torch.testing.assert_close(causal[0], masked[0], rtol=1e-6, atol=0)  # the LM loss
    torch.testing.assert_close(causal[2], masked[2], rtol=1e-6, atol=0)  # the router loss, over real tokens only
