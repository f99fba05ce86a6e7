"""The sharding mechanism without processes: shards and pieces, the options and optimizers several ranks refuse, and
the sharded checkpoint format's assembly and errors (engine/sharding.py, engine/shard_states.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.collectives import Ranks
from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.host_store import check_packed, pack_group
from lightning_megatrain.engine.shard_states import (
    FORMAT,
    PARAMS,
    load_module_state,
    load_optimizer_state,
    load_shard_files,
    shard_optimizer,
    shard_path,
    sharded_params,
    split_checkpoint,
    state_for,
    whole_params,
)
from lightning_megatrain.engine.sharded_step import ShardedOptimizerStep
from lightning_megatrain.engine.sharding import ShardedState, sharded_config
from lightning_megatrain.engine.transfer import HostTransfer
from lightning_megatrain.optim import Muon


def _state(rank: int, world: int, module: nn.Module, whole: bool = True) -> ShardedState:
    """``module`` as one flat group on rank ``rank`` of ``world``: kept whole (as the residents) or sharded (as a
    layer)."""
    group = pack_group(tensor_slots(module))
    names = {id(p): n for n, p in module.named_parameters()}
    return ShardedState([group], Ranks(rank, world), None, names, whole=[group] if whole else [])


def _layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))  # 12 + 3 + 3 + 3 = 21 parameters


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("world", [2, 4, 5])
def test_pieces_cover_every_parameter_once(world, whole):
    """Over the ranks, the pieces tile every parameter exactly with its values; the padding is zero. A whole group's
    pieces are views of its padded master, which the parameters view; a sharded group's rank holds only its owned
    master ``[S]``, and the parameters are NaN placeholders that refuse writes ([Note: sharded layer masters])."""
    seen: dict[str, list[tuple[int, int]]] = {}
    size = -(-21 // world)
    for rank in range(world):
        module = _layer()
        values = {n: p.detach().clone() for n, p in module.named_parameters()}
        state = _state(rank, world, module, whole)
        shard = state.shards[0]
        assert shard.sharded is not whole and shard.owned.master.numel() == size
        if whole:
            assert shard.padded.numel() == world * size and not shard.padded[21:].any()
        else:
            assert not shard.owned.master[max(0, 21 - rank * size):].any()
            assert state.host_bytes()["masters"] == 4 * size  # this rank's share only
            assert all(p.isnan().all() and p.untyped_storage().nbytes() == 4 for p in module.parameters())
            with pytest.raises(RuntimeError, match="more than one element"):
                module[0].weight.detach().copy_(torch.zeros(3, 4))
            check_packed([shard.group], module)  # placeholders count as packed
        for piece, k, start in zip(shard.owned.params, shard.piece_param, shard.piece_start):
            p = shard.group.params[k]
            name = state.names[id(p)]
            if whole:
                assert piece.data_ptr() == p.data_ptr() + start * 4  # the piece is the parameter's elements
            torch.testing.assert_close(piece.detach(), values[name].reshape(-1)[start : start + piece.numel()])
            seen.setdefault(name, []).append((start, start + piece.numel()))
    for name, p in _layer().named_parameters():
        ranges = sorted(seen[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_sharded_masters_resume_on_another_world(tmp_path):
    """The sharded masters saved by 2 ranks load on 3 (each rank its range), on one (whole, ``whole_params``), and a
    one-rank ``state_dict`` loads on 3; a missing parameter or shard range is refused by name."""
    values = {n: p.detach().clone() for n, p in _layer().named_parameters()}
    path = tmp_path / "x.ckpt"
    for rank in range(2):
        state = _state(rank, 2, _layer(), whole=False)
        main, shard = split_checkpoint({"epoch": 0, "global_step": 1, "state_dict": {}}, path, sharded_params(state))
        torch.save(shard, shard_path(path, rank, 2))
    assert main[PARAMS]["world_size"] == 2 and "slices" not in main[PARAMS]
    loaded = load_shard_files(main, path)
    torch.testing.assert_close(whole_params(loaded), values)
    for source in (loaded, {"state_dict": values}):
        for rank in range(3):
            module = _layer()
            state = _state(rank, 3, module, whole=False)
            state.shards[0].owned.master.zero_()
            rest = load_module_state(module, source, state)
            assert rest["state_dict"] == {}
            for piece, k, start in zip(state.shards[0].owned.params, state.shards[0].piece_param,
                                       state.shards[0].piece_start):
                name = state.names[id(state.shards[0].group.params[k])]
                torch.testing.assert_close(piece.detach(), values[name].reshape(-1)[start : start + piece.numel()])
    module = _layer()
    with pytest.raises(RuntimeError, match=r"missing keys \['0.weight'\]"):
        load_module_state(module, {"state_dict": {}}, _state(0, 2, module, whole=False))
    gap = {**loaded, PARAMS: {**loaded[PARAMS], "slices": {}}}
    with pytest.raises(ValueError, match=r"no values of '0.weight' \[0, 12\)(.|\n)*copy every"):
        whole_params(gap)


def test_options_several_ranks_refuse():
    with pytest.raises(ValueError,
                       match=r"with 2 ranks(.|\n)*update_during_backward=True(.|\n)*gpu_optimizer_groups=1"):
        sharded_config(EngineConfig(update_during_backward=True, gpu_optimizer_groups=1), 2)
    with pytest.raises(ValueError, match=r"with 4 ranks(.|\n)*host_state='int8_moments'(.|\n)*host_state='fp32'"):
        sharded_config(EngineConfig(host_state="int8_moments"), 4)
    with pytest.raises(ValueError, match=r"checkpoint_format='sharded'(.|\n)*checkpoint_format='file'"):
        sharded_config(EngineConfig(checkpoint_format="sharded"), 2)
    with pytest.raises(ValueError, match=r"with 2 ranks(.|\n)*update_during_backward=True: each rank steps its shard"):
        sharded_config(EngineConfig(update_during_backward=True), 2)
    settled = sharded_config(EngineConfig(), 2)
    assert settled.gpu_optimizer_groups == 0
    # each rank's host step overlaps the next forward ([Note: sharded host state]): "auto" is resolved as for one
    assert settled.overlap_optimizer == "auto"
    assert sharded_config(EngineConfig(overlap_optimizer=True), 2).overlap_optimizer is True
    assert settled.update_during_backward is False
    # decided alike on every rank: a per-rank "auto" would pair one rank's gather with another's reduce-scatter
    assert (settled.keep_layers, settled.segment_layers) == (0, 1)
    given = sharded_config(EngineConfig(keep_layers=3, segment_layers=2), 2)
    assert (given.keep_layers, given.segment_layers) == (3, 2)


def test_non_elementwise_optimizer_refused():
    module = _layer()
    state = _state(0, 2, module)
    with pytest.raises(ValueError, match=r"2 ranks(.|\n)*Muon needs whole matrices(.|\n)*AdamW"):
        shard_optimizer(Muon([{"params": [module[0].weight], "use_muon": True}]), state)


def test_partial_clipping_refused(monkeypatch):
    module = _layer()
    state = _state(0, 2, module)
    monkeypatch.setattr(state.ranks, "all_reduce_", lambda t, op=None: t)  # rank 1 agrees (test_ranks.py: both run)
    step = ShardedOptimizerStep(state, None, EngineConfig(), torch.device("cpu"),
                                HostTransfer([state.shards[0].group], torch.float32), None)
    with pytest.raises(RuntimeError, match=r"several ranks clips(.|\n)*one optimizer over self.parameters"):
        step.clip_grad_norm_([torch.zeros(3, requires_grad=True)], 1.0)


def _saved_adam(module: nn.Module, world: int) -> dict:
    """What ``world`` ranks would save for AdamW over ``module`` after one step with grads = 1: manifest and slices."""
    slices: dict = {}
    for rank in range(world):
        copy = _layer()
        state = _state(rank, world, copy)
        optimizer = torch.optim.AdamW(copy.parameters(), lr=0.1)
        shard_optimizer(optimizer, state)
        for piece in optimizer.param_groups[0]["params"]:
            piece.grad = torch.arange(piece.numel(), dtype=torch.float32) + 1
        optimizer.step()
        own = state.optimizer_state(optimizer)
        for name, ranges in own["slices"].items():
            slices.setdefault(name, []).extend(ranges)
    return {**own, "slices": slices}


def test_state_of_four_ranks_assembles_for_one_and_three():
    """A parameter's state assembled from 4 ranks' slices equals, element by element, the slices; reassembled for
    3 ranks' pieces it equals the same elements."""
    saved = _saved_adam(_layer(), 4)
    assert saved["format"] == FORMAT and saved["world_size"] == 4
    module = _layer()
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    whole = state_for(optimizer, saved, saved["slices"], lambda p: (names[id(p)], 0, p.numel(), p.shape))
    weight = whole["state"][0]["exp_avg"]
    assert weight.shape == (3, 4)
    for start, end, piece_state in saved["slices"]["0.weight"]:
        torch.testing.assert_close(weight.reshape(-1)[start:end], piece_state["exp_avg"], rtol=0, atol=0)
    for rank in range(3):
        copy = _layer()
        state = _state(rank, 3, copy)
        three = torch.optim.AdamW(copy.parameters(), lr=0.1)
        shard_optimizer(three, state)
        loaded = state.load_state(three, saved)
        for index, piece in enumerate(three.param_groups[0]["params"]):
            name, start, end, _ = state.piece_keys[id(piece)]
            want = whole["state"][[n for n in names.values()].index(name)]["exp_avg"].reshape(-1)[start:end]
            torch.testing.assert_close(loaded["state"][index]["exp_avg"], want, rtol=0, atol=0)
            assert float(loaded["state"][index]["step"]) == 1.0
    # an ordinary torch state dict (one rank) maps onto pieces the same way
    plain = {"state": whole["state"], "param_groups": [{**saved["param_groups"][0], "params": [0, 1, 2, 3]}]}
    copy = _layer()
    state = _state(1, 3, copy)
    three = torch.optim.AdamW(copy.parameters(), lr=0.1)
    shard_optimizer(three, state)
    from_plain = state.load_state(three, plain)
    from_sharded = state.load_state(three, saved)
    for index in from_sharded["state"]:
        torch.testing.assert_close(from_plain["state"][index], from_sharded["state"][index], rtol=0, atol=0)


