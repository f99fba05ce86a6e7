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
(``.<name>.pid<writer>.*.tmp``) is removed by the next save into that directory once its writer's process is gone
(and by the next save of the same name in any case), so a checkpoint name that is never saved again (a top-k
``step5.ckpt`` saved again as ``step5-v1.ckpt`` after a resume) leaves none behind either; a process on another host
writing into the same directory cannot be told from a dead one, so give runs their own directories. A real
subprocess killed with SIGKILL during saves, ``$TMPDIR`` on another filesystem, is tested in
``tests/test_checkpoint_io.py`` (Lightning's own checkpoint IO leaves a truncated checkpoint there). Paths that are
not local (``s3://`` ...) take Lightning's own path.

Host RAM during a save: the checkpoint dict references the host masters and Adam states (no copy), and
``torch.save`` writes each CPU storage from where it lies, so the save adds only its pickled metadata (the peak RSS
rose 0.3 MiB for a 78 MiB checkpoint, 78 MiB with ``TorchCheckpointIO``: tests/test_checkpoint_io.py). The exception
is ``gpu_optimizer_groups``: their Adam states live on the GPU and are copied to host memory for the save
(``MegaTrainStrategy.optimizer_state``), 8 bytes per parameter of those groups until the save ends. The file holds
12 bytes per parameter (masters and both moments) in one ``torch.save`` archive: no per-layer shards yet.

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
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_megatrain._hardware import umask


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
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.pid{os.getpid()}.", suffix=".tmp", dir=target.parent)
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


def remove_stale_temporaries(target: Path) -> None:
    """Remove the temporary files of killed saves beside ``target``: those of its name, and those whose writer's
    process is gone (see [Note: atomic checkpoints]); also the temporary and previous directories of sharded saves
    ([Note: sharded checkpoints] in sharded_checkpoint.py)."""
    for stale in [p for suffix in ("tmp", "old", "del") for p in target.parent.glob(f".*.{suffix}")]:
        writer = _TEMP_WRITER.fullmatch(stale.name)
        if stale.name.startswith(f".{target.name}.") or (writer is not None and not _alive(int(writer[1]))):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()


_TEMP_WRITER = re.compile(r"\..+\.pid(\d+)\.[^.]+\.(?:tmp|old|del)")  # .<name>.pid<writer>.<random>.<suffix>


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


def load_readable(load: Callable[[_PATH], dict[str, Any]], path: _PATH, trainer: pl.Trainer | None) -> dict[str, Any]:
    """``load(path)``, or, when that fails and ``path`` is one of the files ``ckpt_path="last"`` chooses among, the
    newest checkpoint beside it that loads (see [Note: resuming from a readable checkpoint]).

    Raises:
        RuntimeError: no candidate loads (every file tried is named, with its error).
    """
    try:
        return load(path)
    except Exception as error:
        fallbacks = _resume_candidates(trainer, path) if trainer is not None else []
        if not fallbacks:
            raise
        failures = [(str(path), error)]
    for candidate in fallbacks:
        try:
            checkpoint = load(candidate)
        except Exception as error:
            failures.append((str(candidate), error))
            continue
        skipped = "; ".join(f"{name} ({type(e).__name__}: {e})" for name, e in failures)
        warnings.warn(
            f"MegaTrainStrategy: resuming from {candidate}, the newest checkpoint that loads: ckpt_path='last' chose "
            f"{path}, which does not load. Skipped: {skipped}.",
            stacklevel=2,
        )
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is not None and hasattr(connector, "_ckpt_path"):
            connector._ckpt_path = str(candidate)  # trainer.ckpt_path and Lightning's "Restored ..." name it
        return checkpoint
    tried = "\n- ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failures)
    raise RuntimeError(
        f"MegaTrainStrategy could not load any checkpoint for ckpt_path='last' (newest first):\n- {tried}\nHINT: "
        "move the unreadable files away to start from scratch, or pass ckpt_path=<a checkpoint that loads>."
    ) from failures[0][1]


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
