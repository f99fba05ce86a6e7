"""Several CUDA ranks (NCCL for the layers' grads, gloo for host tensors): ``MegaTrainStrategy`` with ``devices=2``
trains as plain single-GPU Lightning on the same global batch, and a 2-rank checkpoint resumes on one GPU; manual
optimization clips landed grads on one GPU and on two.

Skipped without CUDA GPUs (CI; the two-rank cases without two); on the x2 machine:
``python -m pytest -m gpu tests/strategy/test_gpu_ranks.py``.
Tolerance 1e-4 relative, as the other fp32 GPU parity tests (cuBLAS sums in another order than the CPU).
"""

from __future__ import annotations

import pytest
import torch

from helpers.ranks import fit, launch, manual_module

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
TOL = {"rtol": 1e-4, "atol": 1e-5}


@two_gpus
@pytest.mark.parametrize("options", [{}, {"keep_layers": 0, "compile_layers": False}, {"overlap_optimizer": False}])
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, 0.05)])
def test_two_gpus_train_as_one(tmp_path, options, accumulate, clip):
    runs = launch(2, tmp_path, timeout=600, start_method="spawn", accelerator="cuda", steps=3,
                  accumulate=accumulate, clip=clip, **options)
    reference = fit(1, strategy="auto", accelerator="cuda", steps=3, accumulate=accumulate, clip=clip)
    losses = torch.tensor([r.losses for r in runs]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(reference.losses), **TOL)
    for run in runs:
        for step, want in enumerate(reference.grads):
            torch.testing.assert_close(run.grads[step], {k: v.cpu() for k, v in want.items()}, **TOL)
        torch.testing.assert_close(run.params, {k: v.cpu() for k, v in reference.params.items()}, **TOL)


@two_gpus
def test_two_gpus_overlap_their_host_steps(tmp_path):
    """The overlapped host step with two ranks (the default on GPUs; engine/sharding.py, [Note: sharded host state]),
    each rank's host update slowed 50 ms per group so that the next forward's uploads wait for it: losses and final
    weights as single-GPU Lightning's. The recorder reads only losses between steps, so only the engine's gates wait
    for the worker (the grad-recording cases above wait for the whole step at every batch end)."""
    runs = launch(2, tmp_path, timeout=600, start_method="spawn", accelerator="cuda", steps=3, grads=False,
                  slow_update=0.05)
    reference = fit(1, strategy="auto", accelerator="cuda", steps=3, grads=False)
    losses = torch.tensor([r.losses for r in runs]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(reference.losses), **TOL)
    for run in runs:
        torch.testing.assert_close(run.params, {k: v.cpu() for k, v in reference.params.items()}, **TOL)


@two_gpus
def test_two_gpu_checkpoint_resumes_on_one(tmp_path):
    ckpt = tmp_path / "two.ckpt"
    saved = launch(2, tmp_path / "save", timeout=600, start_method="spawn", accelerator="cuda", steps=2,
                   grads=False, ckpt_out=str(ckpt))
    one = fit(1, accelerator="cuda", steps=3, grads=False, ckpt_in=str(ckpt))
    for name, state in saved[0].end_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(one.start_state[name][key].float(), state[key].float(), rtol=0, atol=0)


@pytest.mark.parametrize(("world", "options"), [
    (1, {}), (1, {"gpu_optimizer_groups": 0}), pytest.param(2, {}, marks=two_gpus)])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_manual_optimization_clips_landed_grads(tmp_path, world, options):
    """Manual optimization clips between ``manual_backward`` and ``optimizer.step()``, while the layers' drains may
    still be writing the host grads and the residents' grads are still on the device: clipping finalizes the grads
    first, and the step's own finalization keeps them and the clipping factor (engine/optimizer_step.py). One GPU
    with its default device groups and with the host step alone, and two ranks; against single-GPU Lightning,
    weights after two steps."""
    module = manual_module  # top-level: the spawned ranks unpickle it
    if world == 2:
        runs = launch(2, tmp_path, timeout=600, start_method="spawn", accelerator="cuda", steps=2, grads=False,
                      module=module, **options)
    else:
        runs = [fit(1, accelerator="cuda", steps=2, grads=False, module=module, **options)]
    reference = fit(1, strategy="auto", accelerator="cuda", steps=2, grads=False, module=module)
    for run in runs:
        torch.testing.assert_close(run.params, {k: v.cpu() for k, v in reference.params.items()}, **TOL)
