"""Sharded checkpoints: one directory per checkpoint, one safetensors file per decoder layer, swapped in atomically.

[Note: sharded checkpoints]
``MegaTrainStrategy(checkpoint_format="sharded")`` saves each checkpoint as a directory named as the file would be
(``last.ckpt/``, ``step5.ckpt/``), so that ``ModelCheckpoint``'s names, top-k removal and ``ckpt_path="last"`` work
unchanged. It holds:

- ``layer_00000.safetensors`` ... one per decoder layer: the layer's entries of ``state_dict`` (its fp32 masters and
  buffers) and its parameters' optimizer states (``exp_avg``, ``exp_avg_sq``, ``step``);
- ``residents.safetensors``: every other tensor of ``state_dict`` and of the optimizer states (embeddings, final
  norm, head);
- ``meta.pt``: the rest of the Lightning checkpoint (loops, callbacks, hyperparameters, optimizer ``param_groups``,
  schedulers, any other tensor), written by ``torch.save``, each sharded tensor left as ``None`` in its place;
- ``index.json``: format and version, then per shard its size in bytes and, for each tensor, the places in the
  checkpoint it fills (``["optimizer_states", 0, "state", 17, "exp_avg"]``; a tied weight fills two).

Host RAM during a save: each tensor is written from the memory it lives in (the host masters and optimizer states;
safetensors' own writer would first build the file's bytes); the save adds the index, the split dicts and
``meta.pt``'s pickle, a few hundred bytes per tensor and nothing per parameter: 2.0 MiB of peak RSS for the 78 MiB
checkpoint of a 6.8M-parameter model (tests/test_sharded_checkpoints.py). A non-contiguous tensor is copied, one at
a time (the masters are contiguous). ``gpu_optimizer_groups``' Adam states are written from the GPU through one host
staging buffer of :data:`STAGING_BYTES` (16 MiB) per shard, a piece at a time, so they add that buffer, not the 8
bytes per parameter of those groups a copy to the host took. The pages written go to the page cache, which is not
the process's memory.

Atomicity: the checkpoint is written into ``.<name>.pid<writer>@<host>.<random>.tmp`` beside the target; every file is
fsynced, the index last, then the directory. The new directory then replaces the target in one step
(checkpoint_io.py's ``swap_in``):
``renameat2(RENAME_EXCHANGE)`` swaps the two names atomically (Linux: ext4, xfs, btrfs, tmpfs), and the previous
checkpoint, now under the temporary name, is renamed ``.old`` and removed. A kill at any point leaves the target
whole, old or new. Where the exchange is refused (other systems and filesystems) the target is renamed ``.old`` and
the new one renamed in, two renames back to back: a kill between them leaves no target, the old checkpoint whole as
``.old`` and the new whole as ``.tmp`` (its index present); the next save into that directory, of any name, renames
the new one back first (:func:`recover`) once it is a killed save's as checkpoint_io.py judges it (on the writer's
own host at once, on another after 24 hours), but a resume from ``"last"`` before it does not see it. A removed
checkpoint (top-k) is renamed ``.del`` before it is deleted, so a kill never leaves half of one under its name.
Leftover ``.tmp``, ``.old`` and ``.del`` directories go as the file path's temporary files do ([Note: atomic
checkpoints] in checkpoint_io.py).

Loading (sharded_load.py): ``load_sharded`` checks each shard's size against the index (a truncated shard fails, so
``"last"`` falls back as for a file: [Note: resuming from a readable checkpoint]) and fills the checkpoint with
tensors that view the shards mapped copy-on-write, so that any hook can read them and nothing is read until used.
The strategy then reads them into place a chunk at a time, each chunk's pages released ([Note: mapped checkpoint
tensors] in mapped.py): the masters into the host masters (``load_state_dict`` finds each entry already in place),
the host groups' optimizer states into tensors of their own, which the optimizer keeps, and
``gpu_optimizer_groups``' straight into their GPU moments. Peak host RAM of a load: the kept optimizer states (8
bytes per parameter with AdamW, none for a device group) plus 1.5 MiB for the test model (a 1 MiB chunk and the
pages the kernel maps around it), as from a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from typing_extensions import override

from lightning_megatrain._hardware import umask
from lightning_megatrain.checkpoint_io import (
    AtomicCheckpointIO,
    fsync_dir,
    killed_save,
    remove_path,
    remove_stale_temporaries,
    swap_in,
    temporary_name,
    temporary_of,
    temporary_prefix,
)
from lightning_megatrain.engine.discovery import find_layer_stack
from lightning_megatrain.sharded_load import FORMAT, INDEX, SAFETENSORS_DTYPES, VERSION, is_sharded

# the loading half, importable from here as before (sharded_load.py)
from lightning_megatrain.sharded_load import convert_to_file as convert_to_file
from lightning_megatrain.sharded_load import load_any as load_any
from lightning_megatrain.sharded_load import load_either_format as load_either_format
from lightning_megatrain.sharded_load import load_sharded as load_sharded
from lightning_megatrain.sharded_load import read_safetensors as read_safetensors

META, RESIDENTS = "meta.pt", "residents"

Place = tuple[str | int, ...]  # keys from the checkpoint's root to one tensor
ShardOf = Callable[[Place], str]  # a tensor's place -> the name of its shard file (no suffix)


# - which tensors go where


def _shardable(value: Any) -> bool:
    """A dense tensor with bytes (host or GPU: ``gpu_optimizer_groups``' Adam states) of a dtype safetensors has."""
    return (type(value) in (Tensor, nn.Parameter) and value.device.type != "meta" and value.layout == torch.strided
            and value.dtype in SAFETENSORS_DTYPES)


def split(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[Place, Tensor]]]:
    """``(meta, tensors)``: the checkpoint with each tensor of ``state_dict`` and of the optimizer states set to
    ``None`` (new containers along those paths: the live optimizer state dicts are never changed), and those
    tensors with their places."""
    meta, found = dict(checkpoint), []
    state_dict = checkpoint.get("state_dict")
    if isinstance(state_dict, Mapping):
        kept: OrderedDict[str, Any] = OrderedDict()
        kept._metadata = getattr(state_dict, "_metadata", None)  # type: ignore[attr-defined]  # modules' versions
        for key, value in state_dict.items():
            if _shardable(value):
                found.append((("state_dict", key), value))
                value = None
            kept[key] = value
        meta["state_dict"] = kept
    optimizers = []
    for k, optimizer in enumerate(checkpoint.get("optimizer_states", [])):
        if not isinstance(optimizer, Mapping) or not isinstance(optimizer.get("state"), Mapping):
            optimizers.append(optimizer)
            continue
        state = {}
        for index, entries in optimizer["state"].items():
            state[index] = dict(entries)
            for name, value in entries.items():
                if _shardable(value):
                    found.append((("optimizer_states", k, "state", index, name), value))
                    state[index][name] = None
        optimizers.append({**optimizer, "state": state})
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = optimizers
    return meta, found


