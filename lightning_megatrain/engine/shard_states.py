"""Optimizer state over ranks: the optimizer stepping this rank's pieces, and the sharded checkpoint format.

[Note: checkpoints of several ranks]
A checkpoint saved by N > 1 ranks is N + 1 files (``MegaTrainStrategy.save_checkpoint``):

- ``<path>`` (rank 0, as Lightning writes it): the ``state_dict`` without the decoder layers' parameters (the
  residents and buffers, which every rank holds whole: engine/sharding.py, [Note: sharded host state]), a manifest
  of the layers' parameters under ``PARAMS`` (``{"format", "world_size", "shapes": {name: shape}, "shards",
  "saved_at"}``), the loops, callbacks and LR schedulers, and for each optimizer a
  *manifest* in place of torch's state dict: ``{"format": FORMAT, "world_size": N, "param_groups": [each group's
  hyperparameters, with "params" the parameters' qualified names], "shards": [the N shard file names]}``.
- ``<path>-shard<r>-of-<N>`` (rank r): ``{"optimizer_states": [per optimizer {name: [[start, end, state]]}],
  "state_dict": {name: [[start, end, {"master": values}]]}}``: for each parameter rank r owns part of, the flat element
  range ``[start, end)`` of the parameter and that range's optimizer state (per-element tensors 1D over the range,
  ``step`` and other scalars as they are), and for each layer parameter its owned fp32 master values
  ([Note: sharded layer masters] in engine/sharded_layers.py).

Each file is swapped in atomically on its own, and no barrier orders them: rank 0 may write ``<path>`` before another
rank has replaced its shard file of the previous save of that name. The manifests and every shard file record the
(epoch, global step) saved at, and a load refuses a shard file of another save (``"last"`` then falls back to an
older checkpoint whose files agree: checkpoint_io.py, [Note: resuming from a readable checkpoint]). A barrier after
the files (``RankStrategy.save_checkpoint``) marks the save complete on every rank; the strategy keeps the last such
path of the run.

After an exception no checkpoint is saved (``RankStrategy.save_checkpoint`` warns instead, naming the run's last
complete checkpoint, or the one it resumed from): Lightning's ``OnExceptionCheckpoint`` saves on the ranks that
handle an exception, typically the one that raised, while the others are inside a collective or past the failed
step; a checkpoint with some ranks' shard files, or files of two positions, never loads. A rank handling an exception
cannot coordinate the others (any collective could wait for a rank that never gets there), so it skips the save and
the barriers (``RankStrategy.barrier``) and ends; the others' collectives then fail and they end too. With one rank
the exception-time save is as in Lightning.

Resuming, every rank loads the same checkpoint: rank 0's choice among ``"last"``'s candidates, the newest that loads
on every rank (checkpoint_io.py, [Note: resuming from a readable checkpoint]).

Loading (:func:`load_shard_files`, then :func:`state_for`) maps either format onto the optimizer as it is now: every
rank reads the manifest and all shard files (memory-mapped: only the ranges it needs are read) and assembles, for
each of its own pieces (or whole parameters, with one rank), the state of exactly that range; an ordinary checkpoint
(one rank, or plain Lightning) is the same with one range per parameter. So a checkpoint of N ranks resumes on M
ranks for any M, and on one. The layers' masters load the same way (:func:`load_params`: each rank its own ranges;
:func:`whole_params` on one rank, the layers whole). Assumes per-element optimizer states (Adam, AdamW, SGD):
every state tensor of a parameter's shape, except ``step``, is per element.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_megatrain.optim.compact_adam import CompactAdamW
from lightning_megatrain.optim.host_optimizer import load_host_state
from lightning_megatrain.optim.muon import Muon

if TYPE_CHECKING:
    from lightning_megatrain.engine.sharding import ShardedState

FORMAT = "megatrain-sharded-1"
PARAMS = "megatrain_sharded_params"  # the checkpoint's manifest of the sharded layers' masters

Slices = dict[str, list[list[Any]]]  # parameter name -> [[start, end, state of that element range]]
KeyOf = Callable[[Tensor], tuple[str, int, int, torch.Size]]  # optimizer param -> (name, start, end, state shape)


def shard_optimizer(optimizer: torch.optim.Optimizer, state: ShardedState) -> None:
    """Make ``optimizer`` step this rank's pieces: each param group's parameters replaced by their pieces (same
    group, same hyperparameters; engine/sharding.py, [Note: sharded host state]).

    Raises:
        ValueError: an optimizer whose update is not elementwise (Muon's orthogonalised matrices, CompactAdamW's
            blocks), or one that has stepped already.
    """
    if isinstance(optimizer, (Muon, CompactAdamW)):
        raise ValueError(
            f"MegaTrainStrategy with {state.ranks.world} ranks steps each rank's shard of the flat parameters, which "
            f"cuts matrices into 1D pieces; {type(optimizer).__name__} needs whole matrices or blocks. HINT: use "
            "torch.optim.AdamW (or another elementwise optimizer), or devices=1."
        )
    if any(optimizer.state.values()):
        raise ValueError(f"{type(optimizer).__name__} has optimizer state before setup: shard it before it steps.")
    pieces: dict[int, list[Tensor]] = {}
    for shard in state.shards:
        for piece, k, start in zip(shard.owned.params, shard.piece_param, shard.piece_start):
            p = shard.group.params[k]
            pieces.setdefault(id(p), []).append(piece)
            state.piece_keys[id(piece)] = (state.names[id(p)], start, start + piece.numel(), piece.shape)
    layout = []
    for group in optimizer.param_groups:
        layout.append([state.names[id(p)] for p in group["params"]])
        group["params"] = [piece for p in group["params"] for piece in pieces.get(id(p), [])]
    state.layouts[id(optimizer)] = layout


def sharded_state(optimizer: torch.optim.Optimizer, state: ShardedState) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state in the sharded format: the manifest's fields and the slices."""
    slices: Slices = {}
    for group in optimizer.param_groups:
        for piece in group["params"]:
            entry = optimizer.state.get(piece)
            if entry:
                name, start, end, _ = state.piece_keys[id(piece)]
                slices.setdefault(name, []).append([start, end, {k: _cpu(v) for k, v in entry.items()}])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(optimizer.param_groups, state.layouts[id(optimizer)])]
    return {"format": FORMAT, "world_size": state.ranks.world, "param_groups": groups, "slices": slices}


