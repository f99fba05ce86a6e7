"""Mapped checkpoint tensors (lightning_megatrain/mapped.py, [Note: mapped checkpoint tensors]): read into their
destination through the mapping a chunk at a time, each chunk's pages released; the file format loads mapped; the
loaded optimizer states go into memory of their own, or wait for ``gpu_optimizer_groups="auto"``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_megatrain import mapped, sharded_checkpoint
from lightning_megatrain.checkpoint_io import AtomicCheckpointIO
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import MegaTrainEngine
from lightning_megatrain.engine.device_state import settle_states
from lightning_megatrain.optim.updates import host_state_bytes
from lightning_megatrain.sharded_checkpoint import read_safetensors, write_safetensors

from helpers.host_ram import MEASURABLE, reset_peak, status_bytes

MIB = 2**20
LINUX_RSS = pytest.mark.skipif(not MEASURABLE or mapped._madvise is None, reason="needs Linux's /proc and madvise")


def _mapped_file(tmp_path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    write_safetensors(tmp_path / "t.safetensors", list(tensors.items()))
    return read_safetensors(tmp_path / "t.safetensors")


@LINUX_RSS
def test_a_mapped_tensor_is_read_a_chunk_at_a_time_and_its_pages_leave_the_process(tmp_path):
    src = torch.randn(16 * MIB // 4, generator=torch.Generator().manual_seed(0))
    loaded = _mapped_file(tmp_path, {"w": src})["w"]
    assert mapped.is_mapped(loaded)
    dst = torch.zeros_like(src)
    before = status_bytes("RssFile")
    mapped.copy_released(loaded, dst)
    assert torch.equal(dst, src)
    assert status_bytes("RssFile") - before < 2 * MIB  # released chunk by chunk
    dst.zero_()
    dst.copy_(loaded)  # the same copy without releasing: the measurement sees the mapped pages
    assert status_bytes("RssFile") - before > 15 * MIB


@LINUX_RSS
def test_a_read_raises_the_peak_rss_by_one_chunk_not_the_tensor(tmp_path):
    """The peak rises by the chunk and the pages the kernel maps around a fault (4.0 MiB measured for 1 MiB chunks,
    the same for 32 and 128 MiB tensors), not by the 64 MiB tensor."""
    loaded = _mapped_file(tmp_path, {"w": torch.ones(64 * MIB // 4)})["w"]
    dst = torch.zeros(loaded.shape)
    dst.fill_(2.0)  # its pages in the RSS before the measurement
    before = reset_peak()
    mapped.copy_released(loaded, dst)
    extra = status_bytes("VmHWM") - before
    assert torch.equal(dst, torch.ones_like(dst))
    assert extra < mapped.CHUNK_BYTES + 7 * MIB, extra / MIB


def test_a_write_in_place_is_read_and_a_neighbours_shared_page_is_kept(tmp_path):
    # 1000 fp32 = 4000 bytes each: the two tensors share a page
    loaded = _mapped_file(tmp_path, {"a": torch.zeros(1000), "b": torch.zeros(1000)})
    loaded["a"][:10] = 1.0  # a hook changing the loaded tensors in place
    loaded["b"][:] = 2.0
    dst = torch.empty(1000)
    mapped.copy_released(loaded["a"], dst)
    assert dst[:10].eq(1.0).all() and dst[10:].eq(0.0).all()
    assert loaded["b"].eq(2.0).all()  # its bytes on the page it shares with "a" were not dropped


def test_own_and_owned_copy_mapped_tensors_only(tmp_path):
    loaded = _mapped_file(tmp_path, {"exp_avg": torch.arange(8.0), "step": torch.tensor(3.0)})
    plain = torch.ones(2)
    state = mapped.owned({0: {"exp_avg": loaded["exp_avg"], "step": loaded["step"], "other": plain}})
    assert state[0]["other"] is plain
    assert not mapped.is_mapped(state[0]["exp_avg"]) and torch.equal(state[0]["exp_avg"], torch.arange(8.0))
    assert state[0]["exp_avg"].data_ptr() != loaded["exp_avg"].data_ptr()
    assert mapped.any_mapped({"exp_avg": loaded["exp_avg"]}) and not mapped.any_mapped(state[0])


def test_read_into_fills_the_masters_in_place_and_points_the_entry_at_them(tmp_path):
    loaded = _mapped_file(tmp_path, {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)})
    masters = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float64)}  # b: another dtype, left alone
    state_dict = dict(loaded)
    mapped.read_into(state_dict, masters)
    assert state_dict["w"] is masters["w"] and torch.equal(masters["w"], torch.arange(6.0).reshape(2, 3))
    assert state_dict["b"] is loaded["b"] and masters["b"].eq(0).all()


def _checkpoint() -> dict:
    state_dict = {"layer.weight": torch.randn(4, 4), "head.weight": torch.randn(2, 4)}
    state = {"step": torch.tensor(2.0), "exp_avg": torch.randn(4, 4), "exp_avg_sq": torch.rand(4, 4)}
    optimizer = {"state": {0: state}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}
    return {"state_dict": state_dict, "optimizer_states": [optimizer], "callbacks": {"best": torch.tensor(0.5)},
            "global_step": 2}


def test_the_file_format_loads_mapped_and_copies_only_the_small_tensors(tmp_path):
    saved = _checkpoint()
    AtomicCheckpointIO().save_checkpoint(saved, tmp_path / "c.ckpt")
    loaded = AtomicCheckpointIO().load_checkpoint(tmp_path / "c.ckpt")
    for name, t in loaded["state_dict"].items():
        assert mapped.is_mapped(t) and torch.equal(t, saved["state_dict"][name])
    state = loaded["optimizer_states"][0]["state"][0]
    assert all(mapped.is_mapped(t) for t in state.values())
    assert torch.equal(state["exp_avg"], saved["optimizer_states"][0]["state"][0]["exp_avg"])
    best = loaded["callbacks"]["best"]  # kept after the restore: must not keep the file mapped
    assert not mapped.is_mapped(best) and best.item() == 0.5
    assert loaded["global_step"] == 2
    # Lightning's own checkpoint IO reads the same file
    plain = TorchCheckpointIO().load_checkpoint(tmp_path / "c.ckpt")
    assert torch.equal(plain["state_dict"]["head.weight"], saved["state_dict"]["head.weight"])


def test_a_map_location_or_a_legacy_file_loads_as_lightning_does(tmp_path):
    torch.save(_checkpoint(), tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    loaded = AtomicCheckpointIO().load_checkpoint(tmp_path / "legacy.ckpt", weights_only=False)
    assert not mapped.is_mapped(loaded["state_dict"]["layer.weight"])
    AtomicCheckpointIO().save_checkpoint(_checkpoint(), tmp_path / "c.ckpt")
    loaded = AtomicCheckpointIO().load_checkpoint(tmp_path / "c.ckpt", map_location=lambda s, loc: s)
    assert not mapped.is_mapped(loaded["state_dict"]["layer.weight"])


def _optimizer_with_mapped_state(tmp_path):
    params = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(2, 4))]
    optimizer = torch.optim.AdamW(params)
    AtomicCheckpointIO().save_checkpoint(_checkpoint(), tmp_path / "c.ckpt")
    loaded = AtomicCheckpointIO().load_checkpoint(tmp_path / "c.ckpt")
    optimizer.load_state_dict(loaded["optimizer_states"][0])
    return optimizer, params


def test_loaded_states_count_as_to_come_until_read_into_memory_of_their_own(tmp_path):
    optimizer, params = _optimizer_with_mapped_state(tmp_path)
    held = frozenset(id(p) for p in params)
    assert mapped.any_mapped(optimizer.state[params[0]])
    assert host_state_bytes([optimizer], held) == 8 * (16 + 8)  # the loaded one is not in memory yet
    settle_states(optimizer, [])
    state = optimizer.state[params[0]]
    assert not mapped.any_mapped(state) and float(state["step"]) == 2.0
    assert host_state_bytes([optimizer], held) == 8 * 8  # the parameter without a saved state


def test_the_engine_settles_loaded_states_once_auto_device_groups_are_decided(tmp_path):
    optimizer, params = _optimizer_with_mapped_state(tmp_path)
    engine = MegaTrainEngine(torch.nn.Linear(1, 1), torch.device("cpu"), torch.float32,
                             EngineConfig(gpu_optimizer_groups="auto"))
    engine.settle_loaded_states([optimizer])  # undecided: the states stay mapped, none read into host memory
    assert mapped.any_mapped(optimizer.state[params[0]])
    engine.config = engine.config.replace(gpu_optimizer_groups=0)  # what place_for_batch decides
    engine.settle_loaded_states(engine._unsettled)
    assert not mapped.any_mapped(optimizer.state[params[0]]) and not engine._unsettled


@pytest.mark.skipif(not MEASURABLE, reason="needs Linux's /proc/self/clear_refs")
def test_a_gpu_tensor_is_written_through_one_staging_buffer(tmp_path, monkeypatch):
    # a host tensor taken for a device one (no GPU here): the writer's staging path, bytes and peak host memory
    tensor = torch.randn(64 * MIB // 4, generator=torch.Generator().manual_seed(0))
    direct = write_safetensors(tmp_path / "direct.safetensors", [("t", tensor)])
    monkeypatch.setattr(sharded_checkpoint, "in_host_memory", lambda t: False)
    before = reset_peak()
    staged = write_safetensors(tmp_path / "staged.safetensors", [("t", tensor)])
    extra = status_bytes("VmHWM") - before
    assert staged == direct
    assert (tmp_path / "staged.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()
    assert extra < sharded_checkpoint.STAGING_BYTES + 2 * MIB, extra / MIB
