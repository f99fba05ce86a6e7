"""CUDA: recompute segments, nested ones and device checkpoints ([Note: recompute segments]) give bitwise the results
of one offloaded checkpoint per layer, eager and compiled, with clipping and accumulation.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _module():
    return ParityLM("llama_untied")


@pytest.mark.parametrize("compile_layers", [False, True])
@pytest.mark.parametrize(("segment_layers", "device_checkpoints", "sub_segment_layers"),
                         [(2, 0, 1), (3, 1, 1), (1, 2, 1), (3, 1, 2)])  # the last nested: layer 0 replayed twice
def test_segments_and_device_checkpoints_equal_one_checkpoint_per_layer(compile_layers, segment_layers,
                                                                         device_checkpoints, sub_segment_layers):
    kw = {"steps": 2, "accumulate": 2, "clip": 0.05, "precision": "bf16-mixed"}
    base, _ = fit_cuda(gpu_strategy(keep_layers=0, compile_layers=compile_layers, cpu_adam="torch"), _module, **kw)
    got, _ = fit_cuda(
        gpu_strategy(keep_layers=0, compile_layers=compile_layers, cpu_adam="torch", segment_layers=segment_layers,
                     device_checkpoints=device_checkpoints, sub_segment_layers=sub_segment_layers),
        _module,
        **kw,
    )
    assert got.losses == base.losses
    for step, (ga, gb) in enumerate(zip(got.grads, base.grads)):
        for name in gb:
            assert (ga[name] is None) == (gb[name] is None), (step, name)
            assert gb[name] is None or torch.equal(ga[name], gb[name]), (step, name)
    for name, p in base.params.items():
        assert torch.equal(got.params[name], p), name
