"""[Note: device states at teardown] (engine/device_state.py): the optimizer states held outside host memory are
hidden from Lightning's teardown copy where they exceed the host memory still free, and put back afterwards. Meta
tensors stand in for the GPU's: copying one to the host raises, so a copy that reaches them fails the test."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device

from lightning_megatrain.engine.device_state import device_states_kept


def _optimizer():
    on_host, on_device = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([on_host, on_device])
    optimizer.state[on_host] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    meta = {"exp_avg": torch.empty(8, device="meta"), "exp_avg_sq": torch.empty(8, device="meta")}
    optimizer.state[on_device] = {"step": torch.empty((), device="meta"), **meta}
    return optimizer, on_device, meta


@pytest.mark.parametrize("announce", [True, False])
def test_states_the_host_cannot_take_stay_where_they_are(caplog, announce):
    optimizer, on_device, meta = _optimizer()
    caplog.set_level(logging.INFO, logger="lightning_megatrain")
    with device_states_kept([optimizer], host_free=63, announce=announce):  # the meta moments take 64 bytes
        assert on_device not in optimizer.state
        _optimizers_to_device([optimizer], torch.device("cpu"))  # what Lightning's teardown runs
    assert optimizer.state[on_device]["exp_avg"] is meta["exp_avg"]
    assert optimizer.state[on_device]["exp_avg_sq"] is meta["exp_avg_sq"]
    said = [r.getMessage() for r in caplog.records if "stay on the GPU" in r.getMessage()]
    assert len(said) == announce


@pytest.mark.parametrize("host_free", [64, None])
def test_states_the_host_can_take_or_an_unknown_host_are_left_to_lightning(host_free):
    optimizer, on_device, _ = _optimizer()
    with device_states_kept([optimizer], host_free=host_free):
        assert on_device in optimizer.state
        with pytest.raises(NotImplementedError, match="meta"):
            _optimizers_to_device([optimizer], torch.device("cpu"))


def test_the_states_come_back_when_the_teardown_raises():
    optimizer, on_device, meta = _optimizer()
    with pytest.raises(RuntimeError, match="teardown failed"), device_states_kept([optimizer], host_free=0):
        raise RuntimeError("teardown failed")
    assert optimizer.state[on_device]["exp_avg"] is meta["exp_avg"]


@pytest.mark.parametrize("host_short", [True, False])
def test_the_strategy_teardown_keeps_what_the_host_cannot_take(monkeypatch, host_short):
    """The strategy's teardown goes through the hiding: a meta state put into the optimizer at train end (standing in
    for a device group's moments, which need CUDA) survives fit where the host is short; where it is not, Lightning's
    copy reaches it and raises."""
    import lightning as L

    import lightning_megatrain.strategy as strategy_module

    from helpers.parity import run

    if host_short:
        monkeypatch.setattr(strategy_module, "placeable_host_bytes", lambda: (0, "test"))

    class Plant(L.Callback):
        def on_train_end(self, trainer, pl_module):
            Plant.optimizer = trainer.optimizers[0]
            Plant.param = next(iter(pl_module.parameters()))
            Plant.meta = torch.empty(8, device="meta")
            Plant.optimizer.state[Plant.param]["exp_avg"] = Plant.meta

    if host_short:
        run("megatrain", "llama_tied", steps=1, callbacks=[Plant()])
        assert Plant.optimizer.state[Plant.param]["exp_avg"] is Plant.meta
    else:
        with pytest.raises(NotImplementedError, match="meta"):
            run("megatrain", "llama_tied", steps=1, callbacks=[Plant()])