def _cpu(v: Any) -> Any:
    return v.detach().cpu() if isinstance(v, Tensor) else v


def shard_path(path: str | os.PathLike, rank: int, world: int) -> str:
    """The file rank ``rank`` of ``world`` writes beside the checkpoint ``path``."""
    return f"{os.fspath(path)}-shard{rank}-of-{world}"


def sharded_params(state: ShardedState) -> dict[str, Any]:
    """This rank's owned masters of the sharded layers for its shard file: ``{"world_size": N, "shapes": {name:
    shape}, "slices": {name: [[start, end, {"master": values}]]}}`` (each range copied: a view would save the whole
    owned master once per parameter)."""
    slices: Slices = {}
    shapes = {}
    for shard in state.shards:
        if not shard.sharded:
            continue
        for p in shard.group.params:
            shapes[state.names[id(p)]] = list(p.shape)
        for piece, k, start in zip(shard.owned.params, shard.piece_param, shard.piece_start):
            name = state.names[id(shard.group.params[k])]
            slices.setdefault(name, []).append([start, start + piece.numel(), {"master": piece.detach().clone()}])
    return {"world_size": state.ranks.world, "shapes": shapes, "slices": slices}


def split_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike,
                     params: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what rank 0 writes at ``path``, what this rank writes at its shard path): the optimizer states' slices and
    ``params`` (:func:`sharded_params`: the sharded layers' owned masters) move to the shard file, their manifests
    stay (see [Note: checkpoints of several ranks])."""
    states = checkpoint.get("optimizer_states", [])
    if params is None and not any(isinstance(s, dict) and s.get("format") == FORMAT for s in states):
        return checkpoint, {}
    manifests, slices = [], []
    saved_at = _saved_at(checkpoint)
    for s in states:
        if not (isinstance(s, dict) and s.get("format") == FORMAT):
            manifests.append(s)
            slices.append({})
            continue
        world = s["world_size"]
        names = [Path(shard_path(path, r, world)).name for r in range(world)]
        manifests.append({"format": FORMAT, "world_size": world, "param_groups": s["param_groups"], "shards": names,
                          "saved_at": saved_at})
        slices.append(s["slices"])
    main, shard = {**checkpoint, "optimizer_states": manifests}, {"optimizer_states": slices, "saved_at": saved_at}
    if params is not None:
        world = params["world_size"]
        names = [Path(shard_path(path, r, world)).name for r in range(world)]
        main[PARAMS] = {"format": FORMAT, "world_size": world, "shapes": params["shapes"], "shards": names,
                        "saved_at": saved_at}
        shard["state_dict"] = params["slices"]
    return main, shard


def _saved_at(checkpoint: dict[str, Any]) -> list[Any]:
    """The training position a checkpoint was saved at, written into its manifests and every shard file: a shard
    file of another save (a save interrupted between the ranks' files, which no barrier orders) is refused."""
    return [checkpoint.get("epoch"), checkpoint.get("global_step")]


def load_shard_files(checkpoint: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """``checkpoint`` with each sharded optimizer manifest, and the sharded layers' manifest (``PARAMS``), given the
    slices of every shard file beside ``path`` (memory-mapped).

    Raises:
        FileNotFoundError: a shard file is missing, named with the fix.
        ValueError: a shard file of another save.
    """
    states = checkpoint.get("optimizer_states", [])
    if PARAMS not in checkpoint and not any(isinstance(s, dict) and s.get("format") == FORMAT for s in states):
        return checkpoint
    files: dict[str, dict] = {}
    merged = []
    for i, s in enumerate(states):
        if not (isinstance(s, dict) and s.get("format") == FORMAT):
            merged.append(s)
            continue
        slices: Slices = {}
        for file in _shard_files(s, path, files):
            for param, ranges in file["optimizer_states"][i].items():
                slices.setdefault(param, []).extend(ranges)
        merged.append({**s, "slices": slices})
    out = {**checkpoint, "optimizer_states": merged}
    if PARAMS in checkpoint:
        params: Slices = {}
        for file in _shard_files(checkpoint[PARAMS], path, files):
            for param, ranges in file["state_dict"].items():
                params.setdefault(param, []).extend(ranges)
        out[PARAMS] = {**checkpoint[PARAMS], "slices": params}
    return out


def _shard_files(manifest: dict[str, Any], path: str | os.PathLike, files: dict[str, dict]) -> list[dict]:
    """The shard files a manifest names, loaded once each into ``files`` (memory-mapped) and checked."""
    directory = Path(os.fspath(path)).parent
    out = []
    for name in manifest["shards"]:
        if name not in files:
            file = directory / name
            if not file.is_file():
                raise FileNotFoundError(
                    f"The checkpoint {path} was saved by {manifest['world_size']} ranks and needs its shard file "
                    f"{file}, which is missing. HINT: copy every '<checkpoint>-shard<r>-of-<N>' file along with it."
                )
            files[name] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            at = files[name].get("saved_at")
            if "saved_at" in manifest and at != manifest["saved_at"]:  # checkpoints saved before the field have neither
                raise ValueError(
                    f"The checkpoint {path} was saved at (epoch, global_step) {tuple(manifest['saved_at'])}, its shard "
                    f"file {file} at {tuple(at) if at else 'an unknown step'}: it is from another save (one "
                    "interrupted between the ranks' files, or a file copied from elsewhere). HINT: resume from "
                    "another checkpoint; ckpt_path='last' falls back to the newest one whose files agree."
                )
        out.append(files[name])
    return out


def whole_params(checkpoint: dict[str, Any]) -> dict[str, Tensor]:
    """The sharded layers' parameters of a checkpoint saved by several ranks, whole, by name (for a load on one rank:
    they are not in its ``state_dict``); empty for any other checkpoint."""
    manifest = checkpoint.get(PARAMS)
    if manifest is None:
        return {}
    return {name: _master_range(manifest, name, 0, torch.Size(shape).numel(), torch.Size(shape))
            for name, shape in manifest["shapes"].items()}


def _master_range(manifest: dict[str, Any], name: str, start: int, end: int, shape: torch.Size) -> Tensor:
    """Elements ``[start, end)`` of parameter ``name`` from the shard files' slices, shaped ``shape``.

    Raises:
        ValueError: the shard files do not cover the range.
    """
    values = _assemble(manifest["slices"].get(name, []), name, start, end, shape).get("master")
    if values is None:
        raise ValueError(f"The checkpoint's shard files hold no values of '{name}' [{start}, {end}). HINT: copy every "
                         "'<checkpoint>-shard<r>-of-<N>' file of the same save along with it.")
    return values


def load_module_state(module: nn.Module, checkpoint: dict[str, Any], state: ShardedState | None,
                      strict: bool = True) -> dict[str, Any]:
    """With several ranks (``state``): load the sharded layers' owned masters (:func:`load_params`) and return the
    checkpoint whose ``state_dict`` holds the rest (residents, buffers) and loads with ``strict=False``; with one
    rank, a checkpoint of several ranks gets its layers whole (:func:`whole_params`).

    Raises:
        RuntimeError: ``strict`` and a sharded parameter is in neither the shard files nor the ``state_dict``.
    """
    if state is None:
        return {**checkpoint, "state_dict": {**checkpoint["state_dict"], **whole_params(checkpoint)}}
    names = sharded_names(module, state)
    rest = {k: v for k, v in checkpoint["state_dict"].items() if k not in names}
    missing = load_params(state, checkpoint)
    expected = set(module.state_dict()) - names
    missing |= expected - set(rest)
    unexpected = set(rest) - expected
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                           f"{sorted(missing)[:5]}, unexpected keys {sorted(unexpected)[:5]}")
    return {**checkpoint, "state_dict": rest}


def sharded_names(module: nn.Module, state: ShardedState) -> set[str]:
    """Every name (aliases too) of the parameters whose masters are sharded: not in a rank's ``state_dict`` of a
    checkpoint ([Note: sharded layer masters])."""
    ids = {id(p) for p in state.sharded_params}
    return {name for name, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}


def load_params(state: ShardedState, checkpoint: dict[str, Any]) -> set[str]:
    """Copy this rank's elements of every sharded layer's parameters from ``checkpoint`` into its owned masters: from
    the shard files' slices (saved by any number of ranks) or the whole tensors of its ``state_dict`` (one rank,
    plain Lightning; a mapped tensor reads only the range). Returns the names of this rank's pieces found in
    neither."""
    manifest = checkpoint.get(PARAMS)
    state_dict = checkpoint["state_dict"]
    missing = set()
    for shard in state.shards:
        if not shard.sharded:
            continue
        for piece, k, start in zip(shard.owned.params, shard.piece_param, shard.piece_start):
            p = shard.group.params[k]
            name, end = state.names[id(p)], start + piece.numel()
            if manifest is not None and name in manifest["shapes"]:
                values = _master_range(manifest, name, start, end, piece.shape)
            elif name in state_dict:
                values = state_dict[name].reshape(-1)[start:end]
            else:
                missing.add(name)
                continue
            piece.detach().copy_(values)
    return missing


def standard_slices(state_dict: dict[str, Any], layout: list[list[str]], shapes: dict[str, torch.Size]) -> Slices:
    """A torch optimizer state dict (one rank, plain Lightning) as slices: one range per parameter, by name."""
    slices: Slices = {}
    for group, names in zip(state_dict["param_groups"], layout):
        for index, name in zip(group["params"], names):
            entry = state_dict["state"].get(index)
            if entry:
                shape = shapes[name]
                flat = {k: v.reshape(-1) if _per_element(k, v, shape) else v for k, v in entry.items()}
                slices[name] = [[0, shape.numel(), flat]]
    return slices


def _per_element(key: str, value: Any, shape: torch.Size) -> bool:
    return isinstance(value, Tensor) and key != "step" and value.shape == shape


def state_for(optimizer: torch.optim.Optimizer, saved: dict[str, Any], slices: Slices, key_of: KeyOf) -> dict:
    """A torch state dict for ``optimizer`` as it is now: for each of its parameters (``key_of``: name, element range
    and shape), the state of that range assembled from ``slices``; the hyperparameters of ``saved`` (a manifest or a
    torch state dict).

    Raises:
        ValueError: the checkpoint's optimizer has other param groups, or its ranges do not cover a parameter.
    """
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's {type(optimizer).__name__} has {len(saved['param_groups'])} param groups, this run's "
            f"has {len(optimizer.param_groups)}. HINT: configure_optimizers must build the same groups."
        )
    groups, states, index = [], {}, 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        indices = []
        for p in group["params"]:
            name, start, end, shape = key_of(p)
            assembled = _assemble(slices.get(name, []), name, start, end, shape)
            if assembled:
                states[index] = assembled
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": states, "param_groups": groups}


def _assemble(ranges: list[list[Any]], name: str, start: int, end: int, shape: torch.Size) -> dict[str, Any]:
    """The state of elements ``[start, end)`` of parameter ``name`` from its saved ranges ({} when it has none)."""
    parts = sorted((r for r in ranges if r[0] < end and r[1] > start), key=lambda r: r[0])
    if not parts:
        return {}
    covered = start
    for s, e, _ in parts:
        if s > covered:
            break
        covered = max(covered, e)
    if parts[0][0] > start or covered < end:
        raise ValueError(
            f"The checkpoint's optimizer state of '{name}' covers {[(s, e) for s, e, _ in parts]}, not the elements "
            f"[{start}, {end}) this rank owns. HINT: a shard file is from another save; save again."
        )
    out: dict[str, Any] = {}
    for key, first in parts[0][2].items():
        if isinstance(first, Tensor) and key != "step" and first.dim() == 1:
            chunks, at = [], start
            for s, e, st in parts:
                if e <= at:
                    continue
                chunks.append(st[key][at - s : min(e, end) - s])
                at = min(e, end)
            out[key] = torch.cat(chunks).reshape(shape).clone()
        else:
            out[key] = first.clone() if isinstance(first, Tensor) else first
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], layout: list[list[str]] | None,
                         shapes: dict[str, torch.Size], key_of: KeyOf) -> dict[str, Any]:
    """The torch state dict that loads ``saved`` (a manifest with its slices, or a torch state dict) into ``optimizer``
    as it is now; ``layout``: the parameter names of each of its groups before sharding (None: no sharding, then a
    torch state dict loads as it is)."""
    if saved.get("format") == FORMAT:
        return state_for(optimizer, saved, saved["slices"], key_of)
    if layout is None:
        return saved
    return state_for(optimizer, saved, standard_slices(saved, layout, shapes), key_of)


def whole_parameter_key(module: nn.Module) -> KeyOf:
    """One rank's optimizer parameters are the module's: each the whole element range of its name."""
    names = {id(p): name for name, p in module.named_parameters()}
    return lambda p: (names[id(p)], 0, p.numel(), p.shape)


def load_optimizer_states(optimizers: Sequence[torch.optim.Optimizer], states: Sequence[dict[str, Any]],
                          sharding: ShardedState | None, module: nn.Module) -> None:
    """Load a checkpoint's ``states`` into the host ``optimizers`` (the strategy's ``load_optimizer_state_dict``):
    this rank's pieces with several ranks (``sharding``), the whole parameters of ``module`` with one; saved by any
    number of ranks, and also by another host Adam or plain Lightning (``load_host_state``)."""
    for optimizer, state in zip(optimizers, states):
        state = sharding.load_state(optimizer, state) if sharding is not None else load_optimizer_state(
            optimizer, state, None, {}, whole_parameter_key(module)
        )
        load_host_state(optimizer, state)  # also from a checkpoint of another host Adam or plain Lightning