def test_checkpoint_errors(tmp_path):
    saved = _saved_adam(_layer(), 2)
    module = _layer()
    names = {id(p): n for n, p in module.named_parameters()}
    key = lambda p: (names[id(p)], 0, p.numel(), p.shape)  # noqa: E731
    two_groups = torch.optim.AdamW([{"params": [module[0].weight]}, {"params": [module[0].bias]}])
    with pytest.raises(ValueError, match=r"has 1 param groups, this run's has 2"):
        load_optimizer_state(two_groups, saved, None, {}, key)
    optimizer = torch.optim.AdamW(module.parameters())
    gap = {**saved, "slices": {**saved["slices"], "0.weight": saved["slices"]["0.weight"][1:]}}
    with pytest.raises(ValueError, match=r"'0.weight' covers \[\(11, 12\)\], not the elements \[0, 12\)"):
        load_optimizer_state(optimizer, gap, None, {}, key)
    manifest = {"format": FORMAT, "world_size": 2, "param_groups": saved["param_groups"],
                "shards": ["x.ckpt-shard0-of-2", "x.ckpt-shard1-of-2"]}
    with pytest.raises(FileNotFoundError, match=r"saved by 2 ranks(.|\n)*x.ckpt-shard0-of-2(.|\n)*copy every"):
        load_shard_files({"optimizer_states": [manifest]}, tmp_path / "x.ckpt")


