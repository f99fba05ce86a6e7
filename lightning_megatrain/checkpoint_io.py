"""Checkpoint saves that never leave a truncated file and never hold the checkpoint twice in host RAM.

[Note: atomic checkpoints]
Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into an in-memory buffer and then writes it
through an fsspec transaction, whose temporary file lives in ``$TMPDIR``. For this strategy both hurt: the buffer is
a second copy of 12 bytes per parameter (fp32 masters and both Adam moments: 84 GB for a 7B model, on a host that
already holds 16 bytes per parameter of training state), and when ``$TMPDIR`` is on another filesystem the final
move is a copy, so a process killed during it leaves a truncated ``last.ckpt`` that resuming cannot read.

:class:`AtomicCheckpointIO` streams ``torch.save`` into a temporary file in the target's own directory, flushes it to
disk (``fsync``), gives it the mode an ordinary save would have (``0o666`` less the umask; ``tempfile`` makes it
private), renames it over the target (``os.replace``: atomic within one filesystem) and flushes the directory entry.
A kill at any point leaves the previous checkpoint whole. The temporary file a kill leaves behind
(``.<name>.pid<writer>@<host>.*.tmp``) is removed by the next save of the same name in any case (one rank writes a
given name), and by the next save of any name into that directory once it is a killed save's (:func:`killed_save`),
so a checkpoint name that is never saved again (a top-k ``step5.ckpt`` saved again as ``step5-v1.ckpt`` after a
resume) leaves none behind either. A save judges the writer's process only for a temporary of its own host: with
``num_nodes > 1`` every rank writes into one shared directory, and a pid of another host names no process here, so
that a live writer there would look dead (its rename would then fail). Another host's temporary is left to the next
save on that host, or removed by any host once unmodified for :data:`FOREIGN_STALE_S` (24 hours: a live writer
modifies its file as it writes, a sharded save its directory at each shard; a later job may run on other hosts).
A name of an earlier version (``.<name>.pid<writer>.*.tmp``, no host) is judged by its pid on any host, as then: it
is a leftover of the host that wrote it (a run of another version writing into the same directory is not
supported). A real
subprocess killed with SIGKILL during saves, ``$TMPDIR`` on another filesystem, is tested in
``tests/test_checkpoint_io.py`` (Lightning's own checkpoint IO leaves a truncated checkpoint there). Paths that are
not local (``s3://`` ...) take Lightning's own path.

Host RAM during a save: the checkpoint dict references the host masters and Adam states (no copy), and
``torch.save`` writes each CPU storage from where it lies, so the save adds only its pickled metadata (the peak RSS
rose 2.0 MiB for a 78 MiB checkpoint, 78 MiB with ``TorchCheckpointIO``: tests/test_checkpoint_io.py).
``gpu_optimizer_groups``' Adam states stay on the GPU too: the checkpoint references the device moments
(``MegaTrainStrategy.optimizer_state``), and ``torch.save`` copies a storage that is not on the CPU to the host as it
writes it, one storage at a time (torch/serialization.py, ``_save``: ``storage = storage.cpu()`` inside the loop over
the storages, each copy released when the next replaces it). A device group's moments are two flat storages, so a
save adds at most 4 bytes times the largest device group's parameters: 1.2 GiB for Llama-2-13B (its residents,
328M parameters, or a layer, 317M), where copying every device state first took 8 bytes per parameter of those
groups (52 GiB with 22 groups, 7.0B parameters, on the GPU). The file holds 12 bytes per parameter (masters and both
moments); the device groups' states carry the GPU's location, as plain Lightning's GPU checkpoints do: Lightning's
own loader (``TorchCheckpointIO``: its ``map_location`` keeps each storage where ``torch.load`` reads it, the host)
and this strategy load them on the host, a bare ``torch.load`` onto the GPU (``map_location="cpu"`` without one).

Host RAM during a load: a local checkpoint file loads with ``torch.load(mmap=True)`` (:meth:`AtomicCheckpointIO.
load_checkpoint`), its masters and optimizer states viewing the mapped file, read into place a chunk at a time
([Note: mapped checkpoint tensors] in mapped.py): the masters into the host masters, the host groups' states into
the optimizer's own memory (8 bytes per parameter with AdamW, kept), the device groups' straight into their GPU
moments. The peak rises by the kept states and 1.2 MiB for the 78 MiB checkpoint (26 MiB more, the masters, through
``TorchCheckpointIO``: tests/test_sharded_checkpoints.py). Every other tensor of the checkpoint (callbacks' scores)
is copied, so that nothing kept after the restore holds the file mapped. A file saved without the zip format, a
remote path or an explicit ``map_location`` loads as Lightning loads it.

[Note: resuming from a readable checkpoint]
A checkpoint can still be unreadable: written by another checkpoint IO, copied in part, truncated by a full disk.
``fit(ckpt_path="last")`` (and ``megatrain fit --ckpt_path last``) resolves, in Lightning's checkpoint connector, to
the newest of the ``last*.ckpt`` files of the ``ModelCheckpoint`` callbacks and the ``OnExceptionCheckpoint`` file;
the strategy's ``load_checkpoint`` then gets that path. When it does not load, :func:`load_readable` loads the newest
checkpoint that does, among every local ``*.ckpt`` in those callbacks' directories (``last*.ckpt``, the top-k
files) and the ``OnExceptionCheckpoint`` file, newest first by modification time, warns with the names of the
files it skipped and the one it used, and records that one as the trainer's ``ckpt_path``. Only the candidates of
``"last"`` fall back (also when such a file is named directly): a checkpoint named by any other path fails as it
would in Lightning. When none loads, the error lists every file tried with its error.

With several ranks each resolves ``"last"`` on its own (Lightning's connector, each rank's view of the files), so
:func:`load_readable` makes them agree (an :class:`Agreement`, ``RankStrategy.resume_agreement``: collectives over
the host group): every rank tries rank 0's path, then rank 0's list of candidates, in the same order, and takes the
first that loads on every rank; a file that loads on some ranks only is dropped where it loaded and named with each
failing rank's error (``rank 1: FileNotFoundError: ...``). A checkpoint named by path that does not load on some
rank fails on every rank (there, with its own error; elsewhere a ``RuntimeError`` naming that rank), rather than
leaving the others to wait in the first collective of training. Tested in tests/strategy/test_ranks.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor
from typing_extensions import override

from lightning_megatrain._hardware import umask
from lightning_megatrain.mapped import register


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and streamed (see [Note: atomic checkpoints])."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # its error, or its remote path
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target), suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fchmod(f.fileno(), 0o666 & ~umask())  # as open() would have made it
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(target.parent)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Callable | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # a local checkpoint file loads mapped, nothing read until used ([Note: mapped checkpoint tensors])
        on_host = lambda storage, location: storage  # noqa: E731  (Lightning's default: every tensor on the host)
        if map_location is not None or not isinstance(get_filesystem(path), LocalFileSystem) or not (
                os.path.isfile(path) and zipfile.is_zipfile(path)):
            return super().load_checkpoint(path, map_location=map_location or on_host, weights_only=weights_only)
        checkpoint = torch.load(path, map_location=on_host, weights_only=weights_only, mmap=True)
        return mapped_checkpoint(checkpoint)


def mapped_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint loaded with ``torch.load(mmap=True)``, its tensors viewing the mapped file: those of
    ``state_dict`` and of the optimizers' ``state`` registered for the strategy to read into place
    ([Note: mapped checkpoint tensors]); every other tensor (callbacks' scores, schedulers) copied into memory of its
    own, so that nothing kept after the restore keeps the file mapped (and its disk space in use once replaced)."""
    big = ("state_dict", "optimizer_states")
    out = {k: v if k in big else apply_to_collection(v, Tensor, torch.clone) for k, v in checkpoint.items()}
    for t in out.get("state_dict", {}).values():
        if isinstance(t, Tensor):
            register(t)
    for optimizer in out.get("optimizer_states", []):
        for key, value in (optimizer.items() if isinstance(optimizer, dict) else ()):
            if key == "state" and isinstance(value, dict):
                for t in (t for entries in value.values() for t in entries.values() if isinstance(t, Tensor)):
                    register(t)
            else:
                optimizer[key] = apply_to_collection(value, Tensor, torch.clone)
    return out


