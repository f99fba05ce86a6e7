"""CUDA: sequence tiles ([Note: sequence tiles]) give the untiled engine's results, eager and compiled, with
accumulation and clipping, on a dense and an MoE family.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("compile_layers", [False, True])
@pytest.mark.parametrize("family", ["llama_untied", "qwen3_moe"])
def test_tiles_equal_untiled_on_cuda(family, compile_layers):
    kw = {"steps": 2, "accumulate": 2, "clip": 0.05, "precision": "32-true"}
    options = {"keep_layers": 0, "compile_layers": compile_layers, "cpu_adam": "torch"}
    untiled, _ = fit_cuda(gpu_strategy(seq_tile=None, **options), lambda: ParityLM(family), **kw)
    tiled, _ = fit_cuda(gpu_strategy(seq_tile=4, **options), lambda: ParityLM(family), **kw)  # 16 positions: 4 tiles
    # a 4-position tile's matmuls (the MLP's, and q/k/v's since the norm before attention is folded) run other
    # kernels, eager and compiled, which sum in another order; Adam's first steps turn those last-bit grad
    # differences into update differences where |grad| ~ sqrt(v) (measured on the H200: qwen3_moe's post-step
    # weights within 1.4e-4 compiled, 1.03e-4 eager at o_proj; its grads within 1e-4)
    assert_records_close(tiled, untiled, rtol=1e-4, rtol_updated=5e-4)
