"""Fixtures for every test, and the failure log of GPU runs."""

from __future__ import annotations

import functools
import logging
import os

import pytest


@pytest.fixture(autouse=True)
def _package_logs_reach_caplog():
    """The package logger stops propagating when it is imported before any root handler exists (as at collection,
    before pytest's capture handler): let its records reach the root, where ``caplog`` listens."""
    logger = logging.getLogger("lightning_megatrain")
    propagate, logger.propagate = logger.propagate, True
    yield
    logger.propagate = propagate


@pytest.fixture
def fast_cpuinfo(monkeypatch):
    """``cpuinfo.get_cpu_info`` (2 s of subprocesses, which every ``DeepSpeedCPUAdam`` calls) run once per test."""
    cpuinfo = pytest.importorskip("cpuinfo")
    monkeypatch.setattr(cpuinfo, "get_cpu_info", functools.lru_cache(cpuinfo.get_cpu_info))


@pytest.fixture
def transformers_finds(monkeypatch):
    """Calls of transformers' own ``find_packed_sequence_indices``, the path that reads packed rows' document starts
    from the device (models/document_spans.py binds them on the host instead)."""
    from lightning_megatrain.models import document_spans

    calls = []
    original = document_spans._transformers_find
    monkeypatch.setattr(document_spans, "_transformers_find",
                        lambda position_ids: calls.append(1) or original(position_ids))
    return calls


def pytest_runtest_logreport(report):
    """With ``MEGATRAIN_FAILURE_LOG`` set, each failed test's error (with its traceback) is appended to that file as
    soon as the test fails: a GPU run cut before pytest's summary still leaves the exception texts."""
    path = os.environ.get("MEGATRAIN_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