def remove_stale_temporaries(target: Path) -> None:
    """Remove the temporary files of killed saves beside ``target``: those of its name, and those whose writer is
    gone (:func:`killed_save`; see [Note: atomic checkpoints]); also the temporary and previous directories of sharded
    saves ([Note: sharded checkpoints] in sharded_checkpoint.py)."""
    for stale in [p for suffix in ("tmp", "old", "del") for p in target.parent.glob(f".*.{suffix}")]:
        if stale.name.startswith(f".{target.name}.") or killed_save(stale):
            remove_path(stale)


# - who wrote a temporary: .<name>.pid<writer>@<host>.<random>.<suffix> (earlier versions: .<name>.pid<writer>.<...>)

_TEMP_WRITER = re.compile(r"\.(.+)\.pid(\d+)@(.+)\.[^.]+\.(?:tmp|old|del)")
_OLD_TEMP_WRITER = re.compile(r"\.(.+)\.pid(\d+)\.[^.]+\.(?:tmp|old|del)")  # no host: judged on any host
FOREIGN_STALE_S = 24 * 3600  # another host's temporary unmodified this long is a killed save's


def this_host() -> str:
    """This host's name as temporary names carry it: ``socket.gethostname()`` with any character but letters,
    digits, ``.``, ``_`` and ``-`` replaced by ``_``; one longer than 40 characters cut to 31 and a hash of the whole
    (a file name has at most 255 bytes; two hosts still get two names)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "_"
    return host if len(host) <= 40 else f"{host[:31]}-{hashlib.sha1(host.encode()).hexdigest()[:8]}"


def temporary_prefix(target: Path) -> str:
    """The start of the name of a temporary of this process beside ``target``: ``.<name>.pid<pid>@<host>.``."""
    return f".{target.name}.pid{os.getpid()}@{this_host()}."


def temporary_of(name: str) -> str | None:
    """The checkpoint name a temporary's file name ``name`` is of (either format), or None: not a temporary."""
    found = _TEMP_WRITER.fullmatch(name) or _OLD_TEMP_WRITER.fullmatch(name)
    return found[1] if found is not None else None


