"""Host store: flat packing, gradient accumulation semantics and the clipping helpers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.host_store import ALIGN_ELEMENTS, pack_group


def _group(*shapes):
    module = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in shapes)
    values = [p.detach().clone() for p in module]
    return pack_group(tensor_slots(module)), values


def test_pack_keeps_values_and_makes_views():
    group, values = _group((3, 4), (5,), (2, 2))
    for p, v in zip(group.params, values):
        assert torch.equal(p, v)
        assert p.untyped_storage().data_ptr() == group.master.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sizes_that_keep_alignment_are_laid_out_first(dtype):
    """[Note: aligned views]: a 4-element parameter first (gpt-oss's ``sinks`` at 4 heads) shifted every view after it
    off 16 bytes in bf16; now the parameters of a multiple of ALIGN_ELEMENTS elements come first, each kind in module
    order, so each of them starts 16-byte aligned, and every view holds its parameter's values."""
    shapes = ((4,), (16, 8), (3,), (32,), (5, 2), (64,))
    module = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in shapes)
    values = {id(p): p.detach().to(dtype) for p in module}
    group = pack_group(tensor_slots(module), master_dtype=dtype, grad_dtype=dtype)
    assert [tuple(p.shape) for p in group.params] == [(16, 8), (32,), (64,), (4,), (3,), (5, 2)]
    assert [p.numel() % ALIGN_ELEMENTS == 0 for p in group.params] == [True] * 3 + [False] * 3
    assert all(p.data_ptr() % 16 == 0 for p in group.params[:3])
    assert group.master.data_ptr() % 16 == 0 and group.params[3].data_ptr() % 16 == 0  # the first odd one too
    assert all(torch.equal(p, values[id(p)]) for p in group.params)
    assert [tuple(p.shape) for p in module.parameters()] == list(shapes)  # the module's own order is untouched
    assert sorted(id(p) for p in module.parameters()) == sorted(id(p) for p in group.params)


def test_bf16_layout_packs_bf16_views_and_takes_norms_in_fp32():
    """A compact host_state's group: the parameters become bf16 views of the master (each value rounded to nearest),
    the grads are bf16, a bf16 add rounds once, and the squared norm is accumulated in fp32 (a bf16 sum of 2,000
    squares of 1.0 would stop at 256)."""
    module = nn.ParameterList([nn.Parameter(torch.randn(2000)), nn.Parameter(torch.randn(3))])
    values = [p.detach().to(torch.bfloat16) for p in module]
    group = pack_group(tensor_slots(module), master_dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    assert group.master.dtype == group.grad.dtype == torch.bfloat16 and group.grad_dtype == torch.bfloat16
    for p, v in zip(group.params, values):
        assert p.dtype == torch.bfloat16 and torch.equal(p, v) and p.data_ptr() >= group.master.data_ptr()
    ones = [torch.ones(2000, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)]
    group.accumulate(ones)
    assert group.grad_norm_sq().dtype == torch.float32 and float(group.grad_norm_sq()) == 2003.0
    group.accumulate([torch.full((2000,), 2**-9, dtype=torch.bfloat16), None])  # 1 + 2**-9: a tie, to even
    assert torch.equal(group.params[0].grad, ones[0]) and torch.equal(group.params[1].grad, ones[1])
    assert float(group.params[0].grad.float().norm(dtype=torch.float32).square()) == 2000.0


def test_accumulate_copy_then_add_and_none_untouched():
    group, _ = _group((3, 4), (5,))
    a, b = torch.ones(3, 4), torch.full((5,), 2.0)
    group.accumulate([a, None])
    assert torch.equal(group.params[0].grad, a) and group.params[1].grad is None
    group.accumulate([a, b])
    assert torch.equal(group.params[0].grad, 2 * a) and torch.equal(group.params[1].grad, b)
    assert group.grads_are_views()


def test_lazy_grad_buffer_is_allocated_by_the_first_gradient():
    # a device group's host grads (engine/device_state.py): no memory until code reads its grads
    module = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in (6, 3))
    group = pack_group(tensor_slots(module), lazy_grad=True)
    assert group._grad is None and group.grad_norm_sq() == 0 and group._grad is None  # no grads: nothing read
    group.accumulate([torch.ones(6), None])
    assert group._grad is not None and group._grad.numel() == 9
    assert torch.equal(group.params[0].grad, torch.ones(6)) and group.params[1].grad is None
    assert group.params[0].grad.data_ptr() == group.grad.data_ptr()


