"""CUDA: a packed batch whose documents the transfer bound ([Note: host document spans] in models/document_spans.py)
runs forward and backward through a ``packed_sdpa`` model without a device sync, under
``torch.cuda.set_sync_debug_mode("error")``; the same batch unbound syncs (the control that shows the check bites).

Skipped without CUDA (CI); run on the GPU machine with
``MEGATRAIN_FAILURE_LOG=failures.txt python -m pytest -m gpu tests/models/test_gpu_packed_sync.py`` (the log gets each
failure's exception as it happens, tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_megatrain.data.collate import PackedCollator
from lightning_megatrain.models import CausalLMModule
from lightning_megatrain.models import document_spans as ds
from lightning_megatrain.models import packed_attention as pa

from helpers.packing import CONFIGS, document

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS = [[document(70, 1), document(120, 2), document(30, 3)], [document(90, 4), document(40, 5)], [document(200, 6)]]
COLLATE = PackedCollator(pad_token_id=0, pad_to_multiple_of=64)  # rows of 256 tokens, with padding tails
CUDA = torch.device("cuda")
LONGER = {"max_position_embeddings": 256}  # positions up to 199
SYNC = "called a synchronizing CUDA operation"  # torch's error under set_sync_debug_mode("error")


@contextlib.contextmanager
def _syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _moved(bind: bool) -> dict[str, torch.Tensor]:
    """The batch moved as Lightning moves it (non-blocking), its documents bound on the way or not."""
    batch = COLLATE(ROWS)
    move = lambda b: move_data_to_device(b, CUDA)  # noqa: E731
    return ds.transfer_binding_spans(batch, move) if bind else move(batch)


def test_the_device_check_of_bound_spans_launches_without_a_sync():
    """The check ``packed_sdpa`` makes of bound spans (``torch._assert_async`` with ``_SPANS_DISAGREE``) launches on
    CUDA without a sync; a message of ``DEVICE_ASSERT_MESSAGE_LIMIT`` bytes or more is refused on the host before
    any launch (the limit of torch's CUDA kernel, which the CPU one does not have)."""
    agree = torch.ones((), dtype=torch.bool, device=CUDA)  # []
    with _syncs_raise():
        torch._assert_async(agree, pa._SPANS_DISAGREE)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="Message length must be smaller than"):
        torch._assert_async(agree, "x" * pa.DEVICE_ASSERT_MESSAGE_LIMIT)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # SDPA per document; one flash varlen call
def test_a_bound_packed_batch_runs_forward_and_backward_without_a_sync(arch, dtype, monkeypatch):
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**CONFIGS[arch], **LONGER})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=pa.PACKED_SDPA).to(CUDA)
    varlen_calls = []
    varlen = pa._varlen_attn
    monkeypatch.setattr(pa, "_varlen_attn", lambda *args, **kwargs: varlen_calls.append(1) or varlen(*args, **kwargs))

    def run(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logits.float().square().mean().backward()

    run(_moved(bind=True))  # warm-up: lazy CUDA initialisation (handles, workspaces) may sync once
    bound = _moved(bind=True)
    with _syncs_raise():
        run(bound)
    torch.cuda.synchronize()  # also surfaces a failed device-side check of the spans
    assert bool(varlen_calls) == (dtype is torch.bfloat16 and varlen is not None)
    unbound = _moved(bind=False)
    with pytest.raises(RuntimeError, match=SYNC), _syncs_raise():
        run(unbound)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_causal_lm_module_loss_on_a_packed_batch_runs_without_a_sync(arch):
    """``CausalLMModule``'s own transfer binds the documents, and its chunked loss counts targets on the host: its
    training forward and backward on a packed batch in bf16 make no sync."""
    torch.manual_seed(0)
    module = CausalLMModule(config={**CONFIGS[arch], **LONGER})
    module.configure_model()
    module.to(CUDA)

    def run(strict: bool) -> torch.Tensor:
        batch = module.transfer_batch_to_device(module.on_before_batch_transfer(COLLATE(ROWS), 0), CUDA, 0)
        with _syncs_raise() if strict else contextlib.nullcontext(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = module._loss(batch)
            loss.backward()
        return loss

    run(strict=False)  # warm-up: lazy CUDA initialisation may sync once
    assert torch.isfinite(run(strict=True))