def test_a_shard_file_of_another_save_is_refused(tmp_path):
    """Rank 0 writes the checkpoint after its own shard file, with no barrier before: a save interrupted there leaves
    the new checkpoint beside another rank's shard file of the previous save of that name. Loading it is refused
    (its Adam moments and step counts would be a step behind the weights), not assembled silently."""
    saved = _saved_adam(_layer(), 2)
    path = tmp_path / "last.ckpt"
    for step in (4, 5):
        for rank in range(2):  # (both ranks write every slice here: only the files' agreement matters)
            main, shard = split_checkpoint({"global_step": step, "epoch": 0, "optimizer_states": [saved]}, path)
            if not (step == 5 and rank == 1):  # the kill: rank 1's shard file of step 5 never replaced step 4's
                torch.save(shard, shard_path(path, rank, 2))
        torch.save(main, path)
    main = torch.load(path, weights_only=True)
    with pytest.raises(ValueError, match=r"saved at \(epoch, global_step\) \(0, 5\), its shard file "
                                         r".*last\.ckpt-shard1-of-2 at \(0, 4\): it is from another save"):
        load_shard_files(main, path)
    torch.save(split_checkpoint({"global_step": 5, "epoch": 0, "optimizer_states": [saved]}, path)[1],
               shard_path(path, 1, 2))
    assert load_shard_files(main, path)["optimizer_states"][0]["slices"]


def _mixed() -> nn.Module:
    """Sizes that keep alignment and sizes that do not, interleaved: the flat layout puts the 16- and 32-element
    parameters first ([Note: aligned views] in engine/host_store.py), not in the module's order."""
    torch.manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in ((3,), (4, 4), (5,), (32,)))


