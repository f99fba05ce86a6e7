"""MegaTrainPrecision: the precision flags MegaTrainStrategy maps and refuses, the plugin outside the strategy, and
bf16-mixed on the CPU against plain bf16 training."""

from __future__ import annotations

import pytest
import torch

from lightning_megatrain import MegaTrainPrecision, MegaTrainStrategy

from helpers.parity import ParityLM, run
from helpers.trainers import cpu_trainer


@pytest.mark.parametrize(
    ("flag", "expected"), [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-mixed")]
)
def test_precision_mapping(flag, expected):
    if flag == "bf16-true":
        with pytest.warns(UserWarning, match="runs as 'bf16-mixed'"):
            trainer = cpu_trainer(strategy="megatrain", precision=flag)
    else:
        trainer = cpu_trainer(strategy="megatrain", precision=flag)
    assert isinstance(trainer.strategy.precision_plugin, MegaTrainPrecision)
    assert trainer.strategy.precision_plugin.precision == expected


def test_unsupported_precision_is_refused():
    with pytest.raises(TypeError, match="supports precision='bf16-mixed', '32-true'"):
        cpu_trainer(strategy="megatrain", precision="64-true")
    with pytest.raises(ValueError, match="is not supported"):
        MegaTrainPrecision("16-mixed")


def test_precision_without_the_strategy_is_refused():
    # the plugin translates Lightning's hooks into engine calls: the engine comes from MegaTrainStrategy's setup only
    with pytest.raises(RuntimeError, match=r"MegaTrainPrecision has no engine(.|\n)*strategy='megatrain'"):
        MegaTrainPrecision("32-true", "cpu").engine
    trainer = cpu_trainer(strategy="auto", plugins=[MegaTrainPrecision("32-true", "cpu")])
    with pytest.raises(RuntimeError, match=r"works only under MegaTrainStrategy"):
        trainer.fit(ParityLM("llama_tied"))


def test_bf16_mixed_on_cpu_tracks_plain_bf16():
    ref = run("auto", "llama_tied", precision="bf16-mixed")
    got = run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", precision="bf16-mixed")
    # bf16 weights inside the layers (plain autocast keeps fp32 norm weights): close, not equal.
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=2e-2, atol=0)
