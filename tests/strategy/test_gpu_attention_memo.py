"""CUDA: ``MegaTrainStrategy(attention_memo=True)`` ([Note: attention memo]) against the same strategy without it, in
bf16-mixed (SDPA's cuDNN kernel, which the memo's op calls directly): the recompute runs no attention kernel, and
losses, gradients and weights agree; eager layers and compiled ones, on a family with grouped key/value heads
(llama_tied: repeated to the query heads on CUDA).

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.memo import count_kernel_calls
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama_tied"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("memo", [True, 2], ids=["all", "last-2"])
def test_cuda_attention_memo_parity(monkeypatch, family, compiled, memo):
    """Every layer's memos, or the last 2 of 3 layers' (the first layer's recompute runs the kernel)."""
    options = dict(cpu_adam="torch", keep_layers=0, compile_layers=compiled)
    torch._dynamo.reset()
    # lr 1e-4, not ParityLM's 1e-2: AdamW moves every weight by about lr whatever its gradient's size, so at 1e-2 a
    # bf16 difference in a near-zero gradient becomes a visible weight difference. Measured on the H200 with compiled
    # layers (whose fusions around the memo's op differ from those around SDPA): first step's grads within 1%, the
    # next steps' 3-8% apart at 1e-2.
    ref, _ = fit_cuda(gpu_strategy(**options), lambda: ParityLM(family, lr=1e-4), accumulate=2, clip=1.0,
                      precision="bf16-mixed")
    calls = count_kernel_calls(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    got, _ = fit_cuda(gpu_strategy(attention_memo=memo, **options), lambda: ParityLM(family, lr=1e-4), accumulate=2,
                      clip=1.0, precision="bf16-mixed")
    layers = ParityLM(family).model.config.num_hidden_layers
    unserved = 0 if memo is True else layers - memo  # their recompute runs the kernel again
    assert calls[0] == (layers + unserved) * 2 * 3  # 3 steps of 2 micro-batches
    # a break at attention would run the compiled layer's selective checkpoint eagerly (on the H200 at 131,072 tokens
    # the memo's layers were 25% slower so): the routing's cuDNN check must trace
    assert not counters["graph_break"], dict(counters["graph_break"])
    # bf16 compute; the repeated kv heads' gradients summed in another order than cuDNN's own GQA
    assert_records_close(got, ref, rtol=1e-2)


def test_cuda_auto_memo_switched_on_at_the_first_micro_batch(monkeypatch, caplog):
    """``attention_memo="auto"`` (the default) taken at the first training micro-batch, as the engine applies it
    (engine/first_batch.py): the compiled layers are built again with the routing there, the recompute runs no
    attention kernel, no graph breaks, and training agrees with the run without the memo. The decision is stubbed
    (this small model's plan is not the point: tests/engine/test_placement.py tests the planner's rule)."""
    import logging

    from lightning_megatrain.engine import first_batch

    options = dict(cpu_adam="torch", keep_layers=0, compile_layers=True)
    torch._dynamo.reset()
    ref, _ = fit_cuda(gpu_strategy(attention_memo=False, **options), lambda: ParityLM("llama_tied", lr=1e-4),
                      accumulate=2, clip=1.0, precision="bf16-mixed")
    monkeypatch.setattr(first_batch, "choose_attention_memo", lambda *args, **kwargs: (True, "stub"))
    calls = count_kernel_calls(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.INFO, logger="lightning_megatrain"):
        got, _ = fit_cuda(gpu_strategy(attention_memo="auto", **options), lambda: ParityLM("llama_tied", lr=1e-4),
                          accumulate=2, clip=1.0, precision="bf16-mixed")
    assert "attention_memo=True (auto: stub)" in caplog.text
    assert calls[0] == ParityLM("llama_tied").model.config.num_hidden_layers * 2 * 3
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_records_close(got, ref, rtol=1e-2)
