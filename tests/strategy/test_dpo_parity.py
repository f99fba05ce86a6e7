"""DPO through ``Trainer(strategy="megatrain")`` against plain Lightning (``"auto"``) on the CPU: the reference
log-probabilities computed through each strategy, every micro-batch's loss, every gradient and the final weights."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_megatrain import MegaTrainStrategy

from helpers.parity import Recorder, assert_records_close
from helpers.preference import TINY_CONFIG, FusedAdamDPO, fit_dpo

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*",
                                        "ignore:.*smaller than the logging interval.*")


def _record(strategy, folder, **module_kwargs):
    recorder = Recorder()
    module, _ = fit_dpo(strategy, folder, module=FusedAdamDPO(config=TINY_CONFIG, **module_kwargs),
                        callbacks=[recorder], accumulate_grad_batches=2, gradient_clip_val=1.0)
    recorder.record.accumulate = 2
    return module, recorder.record


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_dpo_under_megatrain_matches_plain_lightning(loss_type, tmp_path):
    mega, mega_record = _record(MegaTrainStrategy(cpu_adam="torch"), tmp_path, loss_type=loss_type)
    plain, plain_record = _record("auto", tmp_path, loss_type=loss_type)
    assert len(mega_record.grads) == 2  # optimizer steps, each of 2 micro-batches
    assert_records_close(mega_record, plain_record, rtol=1e-5)
    if loss_type == "simpo":
        assert mega.reference_logps == plain.reference_logps == {}
        return
    assert set(mega.reference_logps) == {"train", "val"} and mega.reference_logps["train"].shape == (16, 2)
    for split, table in plain.reference_logps.items():
        torch.testing.assert_close(mega.reference_logps[split], table, rtol=1e-6, atol=0)
    # before the first update the policy is the reference: each pair's DPO loss is log 2 (the record holds each
    # micro-batch's loss over the 2 accumulated), whichever pairs the shuffled batches bring
    for loss in mega_record.losses[:2]:
        assert loss * 2 == pytest.approx(math.log(2), rel=1e-6)
    assert abs(mega_record.losses[-1] * 2 - math.log(2)) > 1e-4  # and after it, it is not