def killed_save(path: Path) -> bool:
    """Whether the temporary ``path`` is a killed save's (see [Note: atomic checkpoints]): written on this host by a
    process that is gone; written on another host (a pid means nothing here) and unmodified for
    :data:`FOREIGN_STALE_S`; or of an earlier version's name, without a host, by a process gone from this host."""
    found = _TEMP_WRITER.fullmatch(path.name)
    if found is None:
        old = _OLD_TEMP_WRITER.fullmatch(path.name)
        return old is not None and not _alive(int(old[2]))
    if found[3] == this_host():
        return not _alive(int(found[2]))
    try:
        return time.time() - path.lstat().st_mtime > FOREIGN_STALE_S
    except FileNotFoundError:  # its writer renamed or removed it meanwhile
        return False


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def fsync_dir(directory: Path) -> None:
    """Make the rename durable: flush the directory entry (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# - swapping a directory in atomically (sharded_checkpoint.py, [Note: sharded checkpoints])


def temporary_name(target: Path, suffix: str) -> Path:
    """A name beside ``target`` for a temporary of this process (``.<name>.pid<pid>@<host>.<random><suffix>``)."""
    return Path(tempfile.mktemp(prefix=temporary_prefix(target), suffix=suffix, dir=target.parent))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where refused."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot exchange
        return False
    raise OSError(errno, os.strerror(errno), str(a), None, str(b))


def swap_in(tmp: Path, target: Path) -> None:
    """Put the complete directory ``tmp`` in ``target``'s place, then remove the previous checkpoint."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return
    old = temporary_name(target, ".old")
    if _exchange(tmp, target):
        os.rename(tmp, old)  # tmp now holds the previous checkpoint
    else:  # see [Note: sharded checkpoints] in sharded_checkpoint.py for the window between these two renames
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)  # an error, not a kill: the previous checkpoint goes back
            raise
    fsync_dir(target.parent)
    remove_path(old)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@dataclass(frozen=True)
class Agreement:
    """How the ranks of a run agree on the checkpoint they resume from (see [Note: resuming from a readable
    checkpoint]). Both are collectives: every rank calls them, in the same order. The default: one rank.

    Args:
        world: the number of ranks.
        decide: rank 0's value of the argument, on every rank (a broadcast).
        gather: every rank's value of the argument, in rank order (an all-gather).
    """

    world: int = 1
    decide: Callable[[Any], Any] = lambda obj: obj
    gather: Callable[[Any], list[Any]] = lambda obj: [obj]