def test_release_grad_drops_an_unviewed_buffer_until_a_gradient_needs_it():
    # a group placed as a device group before the first step (gpu_optimizer_groups="auto"): its host grads go back
    group, _ = _group((6,), (3,))
    assert group.grad_nbytes == 9 * 4
    freed = []
    group.release_grad(freed.append)
    assert group.grad_nbytes == 0 and len(freed) == 1 and freed[0].numel() == 9
    group.accumulate([torch.ones(6), None])  # code that reads grads gets them again
    assert group.grad_nbytes == 9 * 4 and torch.equal(group.params[0].grad, torch.ones(6))
    group.release_grad(freed.append)  # p.grad views the buffer: kept
    assert group.grad_nbytes == 9 * 4 and len(freed) == 1


def test_device_norm_stands_for_grads_the_host_does_not_hold():
    # a device group whose grads stay on the device: clipping reads the norm measured there
    module = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in (6, 3))
    group = pack_group(tensor_slots(module), lazy_grad=True)
    group.device_norm_sq = torch.tensor(7.0)
    assert group.grad_norm_sq() == 7.0 and group._grad is None
    group.accumulate([torch.ones(6), None])  # a host add after the device measured: the host pass counts
    assert torch.isclose(group.grad_norm_sq(), torch.tensor(6.0))


@pytest.mark.parametrize("shapes", [[(3, 4), (5,)], [(40, 40), (1000,)]])  # below and above the 1024-row split
def test_norm_and_scale_match_torch(shapes):
    group, _ = _group(*shapes)
    grads = [torch.randn(s) for s in shapes]
    group.accumulate([g.clone() for g in grads])
    expected = torch.stack([g.norm() for g in grads]).norm()
    torch.testing.assert_close(group.grad_norm_sq().sqrt(), expected, rtol=1e-6, atol=0)
    group.scale_grads(torch.tensor(0.5))
    for p, g in zip(group.params, grads):
        torch.testing.assert_close(p.grad, 0.5 * g)


def test_norm_skips_parameters_without_grad():
    group, _ = _group((3, 4), (5,))
    g = torch.randn(3, 4)
    group.accumulate([g, None])
    torch.testing.assert_close(group.grad_norm_sq(), g.square().sum())


