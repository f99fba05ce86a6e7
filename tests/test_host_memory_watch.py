"""[Note: host memory watch] (host_memory.py): one warning, with the numbers, when the machine's ``MemAvailable``
falls below the floor during fit; again only after it came back above twice the floor; the strategy runs the watch
for the length of fit."""

from __future__ import annotations

import logging
import time

import lightning as L
import pytest

from lightning_megatrain import _hardware, host_memory
from lightning_megatrain._hardware import GIB
from lightning_megatrain.host_memory import HostMemoryWatch

from helpers.parity import run


@pytest.fixture
def available(monkeypatch):
    """Set what the process may still allocate (GiB); MemTotal 128 GiB."""
    now = {"gib": 100.0}
    monkeypatch.setattr(_hardware, "meminfo_bytes", lambda field: 128 * GIB if field == "MemTotal" else None)
    monkeypatch.setattr(_hardware, "available_host_bytes", lambda: (int(now["gib"] * GIB), "MemAvailable"))
    return now


def test_one_warning_with_the_numbers_until_memory_comes_back(available, caplog):
    watch = HostMemoryWatch(lambda: {"masters": 48 * GIB, "optimizer_states": 40 * GIB, "rss": 120 * GIB})
    assert watch.floor == int(0.03 * 128 * GIB) // 2  # half the OS reserve of a 128 GiB host: 1.9 GiB
    caplog.set_level(logging.WARNING, logger="lightning_megatrain")
    for gib in (10.0, 1.5, 1.2, 3.0, 1.0):  # 3.0 is below twice the floor: not re-armed
        available["gib"] = gib
        watch.check()
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "1.5 GiB available (MemAvailable) of 128.0 GiB" in message
    assert "holds 120.0 GiB (masters 48.0, optimizer states 40.0)" in message
    available["gib"] = 4.0  # above twice the floor: armed again
    watch.check()
    available["gib"] = 1.0
    watch.check()
    assert len(caplog.records) == 2 and "1.0 GiB available" in caplog.records[1].getMessage()


def test_a_holdings_read_that_races_the_training_thread_says_the_resident_set(available, caplog, monkeypatch):
    def racing():
        raise RuntimeError("dictionary changed size during iteration")

    available["gib"] = 0.5
    monkeypatch.setattr(host_memory, "host_rss_gib", lambda: 121.0)
    caplog.set_level(logging.WARNING, logger="lightning_megatrain")
    HostMemoryWatch(racing).check()
    message = caplog.records[0].getMessage()
    assert "0.5 GiB available (MemAvailable) of 128.0 GiB" in message and "holds 121.0 GiB. If" in message


def test_the_watch_outlives_a_failed_read(available, monkeypatch):
    def broken():
        raise OSError("/proc is gone")

    monkeypatch.setattr(_hardware, "available_host_bytes", broken)
    monkeypatch.setattr(HostMemoryWatch, "PERIOD_S", 0.01)
    watch = HostMemoryWatch(dict)
    watch.start()
    time.sleep(0.1)
    assert watch.alive()
    watch.stop()
    assert not watch.alive()


def test_the_strategy_watches_during_fit_only():
    seen = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            seen.append(trainer.strategy._host_watch.alive())

        def on_fit_end(self, trainer, *_):
            Probe.strategy = trainer.strategy

    run("megatrain", "llama_tied", steps=2, callbacks=[Probe()])
    assert seen == [True, True]
    assert Probe.strategy._host_watch is None  # stopped and dropped at teardown