def load_readable(load: Callable[[_PATH], dict[str, Any]], path: _PATH, trainer: pl.Trainer | None,
                  agree: Agreement | None = None) -> dict[str, Any]:
    """``load(path)``, or, when that fails and ``path`` is one of the files ``ckpt_path="last"`` chooses among, the
    newest checkpoint beside it that loads (see [Note: resuming from a readable checkpoint]). With several ranks
    (``agree``): rank 0's ``path`` and candidates, and the first that loads on every rank.

    Raises:
        RuntimeError: no candidate loads (every file tried is named, with its error); with several ranks, also the
            named checkpoint loading here but not on another rank (the rank and its error named).
    """
    agree = agree if agree is not None else Agreement()
    first = agree.decide(str(path))
    checkpoint, failed = _load_everywhere(load, first, agree)
    if failed is None:
        _record_choice(trainer, path, first)
        return checkpoint
    failures = [failed]
    fallbacks = agree.decide([str(c) for c in _resume_candidates(trainer, first)] if trainer is not None else [])
    if not fallbacks:
        _, described, error = failed
        if error is not None:
            raise error
        raise RuntimeError(f"MegaTrainStrategy could not load the checkpoint {first} on every rank: {described}. "
                           "HINT: every rank must see the same checkpoint files (one shared directory).")
    for candidate in fallbacks:
        checkpoint, failed = _load_everywhere(load, candidate, agree)
        if failed is not None:
            failures.append(failed)
            continue
        skipped = "; ".join(f"{name} ({described})" for name, described, _ in failures)
        where = " on every rank" if agree.world > 1 else ""
        warnings.warn(
            f"MegaTrainStrategy: resuming from {candidate}, the newest checkpoint that loads{where}: ckpt_path='last' "
            f"chose {first}, which does not load{where}. Skipped: {skipped}.",
            stacklevel=2,
        )
        _record_choice(trainer, path, candidate)
        return checkpoint
    tried = "\n- ".join(f"{name}: {described}" for name, described, _ in failures)
    raise RuntimeError(
        f"MegaTrainStrategy could not load any checkpoint for ckpt_path='last' (newest first):\n- {tried}\nHINT: "
        "move the unreadable files away to start from scratch, or pass ckpt_path=<a checkpoint that loads>."
    ) from next((error for _, _, error in failures if error is not None), None)


def _load_everywhere(load: Callable[[_PATH], dict[str, Any]], path: str, agree: Agreement
                     ) -> tuple[dict[str, Any] | None, tuple[str, str, Exception | None] | None]:
    """``(the checkpoint, None)`` when ``path`` loads on every rank, else ``(None, (path, every rank's error,
    this rank's error or None))``: a checkpoint that loads here but not on another rank is dropped."""
    try:
        checkpoint, error = load(path), None
    except Exception as e:
        checkpoint, error = None, e
    errors = agree.gather(None if error is None else f"{type(error).__name__}: {error}")
    if not any(errors):
        return checkpoint, None
    described = errors[0] if len(errors) == 1 else "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    return None, (path, described, error)


def _record_choice(trainer: pl.Trainer | None, path: _PATH, chosen: str) -> None:
    """Make ``chosen`` the trainer's ``ckpt_path`` (Lightning's "Restored ..." names it) when it is not ``path``."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if chosen != str(path) and connector is not None and hasattr(connector, "_ckpt_path"):
        connector._ckpt_path = chosen


def _resume_candidates(trainer: pl.Trainer, path: _PATH) -> list[Path]:
    """Every local checkpoint to try after ``path``, newest first: none unless ``path`` is one of the files
    ``ckpt_path="last"`` chooses among."""
    lasts: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            lasts |= callback._find_last_checkpoints(trainer)  # what Lightning's connector resolves "last" among
    lasts |= {str(c.ckpt_path) for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)}
    local = {Path(os.path.normpath(p)) for p in lasts if isinstance(get_filesystem(p), LocalFileSystem)}
    failed = Path(os.path.normpath(str(path)))
    if failed not in local:
        return []
    directories = {Path(os.path.normpath(c.dirpath)) for c in trainer.checkpoint_callbacks
                   if isinstance(c, ModelCheckpoint) and c.dirpath is not None} | {p.parent for p in local}
    files = {f for d in directories if d.is_dir() for f in d.glob("*.ckpt")} | local
    files = {f for f in files if f != failed and (f.is_file() or f.is_dir())}  # a directory: a sharded checkpoint
    return sorted(files, key=lambda f: f.stat().st_mtime, reverse=True)