def test_host_check_counts_page_locked_buffers_at_their_size(monkeypatch):
    from lightning_megatrain.engine import host_store

    gib = 1024**3
    # 1.5 GiB of fp32 per group: 2 groups x (master + grad) = 6 GiB, minus the 3 GiB model already loaded
    numels = [(3 * gib // 2) // 4] * 2
    monkeypatch.setattr(host_store, "placeable_host_bytes", lambda: (4 * gib, "MemAvailable"))
    host_store.check_host_memory(numels, pinned=True)  # 3 GiB + a few pages: no power-of-two blocks
    monkeypatch.setattr(host_store, "placeable_host_bytes", lambda: (2 * gib, "MemAvailable"))
    with pytest.raises(RuntimeError, match=r"needs about 3.0 GiB more host RAM for 0.81B parameters \(masters and "
                       r"grads: 6.0 GiB pinned(.|\n)*only 2.0 GiB is available \(MemAvailable\)"):
        host_store.check_host_memory(numels, pinned=True)
    # bf16 masters and grads (host_state="compact"): 3 GiB of flats, no more than the fp32 model already loaded
    host_store.check_host_memory(numels, pinned=True, master_bytes=2, grad_bytes=2)


def test_host_refusals_hint_only_a_smaller_state_than_the_runs(monkeypatch):
    """The setup's refusal names compact state and Muon under fp32, compact under int8_moments, neither under compact
    (it is the smallest)."""
    from lightning_megatrain.engine import host_store

    monkeypatch.setattr(host_store, "placeable_host_bytes", lambda: (1, "MemAvailable"))
    hints = {}
    for state in ("fp32", "int8_moments", "compact"):
        with pytest.raises(RuntimeError) as refused:
            host_store.check_host_memory([1 << 28], pinned=False, host_state=state)
        hints[state] = str(refused.value).split("HINT: ")[1]
        with pytest.raises(RuntimeError) as refused:
            host_store.check_host_bytes_to_come(1 << 30, state)
        assert str(refused.value).split("HINT: ")[1] == hints[state]
    assert "host_state='compact'" in hints["fp32"] and "Muon" in hints["fp32"]
    assert "host_state='compact'" in hints["int8_moments"] and "Muon" not in hints["int8_moments"]
    assert "compact" not in hints["compact"] and "Muon" not in hints["compact"]
    assert all(h.endswith("or set MEGATRAIN_SKIP_MEMORY_CHECK=1 if you know better.") for h in hints.values())


def test_host_state_check_counts_each_optimizers_state(monkeypatch):
    # once the optimizers exist: the grads not yet allocated and the states to come, by optimizer (AdamW 8 B/param,
    # Muon's matrices 4 and AdamW's 8 for the rest, SGD without momentum none), the ones already there not again
    from lightning_megatrain.engine import host_store
    from lightning_megatrain.engine.host_budget import host_bytes_to_come
    from lightning_megatrain.optim import Muon

    group, _ = _group((64, 32), (32,))
    params = group.params
    n_matrix, n = 64 * 32, 64 * 32 + 32
    grads = 4 * n - group.grad_nbytes  # the fp32 grads not allocated yet
    assert host_bytes_to_come([group], [torch.optim.AdamW(params)]) == grads + 8 * n
    muon = Muon([{"params": [params[0]], "use_muon": True}, {"params": [params[1]], "use_muon": False}])
    assert host_bytes_to_come([group], [muon]) == grads + 4 * n_matrix + 8 * 32
    assert host_bytes_to_come([group], [torch.optim.SGD(params, lr=0.1)]) == grads
    adamw = torch.optim.AdamW(params)
    adamw.state[params[0]] = {"step": torch.zeros(())}  # a state already there (a resumed one) is not counted again
    assert host_bytes_to_come([group], [adamw]) == grads + 8 * 32
    monkeypatch.setattr(host_store, "placeable_host_bytes", lambda: (grads + 4 * n_matrix + 8 * 32, "MemAvailable"))
    host_store.check_host_bytes_to_come(host_bytes_to_come([group], [muon]))  # Muon's states fit
    with pytest.raises(RuntimeError, match=r"needs about [0-9.]+ MiB more host RAM for the grads and optimizer "
                                           r"states(.|\n)*Muon(.|\n)*\(MemAvailable\)"):
        host_store.check_host_bytes_to_come(host_bytes_to_come([group], [torch.optim.AdamW(params)]))


def test_host_bound_is_the_smallest_of_meminfo_cgroup_and_rlimit(tmp_path, monkeypatch):
    import resource

    from lightning_megatrain import _hardware

    gib = 1024**3
    monkeypatch.setattr(_hardware, "meminfo_bytes", lambda field: 100 * gib)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert _hardware.available_host_bytes(tmp_path) == (100 * gib, "MemAvailable")  # no cgroup files, no rlimit
    (tmp_path / "memory.max").write_text(f"{24 * gib}\n")
    (tmp_path / "memory.current").write_text(f"{4 * gib}\n")
    assert _hardware.available_host_bytes(tmp_path) == (20 * gib, "cgroup memory.max")
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    assert _hardware.available_host_bytes(tmp_path)[1] == "MemAvailable"
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * gib, resource.RLIM_INFINITY))
    monkeypatch.setattr(_hardware, "host_rss_gib", lambda field="VmRSS": 3.0 if field == "VmSize" else None)
    assert _hardware.available_host_bytes(tmp_path) == (5 * gib, "RLIMIT_AS (ulimit -v)")