def layer_layout(checkpoint: Mapping[str, Any], module: nn.Module, layers: str | None,
                 optimizers: Sequence[torch.optim.Optimizer]) -> ShardOf:
    """Shard names for ``checkpoint`` of ``module``: ``layer_<i>`` for the ``state_dict`` entries under decoder layer
    ``i``'s prefix and the optimizer states of its parameters (matched through ``optimizers``' live param groups),
    ``residents`` for the rest. ``layers``: the strategy's option (the stack's dotted path, or None to discover it);
    without a stack everything is a resident."""
    layer_of_key: list[tuple[str, str]] = []
    layer_of_param: dict[int, str] = {}
    try:
        path, stack = find_layer_stack(module, layers)
    except ValueError:
        stack = []
    for i, layer in enumerate(stack):
        name = f"layer_{i:05d}"
        layer_of_key.append((f"{path}.{i}.", name))
        layer_of_param.update((id(p), name) for p in layer.parameters())
    by_index: dict[tuple[int, Any], str] = {}
    for k, (saved, optimizer) in enumerate(zip(checkpoint.get("optimizer_states", []), optimizers)):
        for saved_group, group in zip(saved.get("param_groups", []), optimizer.param_groups):
            for index, p in zip(saved_group["params"], group["params"]):
                by_index[(k, index)] = layer_of_param.get(id(p), RESIDENTS)

    def shard_of(place: Place) -> str:
        if place[0] == "state_dict":
            return next((name for prefix, name in layer_of_key if str(place[1]).startswith(prefix)), RESIDENTS)
        return by_index.get((place[1], place[3]), RESIDENTS)

    return shard_of


# - writing


STAGING_BYTES = 16 << 20  # host bytes a device tensor is written through, one such piece at a time


def in_host_memory(t: Tensor) -> bool:
    """Whether ``t``'s bytes can be written from where they lie (else through a staging buffer)."""
    return t.device.type == "cpu"


def write_safetensors(path: Path, tensors: Sequence[tuple[str, Tensor]]) -> int:
    """Write ``tensors`` as one safetensors file, each straight from its own memory (a GPU tensor through one host
    staging buffer of :data:`STAGING_BYTES`), flush it to disk and return its size. Widest dtypes first: with the
    header padded to 8 bytes every tensor starts aligned to its element size."""
    tensors = sorted(tensors, key=lambda nt: -nt[1].element_size())
    header, offset = {}, 0
    for name, t in tensors:
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        staging = None
        for _, t in tensors:
            if not t.numel():
                continue
            # the tensor's bytes (a copy of this one tensor only when it is not contiguous)
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if in_host_memory(t):
                f.write(data.numpy())
                continue
            staging = torch.empty(STAGING_BYTES, dtype=torch.uint8) if staging is None else staging
            for i in range(0, data.numel(), STAGING_BYTES):  # a device tensor: through the staging buffer
                n = min(STAGING_BYTES, data.numel() - i)
                staging[:n].copy_(data[i : i + n])  # to pageable memory: returns once the bytes are there
                f.write(staging[:n].numpy())
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(encoded) + offset