def test_sharded_pieces_and_resume_follow_the_aligned_layout(tmp_path):
    """With the layout reordered, the pieces of 3 ranks still tile each parameter with its own values, and masters
    saved by 2 ranks load on 3 and whole by name."""
    values = {n: p.detach().clone() for n, p in _mixed().named_parameters()}
    assert [p.numel() for p in _state(0, 3, _mixed()).shards[0].group.params] == [16, 32, 3, 5]
    seen: dict[str, list[tuple[int, int]]] = {}
    for rank in range(3):
        state = _state(rank, 3, _mixed(), whole=False)
        shard = state.shards[0]
        for piece, k, start in zip(shard.owned.params, shard.piece_param, shard.piece_start):
            name = state.names[id(shard.group.params[k])]
            torch.testing.assert_close(piece.detach(), values[name].reshape(-1)[start : start + piece.numel()])
            seen.setdefault(name, []).append((start, start + piece.numel()))
    assert {n: (min(r)[0], max(r)[1]) for n, r in seen.items()} == {n: (0, v.numel()) for n, v in values.items()}
    path = tmp_path / "x.ckpt"
    for rank in range(2):
        state = _state(rank, 2, _mixed(), whole=False)
        main, shard = split_checkpoint({"epoch": 0, "global_step": 1, "state_dict": {}}, path, sharded_params(state))
        torch.save(shard, shard_path(path, rank, 2))
    torch.testing.assert_close(whole_params(load_shard_files(main, path)), values)


def test_the_last_ranks_short_share_drains_through_a_slab():
    """The last rank's pieces end before its share's padding (21 parameters on 4 ranks: S = 6, rank 3 owns 3). The
    CUDA drain lands a layer's mean through a slab when the layer's previous drain is still queued (engine/drain.py
    ``add_packed``): the packed grads are then shorter than the owned grad, both when the owned grads start empty
    (a copy) and when they accumulate (an add); the padding stays zero."""
    from lightning_megatrain.engine.drain import add_packed

    owned = _state(3, 4, _layer(), whole=False).shards[0].owned
    n = sum(p.numel() for p in owned.params)
    assert (n, owned.numel) == (3, 6)
    slab = torch.arange(1.0, 9.0)  # [8]: a slab is as long as the largest share, longer than this one
    add_packed(owned, [True] * len(owned.params), slab)
    torch.testing.assert_close(owned.grad, torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0]), rtol=0, atol=0)
    add_packed(owned, [True] * len(owned.params), slab)
    torch.testing.assert_close(owned.grad, torch.tensor([2.0, 4.0, 6.0, 0.0, 0.0, 0.0]), rtol=0, atol=0)
    assert all(p.grad is not None for p in owned.params)


def test_device_residents_are_reduced_from_their_grads_not_drained(monkeypatch):
    """On CUDA the residents' grads are reduce-scattered from the compute copies' grads and never drained whole to
    the host (engine/sharded_step.py ``_reduce_residents``). With a stand-in for the CUDA residents (its ``grads()``
    the copies' grads, its drain refused) on one rank of one, finalizing puts the grads in the owned grads, in the
    flat layout, and clears the copies' grads."""
    module = _layer()
    state = _state(0, 1, module)
    monkeypatch.setattr(state.ranks, "all_reduce_", lambda t, op=None: t)
    monkeypatch.setattr(state.ranks, "reduce_scatter", lambda padded: padded.clone())  # one rank: its share is all
    group = state.shards[0].group
    grads = [torch.full_like(p, k + 1.0) for k, p in enumerate(group.params)]

    class DeviceResidents:
        cleared = False

        def grads(self):
            return grads

        def clear_grads(self):
            self.cleared = True

        def drain(self, wait=True):
            raise AssertionError("the residents' grads were drained whole")

    residents = DeviceResidents()
    step = ShardedOptimizerStep(state, group, EngineConfig(), torch.device("cpu"),
                                HostTransfer([group], torch.float32), residents)
    step.finalize_gradients()
    owned = state.shards[0].owned
    want = torch.zeros(group.numel)
    for g, offset in zip(grads, group.offsets):
        want[offset : offset + g.numel()] = g.reshape(-1)
    torch.testing.assert_close(owned.grad[: group.numel], want, rtol=0, atol=0)
    assert residents.cleared and all(p.grad is None for p in group.params)
