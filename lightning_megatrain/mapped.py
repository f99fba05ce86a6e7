"""Checkpoint tensors that view their file mapped: read into their destination a chunk at a time, pages released.

[Note: mapped checkpoint tensors]
A resume never reads a checkpoint into host memory as a whole. Both formats load as tensors that view the file
mapped copy-on-write, so nothing is read until used: the shards of a sharded checkpoint
(sharded_load.py, ``read_safetensors``) and a checkpoint file through ``torch.load(mmap=True)``
(checkpoint_io.py, ``AtomicCheckpointIO.load_checkpoint``). Each such tensor is *registered* here when it is
created. Its bytes then go to where they belong, one chunk of :data:`CHUNK_BYTES` at a time, through the mapping
(:func:`copy_released`): the masters straight into the host masters (:func:`read_into`), the host optimizer's states
into tensors of their own (:func:`owned`), and the device groups' Adam states straight into their GPU moments
(engine/device_state.py, ``DeviceGroup.bind_states``). After each chunk its pages leave the process
(``madvise(MADV_DONTNEED)``: a private file mapping's pages are dropped, and read from the file again if touched
again), so a load adds one chunk of mapped pages to the RSS at a time, not the checkpoint: the pages stay in the page
cache, which the kernel reclaims, and are counted nowhere else. Only the pages wholly inside the tensor's own bytes
are released (a page it shares with a neighbour keeps the neighbour's bytes, even ones a hook wrote in place).
Reading through the mapping, not the file, sees what a hook (``on_load_checkpoint``) wrote into a loaded tensor in
place; after the read the checkpoint's entry points at the destination (:func:`read_into`), or the tensor is not read
again (optimizer states). Off Linux (no ``madvise``) the pages stay mapped until the checkpoint is released.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

CHUNK_BYTES = 1 << 20  # mapped bytes read per copy before they are released: the load's transient RSS
_PAGE = 4096
_MADV_DONTNEED = 4  # Linux
_MAPPED: dict[int, weakref.ref] = {}  # id(tensor) -> the tensor, for every registered tensor still alive


def register(t: Tensor) -> Tensor:
    """Record that ``t`` views a checkpoint file mapped privately (copy-on-write); returns ``t``."""
    _MAPPED[id(t)] = weakref.ref(t, lambda _, key=id(t): _MAPPED.pop(key, None))
    return t


def is_mapped(t: Any) -> bool:
    """Whether ``t`` is a registered mapped tensor (see [Note: mapped checkpoint tensors])."""
    ref = _MAPPED.get(id(t))
    return ref is not None and ref() is t


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


_madvise = _libc_madvise()


def _release(begin: int, end: int) -> None:
    """Drop the pages wholly inside the addresses ``[begin, end)`` from this process (a no-op off Linux)."""
    first, last = -(-begin // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if _madvise is not None and last > first:
        _madvise(first, last - first, _MADV_DONTNEED)


def copy_released(src: Tensor, dst: Tensor) -> None:
    """``dst.copy_(src)`` (``dst`` on the host or a GPU); where ``src`` is a registered mapped tensor, a chunk of
    :data:`CHUNK_BYTES` at a time, each chunk's pages released after it is copied (see the module note)."""
    if not is_mapped(src) or src.numel() == 0:
        dst.copy_(src)
        return
    begin, end = src.data_ptr(), src.data_ptr() + src.nbytes
    if not (src.is_contiguous() and dst.is_contiguous() and src.shape == dst.shape):
        dst.copy_(src)  # one copy of this tensor, released after it
        _release(begin, end)
        return
    s, d = src.reshape(-1), dst.reshape(-1)
    step = max(1, CHUNK_BYTES // src.element_size())
    released = begin
    for i in range(0, s.numel(), step):
        d[i : i + step].copy_(s[i : i + step])  # from pageable memory: returns once the bytes are read
        upto = min(begin + (i + step) * src.element_size(), end)
        _release(released, upto)
        released = max(released, upto // _PAGE * _PAGE)


def own(src: Tensor) -> Tensor:
    """A host tensor of its own with ``src``'s values: a registered mapped tensor read into new memory
    (:func:`copy_released`), any other tensor returned as it is."""
    if not is_mapped(src):
        return src
    out = torch.empty(src.shape, dtype=src.dtype)
    copy_released(src, out)
    return out


def owned(state: Any) -> Any:
    """``state`` (an optimizer state dict, or one parameter's state) with every registered mapped tensor replaced by
    one of its own (:func:`own`): the optimizer keeps what it loads, and must not keep the file mapped."""
    if isinstance(state, Tensor):
        return own(state)
    if isinstance(state, Mapping):
        return {k: owned(v) for k, v in state.items()}
    if isinstance(state, list):
        return [owned(v) for v in state]
    return state


def any_mapped(state: Any) -> bool:
    """Whether ``state`` (one parameter's optimizer state) holds a registered mapped tensor: loaded, not yet read."""
    if isinstance(state, Mapping):
        return any(is_mapped(v) for v in state.values())
    return is_mapped(state)


def read_into(state_dict: dict[str, Any], targets: Mapping[str, Tensor]) -> None:
    """Read each registered mapped tensor of ``state_dict`` (a loaded checkpoint's) straight into the tensor of the
    same name, shape and dtype in ``targets`` (the module's: its host masters), and point the entry at that tensor,
    whose copy onto itself ``load_state_dict`` then skips. The masters' bytes go from the mapping into the masters
    once, a chunk at a time (see the module note)."""
    for name, value in state_dict.items():
        target = targets.get(name)
        if (is_mapped(value) and isinstance(target, Tensor) and target.shape == value.shape
                and target.dtype == value.dtype and target.device.type == "cpu"):
            copy_released(value, target)
            state_dict[name] = target
