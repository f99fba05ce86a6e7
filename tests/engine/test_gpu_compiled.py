"""CUDA: compiled layers (engine/streamed.py, [Note: compiled layers]) against plain GPU training.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# compile_layers (engine/streamed.py, [Note: compiled layers]) on the GPU, kept and recomputed layers, with and
# without device groups: inductor reorders fp32 arithmetic, so 1e-4 on the first step and 1e-3 after (a wrong
# mask or a missed grad is ~1e-1).
@pytest.mark.parametrize(
    ("family", "keep", "groups", "accumulate", "clip"),
    [("llama_untied", 1, 2, 2, 1.0), ("mixtral", "auto", 0, 1, None)],
)
def test_cuda_compiled_layers_parity(family, keep, groups, accumulate, clip):
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = fit_cuda("auto", lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    torch._dynamo.reset()
    counters.clear()
    strategy = gpu_strategy(cpu_adam="torch", keep_layers=keep, gpu_optimizer_groups=groups, compile_layers=True)
    got, _ = fit_cuda(strategy, lambda: ParityLM(family), accumulate=accumulate, clip=clip)
    assert counters["stats"]["unique_graphs"] >= 2
    assert_records_close(got, ref, rtol=1e-4, rtol_updated=1e-3)
