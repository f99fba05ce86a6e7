"""The native compact AdamW kernel: ``csrc/compact_adam.cpp`` built on first use by the machine's C++ compiler and
called through ctypes, for CPU parameters with 8-bit moments (optim/compact_adam.py ``adamw_update`` picks it where
``_native`` says the tensors are what the kernel reads and writes).

[Note: native compact kernel]
Inductor's fusion of the compact update (``compact_adam._chunk_update`` under ``torch.compile``) runs several passes
over fp32 temporaries (the block maxima of the new moments need every element of a block before any is encoded) and
ran at 0.12x torch's fused AdamW on the H200's 16 cores (docs/compact-state.md, Speed). The native kernel takes a
quantization block at a time: decode, update, maximum and encode on a stack array of 256 floats, each byte of state
read once and written once, blocks spread over ``torch.get_num_threads()`` OpenMP threads. Same formulas, same op
order and the same fused multiply-adds as torch's eager ops (built with ``-ffp-contract=off``: nothing else fused),
the same stochastic rounding bits (element ``i`` draws hash(seed + i)), so its results are the eager kernel's but
where a square root enters (torch's CPU ``sqrt`` is not correctly rounded, this one is): the new moments bitwise,
weights and codes within their last unit in a few elements (tests/optim/test_compact_kernel.py). It is built with
``-march=native`` into ``$TORCH_EXTENSIONS_DIR/megatrain_compact_adam`` (else ``~/.cache/lightning_megatrain``),
under a name that hashes the source, the flags, the compiler and its version and this CPU's flags; a machine without
a C++ compiler, or a build that fails, logs one warning and keeps inductor's kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "compact_adam.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c++17", "-shared",
         "-fPIC")
WEIGHT_CODES = {"fp32": 0, "bf16": 1, "bf16_sr": 2, "bf16_kahan": 3}  # the kernel's Weights enum

_library: ctypes.CDLL | None = None
_failure: str | None = None  # a failed build is tried and reported once per process


def _cpu_flags() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def _build_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) / "megatrain_compact_adam" if root else Path.home() / ".cache" / "lightning_megatrain"


def _compiler() -> list[str]:
    """The compiler's command: ``$CXX`` (which may carry arguments, e.g. ``ccache g++``), else ``c++``."""
    command = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"no C++ compiler ({command[0]!r}: set $CXX) on PATH")
    return command


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    f = lib.compact_adamw_int8
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 9 + [ctypes.c_int] * 4
    return lib


def _build() -> ctypes.CDLL:
    compiler = _compiler()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join((SOURCE.read_text(), " ".join(FLAGS), " ".join(compiler), version,
                                    _cpu_flags())).encode())
    target = _build_dir() / f"compact_adam_{key.hexdigest()[:16]}.so"
    if target.exists():
        try:
            return _load(target)
        except OSError:  # a damaged file from an interrupted copy or another machine: built again below
            target.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: atomic
        built = Path(tmp) / target.name
        run = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if run.returncode != 0:
            errors = [ln for ln in run.stderr.splitlines() if "error" in ln] or run.stderr.splitlines()[-3:]
            raise RuntimeError(f"{' '.join(compiler)} failed: {' | '.join(errors[:3])}")
        os.replace(built, target)
    return _load(target)


def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it does not build (logged once)."""
    global _library, _failure
    if _library is None and _failure is None:
        try:
            _library = _build()
        except Exception as e:  # no compiler, a failed build, a library that does not load
            _failure = f"{type(e).__name__}: {e}"
            log.warning("MegaTrain: the native compact AdamW kernel does not build (%s); the compiled one runs "
                        "instead (several times slower)", _failure)
    return _library


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def update(w: Tensor, g: Tensor, state: dict[str, Tensor], *, seed: int, neg_step_size: float, inv_bc2_sqrt: float,
           decay: float, grad_scale: float, one_minus_beta1: float, beta2: float, eps: float,
           coupled_decay: float | None, weights: str) -> None:
    """One AdamW step of ``w`` (1D, contiguous, on the CPU) in place, over its 8-bit moments and block scales (and
    compensation) in ``state``, with the values ``compact_adam.adamw_update`` computed for this step (see
    [Note: native compact kernel]); only where ``compact_adam._native`` said so: it checks nothing itself."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    code = library().compact_adamw_int8(
        _ptr(w), _ptr(g), _ptr(m), _ptr(state["exp_avg_scale"]), _ptr(v), _ptr(state["exp_avg_sq_scale"]),
        _ptr(state.get("compensation")), w.numel(), seed, neg_step_size, inv_bc2_sqrt, decay, grad_scale,
        one_minus_beta1, beta2, 1 - beta2, eps, coupled_decay or 0.0, coupled_decay is not None,
        WEIGHT_CODES[weights], g.dtype == torch.bfloat16, torch.get_num_threads())
    if code != 0:
        raise ValueError(f"the native compact AdamW kernel refused weights={weights!r}")
