"""lightning_megatrain._hardware: the /proc readers and this machine's sizes (Linux, CPU)."""

from __future__ import annotations

from lightning_megatrain._hardware import GIB, cpu_cores, host_ram_gib, host_rss_gib, meminfo_bytes


def test_host_rss_is_read_from_procfs():
    rss = host_rss_gib()
    assert rss is not None and 0 < rss < 1024
    assert host_rss_gib("VmHWM") >= rss  # the high-water mark
    assert host_rss_gib("NoSuchField") is None


def test_meminfo_and_host_ram():
    total, available = meminfo_bytes("MemTotal"), meminfo_bytes("MemAvailable")
    assert 0 < available <= total
    assert host_ram_gib() == total / GIB
    assert meminfo_bytes("NoSuchField") is None
    assert cpu_cores() >= 1


def test_readers_say_none_without_procfs(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError(args[0])

    monkeypatch.setattr("builtins.open", missing)
    assert meminfo_bytes("MemTotal") is None and host_ram_gib() is None and host_rss_gib() is None
