"""CUDA: DPO under ``strategy="megatrain"`` against plain Lightning on the GPU, and with the engine's defaults.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.gpu import gpu_strategy
from helpers.parity import Recorder, assert_records_close
from helpers.preference import TINY_CONFIG, FusedAdamDPO, fit_dpo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _initial_weights(folder: Path) -> str:
    """The tiny Llama, initialised on the host from a fixed seed, saved as an HF folder: both runs load these weights.
    With ``config=`` each would initialise inside its strategy's init context, plain Lightning's on the GPU with the
    CUDA generator (other weights than the host's), which made the first step's gradients disagree by 140% while
    both losses were log 2 (policy = reference)."""
    path = folder / "initial"
    if not path.exists():
        torch.manual_seed(0)
        config = AutoConfig.for_model(**TINY_CONFIG)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def _record(strategy, folder, precision="32-true", **module_kwargs):
    recorder = Recorder()
    module = FusedAdamDPO(model=_initial_weights(folder), **module_kwargs)
    module, _ = fit_dpo(strategy, folder, module=module,
                        callbacks=[recorder], accelerator="cuda", precision=precision, accumulate_grad_batches=2,
                        gradient_clip_val=1.0)
    recorder.record.accumulate = 2
    return module, recorder.record


def test_dpo_on_the_gpu_matches_plain_lightning(tmp_path):
    # the reference pass streams the layers through the slots; parity at the GPU tests' 1e-4
    mega, mega_record = _record(gpu_strategy(cpu_adam="torch"), tmp_path)
    plain, plain_record = _record("auto", tmp_path)
    assert_records_close(mega_record, plain_record, rtol=1e-4)
    for split, table in plain.reference_logps.items():
        torch.testing.assert_close(mega.reference_logps[split], table, rtol=1e-5, atol=1e-4)
    assert mega_record.losses[0] * 2 == pytest.approx(math.log(2), rel=1e-5)


def test_dpo_with_the_defaults_in_bf16(tmp_path):
    # compiled layers (a no-grad graph for the reference pass, a grad graph for training), the overlapped step and
    # the planned device groups: before the first update the loss is log 2 up to bf16 rounding of the two graphs
    module, record = _record("megatrain", tmp_path, precision="bf16-mixed")
    assert all(table.isfinite().all() for table in module.reference_logps.values())
    assert record.losses[0] * 2 == pytest.approx(math.log(2), abs=1e-2)
    assert all(math.isfinite(loss) for loss in record.losses)