def test_placements_leave_the_host_reserve(monkeypatch):
    # [Note: host reserve]: what the engine places is MemAvailable (or the binding limit) less the planner's reserve of
    # MemTotal, max(2 GiB, 3%), and the engine's own measured slack; never negative; unknown stays unknown
    from lightning_megatrain import _hardware
    from lightning_megatrain.engine import host_budget, host_store

    gib = 1024**3
    meminfo = {"MemTotal": 128 * gib, "MemAvailable": 70 * gib}
    monkeypatch.setattr(_hardware, "meminfo_bytes", lambda field: meminfo.get(field))
    monkeypatch.setattr(_hardware, "available_host_bytes", lambda: (meminfo["MemAvailable"], "MemAvailable"))
    reserve = int(0.03 * 128 * gib) + int(_hardware.ENGINE_HOST_SLACK_GIB * gib)
    assert _hardware.placeable_host_bytes() == (70 * gib - reserve, "MemAvailable less the 9.8 GiB reserve")
    assert host_budget.placeable_host_bytes is _hardware.placeable_host_bytes  # the engine's checks read it
    assert host_store.placeable_host_bytes is _hardware.placeable_host_bytes
    meminfo.update(MemTotal=16 * gib, MemAvailable=9 * gib)  # a small host: the 2 GiB floor, and nothing left
    assert _hardware.placeable_host_bytes() == (gib, "MemAvailable less the 8.0 GiB reserve")
    meminfo.update(MemAvailable=gib)
    assert _hardware.placeable_host_bytes() == (0, "MemAvailable less the 8.0 GiB reserve")
    monkeypatch.setattr(_hardware, "available_host_bytes", lambda: None)
    assert _hardware.placeable_host_bytes() is None


def test_small_needs_print_in_mib(monkeypatch):
    from lightning_megatrain.engine import host_store

    monkeypatch.setattr(host_store, "placeable_host_bytes", lambda: (1024, "cgroup memory.max"))
    with pytest.raises(RuntimeError, match=r"needs about [1-9][0-9.]* MiB more host RAM(.|\n)*only 0.0 MiB is "
                                           r"available \(cgroup memory.max\)"):
        host_store.check_host_memory([1 << 20], pinned=False)


class _FakeCudart:
    """Records cudaHostRegister/Unregister calls (no CUDA on the test machine)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0


def test_registry_page_locks_whole_pages_of_exact_size(monkeypatch):
    from lightning_megatrain.engine.pinned import PAGE, HostRegistry

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    registry = HostRegistry()
    values = torch.arange(1000, dtype=torch.float32)
    a = registry.empty(1000, torch.float32, init=lambda t: t.copy_(values))
    b = registry.empty(3, torch.bfloat16)
    torch.testing.assert_close(a, values)
    assert b.dtype == torch.bfloat16 and b.shape == (3,) and not b.any()  # zero-filled by default
    spans = sorted(cudart.registered.items())
    assert [ptr % PAGE for ptr, _ in spans] == [0, 0]
    assert sorted(size for _, size in spans) == [PAGE, PAGE]  # 4000 and 6 bytes: one page each, not 2^k blocks
    assert {a.data_ptr(), b.data_ptr()} == set(cudart.registered)
    # regions never share a page, so each registration is independent
    (p0, s0), (p1, _) = spans
    assert p0 + s0 <= p1
    registry.release()
    assert cudart.registered == {}
    torch.testing.assert_close(a, values)  # the memory stays valid (pageable) for the parameters viewing it


def test_pack_group_with_registry_makes_parameters_views_of_locked_masters(monkeypatch):
    from lightning_megatrain.engine.pinned import HostRegistry

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    expected = [p.detach().clone() for p in module.parameters()]
    group = pack_group(tensor_slots(module), HostRegistry())
    assert set(cudart.registered) == {group.master.data_ptr(), group.grad.data_ptr()}
    for p, want in zip(module.parameters(), expected):
        torch.testing.assert_close(p.detach(), want)
        assert group.master.data_ptr() <= p.data_ptr() < group.master.data_ptr() + 4 * group.numel
