"""Fixtures for every test."""

from __future__ import annotations

import functools
import logging

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
