"""Loading sharded checkpoints (sharded_checkpoint.py, [Note: sharded checkpoints]): a shard's tensors as views of
the file mapped, a checkpoint directory checked against its index and filled with them, either format as the strategy
loads it, and the conversion of a sharded checkpoint to one file."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn

from lightning_megatrain.checkpoint_io import Agreement, AtomicCheckpointIO, load_readable
from lightning_megatrain.engine.shard_states import load_shard_files
from lightning_megatrain.mapped import register

FORMAT, VERSION = "megatrain-sharded", 1
INDEX = "index.json"

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def is_sharded(path: _PATH) -> bool:
    """Whether ``path`` is a local directory (a sharded checkpoint, or nothing loadable)."""
    return isinstance(get_filesystem(path), LocalFileSystem) and Path(path).is_dir()


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of one safetensors file as views of the file mapped copy-on-write: nothing is read until used,
    and writing to them never changes the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, (begin, end) = _TORCH_DTYPES[entry["dtype"]], entry["data_offsets"]
        if end > size - 8 - n:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {8 + n + end}, the file has {size}")
        if begin == end:
            out[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        t = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=8 + n + begin)
        out[name] = register(t.reshape(entry["shape"]))
    return out


def load_sharded(path: _PATH, load_meta: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint saved as directory ``path``; tensors view the mapped shards (see [Note: sharded checkpoints] in
    sharded_checkpoint.py).

    Raises:
        ValueError: no index, another format, or a shard whose size is not the index's (truncated, replaced).
    """
    path = Path(path)
    if not (path / INDEX).is_file():
        raise ValueError(f"{path} is a directory without {INDEX}: not a complete sharded checkpoint.")
    index = json.loads((path / INDEX).read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{path / INDEX}: format {index.get('format')!r} version {index.get('version')!r}, this "
                         f"version of lightning_megatrain reads {FORMAT!r} version {VERSION}.")
    for shard, entry in index["shards"].items():
        size = (path / shard).stat().st_size if (path / shard).is_file() else None
        if size != entry["bytes"]:
            raise ValueError(f"{path / shard}: {size} bytes, the index says {entry['bytes']}: truncated or replaced.")
    checkpoint = load_meta(path / index["meta"])
    for shard, entry in index["shards"].items():
        tensors = read_safetensors(path / shard)
        for name, places in entry["tensors"].items():
            for place in places:
                container = checkpoint
                for key in place[:-1]:
                    container = container[key]
                container[place[-1]] = tensors[name]
    return checkpoint


def load_any(path: _PATH, load_file: Callable[[_PATH], dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint at ``path``: a sharded directory through :func:`load_sharded` (its ``meta.pt`` read with
    ``load_file``), anything else through ``load_file``, whichever format the strategy saves."""
    return load_sharded(path, load_file) if is_sharded(path) else load_file(path)


def load_either_format(load_file: Callable[[_PATH], dict[str, Any]], path: _PATH,
                       module: nn.Module | None, agree: Agreement | None = None) -> dict[str, Any]:
    """``MegaTrainStrategy.load_checkpoint``: a file or a sharded directory (:func:`load_any`, its ``meta.pt`` and
    every file through ``load_file``); a checkpoint of several ranks brings its shard files' optimizer slices
    (engine/shard_states.py, [Note: checkpoints of several ranks]); ``ckpt_path="last"`` skips a checkpoint that does
    not load, the ranks choosing alike through ``agree`` (checkpoint_io.py, [Note: resuming from a readable
    checkpoint])."""
    try:
        trainer = module.trainer if module is not None else None
    except RuntimeError:  # a module not attached to a Trainer: no "last" to resolve
        trainer = None
    return load_readable(lambda p: load_shard_files(load_any(p, load_file), p), path, trainer, agree)


def convert_to_file(src: _PATH, out: _PATH, overwrite: bool = False) -> Path:
    """Write the sharded checkpoint ``src`` as one Lightning ``.ckpt`` file ``out`` that plain Lightning loads
    (``torch.save`` streams each tensor from the mapped shards: no copy of the checkpoint in host RAM).

    Raises:
        ValueError: ``src`` is not a sharded checkpoint. FileExistsError: ``out`` exists and not ``overwrite``.
    """
    if not is_sharded(src):
        raise ValueError(f"src={str(src)!r} is not a directory: pass a sharded checkpoint (a *.ckpt directory).")
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"out={str(out)!r} exists; pass overwrite=True (--overwrite) to replace it.")
    checkpoint = load_sharded(src, lambda meta: torch.load(meta, map_location="cpu", weights_only=False))
    AtomicCheckpointIO().save_checkpoint(checkpoint, out)
    return Path(out)