def save_sharded(checkpoint: Mapping[str, Any], target: _PATH, shard_of: ShardOf) -> None:
    """Save ``checkpoint`` as the directory ``target`` (see [Note: sharded checkpoints]): written beside it, flushed,
    swapped in atomically; a failure removes what it wrote and leaves ``target`` as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target.parent)
    remove_stale_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(target), suffix=".tmp", dir=target.parent))
    try:
        meta, found = split(checkpoint)
        shards: dict[str, dict[str, Any]] = {}
        named: dict[str, list[tuple[str, Tensor]]] = {}
        seen: dict[tuple, tuple[str, str]] = {}  # one entry per tensor, however many places it fills (tied weights)
        for place, t in found:
            shard = f"{shard_of(place)}.safetensors"
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.numel() > 0)
            if key in seen and t.numel():
                shard, name = seen[key]
            else:
                name = "/".join(map(str, place))
                seen[key] = (shard, name)
                named.setdefault(shard, []).append((name, t))
            shards.setdefault(shard, {"bytes": 0, "tensors": {}})["tensors"].setdefault(name, []).append(list(place))
        for shard, tensors in named.items():
            shards[shard]["bytes"] = write_safetensors(tmp / shard, tensors)
        with open(tmp / META, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        index = {"format": FORMAT, "version": VERSION, "meta": META, "shards": dict(sorted(shards.items()))}
        with open(tmp / INDEX, "w") as f:  # last: a directory with an index is complete
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o777 & ~umask())  # as mkdir would have made it (mkdtemp makes it private)
        fsync_dir(tmp)
        swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover(directory: Path) -> None:
    """After a kill between the two renames of the fallback swap (a checkpoint's name gone, its ``.tmp`` and
    ``.old`` left): rename the complete new directory (a ``.tmp`` with its index), else the previous one (``.old``),
    back to the name. Only a killed save's (checkpoint_io.py's ``killed_save``: a live writer, here or on another
    host, may be between its renames). Run before a save removes leftovers; a removal's leftovers (``.del``) never
    come back."""
    leftovers: dict[str, list[Path]] = {}
    for p in directory.glob(".*.pid*.*"):
        name = temporary_of(p.name)
        if (name is not None and p.suffix in (".tmp", ".old") and p.is_dir() and not os.path.lexists(directory / name)
                and killed_save(p)):
            leftovers.setdefault(name, []).append(p)
    for name, found in leftovers.items():
        new = [p for p in found if p.suffix == ".tmp" and (p / INDEX).is_file()]
        old = [p for p in found if p.suffix == ".old"]
        for candidate in sorted(new, key=os.path.getmtime)[-1:] + sorted(old, key=os.path.getmtime)[-1:]:
            with contextlib.suppress(OSError):
                os.rename(candidate, directory / name)
                fsync_dir(directory)
                break


def remove_sharded(path: Path) -> None:
    """Remove a checkpoint directory: renamed away (``.del``) first, so that no half-removed checkpoint keeps its
    name, nor gets it back from :func:`recover`."""
    gone = temporary_name(path, ".del")
    os.rename(path, gone)
    fsync_dir(path.parent)
    remove_path(gone)


# - the strategy's checkpoint IO


class ShardedCheckpointIO(AtomicCheckpointIO):
    """Saves local checkpoints as sharded directories and removes them atomically (see [Note: sharded checkpoints]);
    the strategy loads either format (sharded_load.py's ``load_any``).

    Args:
        layout: called with each checkpoint to save; returns each tensor's shard (:func:`layer_layout`).
    """

    def __init__(self, layout: Callable[[Mapping[str, Any]], ShardOf]) -> None:
        super().__init__()
        self.layout = layout

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # its error, or Lightning's remote path
            return
        save_sharded(checkpoint, path, self.layout(checkpoint))

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        if is_sharded(path):
            remove_sharded(Path(path))
        else:
            super().remove_checkpoint(path)


def strategy_checkpoint_io(checkpoint_io: CheckpointIO | None, checkpoint_format: str,
                           layout: Callable[[Mapping[str, Any]], ShardOf]) -> CheckpointIO:
    """``MegaTrainStrategy``'s checkpoint IO: ``checkpoint_io`` when given, else :class:`AtomicCheckpointIO`
    (``checkpoint_format="file"``) or a :class:`ShardedCheckpointIO` with ``layout`` (``"sharded"``).

    Raises:
        ValueError: ``checkpoint_io`` given with ``checkpoint_format="sharded"``.
    """
    if checkpoint_format == "sharded" and checkpoint_io is not None:
        raise ValueError(f"MegaTrainStrategy(checkpoint_format='sharded') saves through its own checkpoint IO, got "
                         f"checkpoint_io={type(checkpoint_io).__name__}. HINT: pass one of the two.")
    if checkpoint_io is None and checkpoint_format == "sharded":
        checkpoint_io = ShardedCheckpointIO(layout)
    return checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO()
