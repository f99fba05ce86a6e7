"""AdamW over compact host state: bf16 weights (stochastic rounding or Kahan compensation), bf16 or fp32 gradients,
8-bit block-quantized moments; the host-RAM layouts of ``host_state`` and their bytes per parameter.

[Note: compact host state]
``host_state`` (config.py) names one layout of the per-parameter host state (:data:`HOST_STATE_LAYOUTS`, bytes per
parameter from :meth:`HostStateLayout.bytes_per_param`; the planner reads them from here):

==================  ===========================  ========  =====================================  ===========
host_state          weights                      grads     Adam moments                           B/param
==================  ===========================  ========  =====================================  ===========
``fp32``            fp32 master                  fp32      fp32 m and v                           16
``int8_moments``    fp32 master                  fp32      8-bit m and v + fp32 scale per 256     10.03
``compact``         bf16, stochastic rounding    bf16      8-bit m and v + fp32 scale per 256     6.03
``compact_kahan``   bf16 + bf16 compensation     bf16      8-bit m and v + fp32 scale per 256     8.03
==================  ===========================  ========  =====================================  ===========

The update is torch's AdamW (``_single_tensor_adam``'s formula and op order), computed in fp32 on a chunk of
``CHUNK`` elements at a time: the chunk's weights, moments (decoded, [Note: 8-bit moments] in optim/rounding.py)
and gradient are widened to fp32, updated, and written back in their storage format, so fp32 temporaries are
bounded by a chunk whatever the tensor's size. The new bf16 weight is rounded stochastically ([Note: stochastic
rounding]) or to nearest with the rounding error kept in a bf16 *compensation* buffer that the next update adds
back (Kahan summation: weight + compensation carries about 16 significant bits). With every format fp32 the kernel
is torch's AdamW bit for bit on the CPU (tests/optim/test_compact_adam.py). Gradients are read in whatever dtype
they arrive and summed across micro-batches in that dtype by whoever writes them. Nothing is tied to the CPU: the
state lives on the parameter's device (the step count on the CPU, as in torch's AdamW), so the same kernel runs on GPU
parameters (benchmarks/compact_quality.py trains with it there).

Speed: CPU parameters with 8-bit moments run the native single-pass kernel (optim/compact_kernel.py, [Note: native
compact kernel]); the rest runs through ``torch.compile`` (inductor's C++/OpenMP backend, several passes over fp32
temporaries) where it builds, else as eager torch ops (many passes, several times slower). ``compile=False`` runs
the eager ops. ``benchmarks/compact_adam.py`` measures them against torch's fused AdamW and DeepSpeedCPUAdam.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_megatrain import mapped
from lightning_megatrain.optim import compact_kernel
from lightning_megatrain.optim.rounding import (
    BLOCK,
    decode_signed,
    decode_unsigned,
    encode_signed,
    encode_unsigned,
    mix_seed,
    n_blocks,
    nearest_bits,
    round_stochastic,
)

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # elements per kernel call on the CPU (a multiple of BLOCK): 4 MiB per fp32 temporary
DEVICE_CHUNK = 1 << 24  # on a GPU, where each call is a few kernel launches: 64 MiB per fp32 temporary
WEIGHT_FORMATS = ("fp32", "bf16", "bf16_sr", "bf16_kahan")  # "bf16": round to nearest, no compensation (stalls)
MOMENT_FORMATS = ("fp32", "int8")


@dataclass(frozen=True)
class HostStateLayout:
    """How one parameter's host state is stored: see [Note: compact host state]."""

    weights: str  # one of WEIGHT_FORMATS
    grad_dtype: torch.dtype
    moments: str  # one of MOMENT_FORMATS

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float32 if self.weights == "fp32" else torch.bfloat16

    @property
    def bf16_compute_only(self) -> bool:
        """Bf16 masters compute in bf16 only (engine/host_store.py ``check_layout_compute`` says why)."""
        return self.weight_dtype != torch.float32

    def bytes_per_param(self) -> dict[str, float]:
        """Host bytes per parameter by item: the weights (with the compensation), the grads, the Adam moments (with
        their block scales)."""
        weights = self.weight_dtype.itemsize * (2 if self.weights == "bf16_kahan" else 1)
        moments = 8.0 if self.moments == "fp32" else 2 + 2 * 4 / BLOCK
        return {"weights": weights, "grads": self.grad_dtype.itemsize, "optimizer states": moments}


HOST_STATE_LAYOUTS = {
    "fp32": HostStateLayout("fp32", torch.float32, "fp32"),
    "int8_moments": HostStateLayout("fp32", torch.float32, "int8"),
    "compact": HostStateLayout("bf16_sr", torch.bfloat16, "int8"),
    "compact_kahan": HostStateLayout("bf16_kahan", torch.bfloat16, "int8"),
}


def state_spec(numel: int, weights: str, moments: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each state entry of a parameter of ``numel`` elements: its dtype and shape (the step count 0-dim fp32, as in
    torch's AdamW; 1D moments, block scales and compensation)."""
    spec = {"step": (torch.float32, ())}
    if moments == "fp32":
        spec.update(exp_avg=(torch.float32, (numel,)), exp_avg_sq=(torch.float32, (numel,)))
    else:
        blocks = (n_blocks(numel),)
        spec.update(exp_avg=(torch.int8, (numel,)), exp_avg_scale=(torch.float32, blocks),
                    exp_avg_sq=(torch.uint8, (numel,)), exp_avg_sq_scale=(torch.float32, blocks))
    if weights == "bf16_kahan":
        spec["compensation"] = (torch.bfloat16, (numel,))
    return spec


def state_problems(p: Tensor, grad: Tensor, state: dict[str, Any], weights: str, moments: str) -> list[str]:
    """What keeps ``p`` (a host parameter) from an update with ``grad`` over ``state`` in these formats: a parameter
    not a contiguous CPU tensor of the weights' dtype, a gradient not a dense float tensor of its shape on its device,
    a state entry missing or not of :func:`state_spec`'s dtype and shape on the CPU. Empty when nothing does."""
    want = HostStateLayout(weights, torch.float32, moments).weight_dtype
    problems = []
    if p.dtype != want or p.device.type != "cpu" or not p.is_contiguous():
        problems.append(f"the parameter is {describe(p)}, CompactAdamW(weights={weights!r}) updates contiguous "
                        f"{str(want).replace('torch.', '')} CPU parameters")
    if grad.layout != torch.strided or grad.shape != p.shape or not grad.is_floating_point() \
            or grad.device != p.device:
        problems.append(f"the gradient is {describe(grad)}")
    for key, (dtype, shape) in state_spec(p.numel(), weights, moments).items():
        t = state.get(key)
        if not (isinstance(t, Tensor) and t.dtype == dtype and tuple(t.shape) == shape and t.device.type == "cpu"):
            problems.append(f"its state {key!r} is {describe(t) if isinstance(t, Tensor) else repr(t)}, not "
                            f"{str(dtype).replace('torch.', '')} {list(shape)} on cpu")
    return problems


def describe(t: Tensor) -> str:
    """``t``'s dtype, shape and device, for messages."""
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}"


def _native(w: Tensor, g: Tensor, state: dict[str, Tensor], weights: str, moments: str) -> bool:
    """Whether the native kernel updates ``w`` (1D) with ``g``: 8-bit moments, nothing :func:`state_problems` names,
    every tensor contiguous (the kernel reads raw memory and checks nothing: anything else would be read or written
    past), an fp32 or bf16 gradient, and the kernel builds ([Note: native compact kernel])."""
    return (moments == "int8" and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()
            and all(t.is_contiguous() for t in state.values() if isinstance(t, Tensor))
            and not state_problems(w, g, state, weights, moments) and compact_kernel.library() is not None)


def new_state(p: Tensor, weights: str, moments: str) -> dict[str, Tensor]:
    """The state of ``p`` before its first update: :func:`state_spec`'s entries, zeros (the step count on the CPU)."""
    return {key: torch.zeros(shape, dtype=dtype, device="cpu" if key == "step" else p.device)
            for key, (dtype, shape) in state_spec(p.numel(), weights, moments).items()}


def _chunk_update(
    w: Tensor, g: Tensor, m: Tensor, m_scale: Tensor | None, v: Tensor, v_scale: Tensor | None,
    comp: Tensor | None, start: Tensor, neg_step_size: Tensor, bc2_sqrt: Tensor, inv_bc2_sqrt: Tensor, decay: Tensor,
    grad_scale: Tensor, one_minus_beta1: Tensor, beta2: float, eps: float, coupled_decay: float | None, weights: str,
    moments: str,
) -> None:
    """AdamW on one chunk (1D views, updated in place), in torch's ``_single_tensor_adam`` op order.

    Values a step or a scheduler may change (``neg_step_size`` = -lr / (1 - beta1^t), ``bc2_sqrt`` and its
    reciprocal, ``decay`` = 1 - lr * weight_decay, ``grad_scale``, and 1 - beta1, which ``OneCycleLR`` cycles) are
    0-dim fp32 tensors on the chunk's device: torch.compile guards on a Python float's value as soon as anything
    specializes it, and the kernel recompiled every step until dynamo's recompile limit sent it to eager ops (seen on
    the H200). Multiplying by a decay or a scale of 1 is exact, so no branch depends on them and one graph serves
    every step. What stays a Python value is a group's constant: ``beta2`` (``addcmul``'s ``value``, a fused
    multiply-add on the CPU that a tensor product does not reproduce), ``eps``, and ``coupled_decay``, Adam's L2 weight
    decay (None: AdamW, or a decay of 0), added as ``add``'s ``alpha`` (a fused multiply-add, as torch's Adam
    computes it) only where torch adds it, so a non-finite weight does not reach the gradient where torch's would not:
    a graph per format and per coupled decay value."""
    w32 = w.float() if comp is None else w.float() + comp.float()
    g32 = g.float() * grad_scale
    w32 = w32 * decay
    if coupled_decay is not None:
        g32 = g32.add(w32, alpha=coupled_decay)
    if moments == "fp32":
        m32, v32 = m, v
    else:
        m32, v32 = decode_signed(m, m_scale), decode_unsigned(v, v_scale)
    m32 = torch.lerp(m32, g32, one_minus_beta1)
    v32 = torch.addcmul(v32 * beta2, g32, g32, value=1 - beta2)
    root = v32.sqrt()
    if moments == "fp32":
        denom = (root / bc2_sqrt) + eps  # torch's order: with fp32 weights too, torch's AdamW bit for bit
    else:
        denom = root * inv_bc2_sqrt + eps
    w32 = w32 + (neg_step_size * m32) / denom  # addcdiv's order: (value * tensor1) / tensor2, bit for bit
    if weights == "bf16_sr":
        w.copy_(round_stochastic(w32, start))  # exact: an fp32 holding a bf16 value
    elif weights == "bf16_kahan":
        high = nearest_bits(w32).view(torch.float32)  # an fp32 holding the nearest bf16 value
        comp.copy_(w32 - high)  # the rounding error, added back by the next update
        w.copy_(high)  # exact
    else:
        w.copy_(w32)  # fp32, or bf16 rounded to nearest
    if moments == "fp32":
        m.copy_(m32)
        v.copy_(v32)
    else:
        codes, scale = encode_signed(m32)
        m.copy_(codes)
        m_scale.copy_(scale)
        codes, scale = encode_unsigned(v32, root)
        v.copy_(codes)
        v_scale.copy_(scale)


_compiled: Callable[..., None] | None = None
_compile_failure: str | None = None  # a failed build is tried and reported once per process


def _kernel(compile: bool) -> Callable[..., None]:
    """The chunk update, through ``torch.compile`` when asked and it builds (one graph per format pair; sizes are
    dynamic and step-dependent values tensors, so neither recompiles, as long as every chunk has more than one
    quantization block and whole blocks except at a tensor's end)."""
    global _compiled
    if not compile or _compile_failure is not None:
        return _chunk_update
    if _compiled is None:
        _compiled = torch.compile(_chunk_update, dynamic=True)
    return _compiled


def adamw_update(
    w: Tensor, g: Tensor, state: dict[str, Tensor], *, lr: float, betas: tuple[float, float], eps: float,
    weight_decay: float, decoupled: bool, weights: str, moments: str, seed: int, grad_scale: float = 1.0,
    compile: bool = False,
) -> None:
    """One AdamW step of one parameter over its compact state (see [Note: compact host state]).

    Args:
        w: the weights, 1D contiguous; fp32 for ``weights="fp32"``, else bf16. Updated in place.
        g: the gradient, 1D, same length, any float dtype (read only).
        state: :func:`new_state`'s entries; ``state["step"]`` is incremented here.
        seed: the stochastic rounding's seed for this parameter and step (:func:`~optim.rounding.mix_seed`).
        grad_scale: factor the gradient is multiplied by first (the clipping coefficient).
        compile: the native kernel where it can run (:func:`_native`), else the chunk update through
            ``torch.compile`` (falls back to eager, logged once, if it fails); False: eager ops.
    """
    global _compile_failure
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = betas
    bc2_sqrt = (1 - beta2**step) ** 0.5
    values = (-lr / (1 - beta1**step), bc2_sqrt, 1.0 / bc2_sqrt, 1 - lr * weight_decay if decoupled else 1.0,
              float(grad_scale), 1 - beta1)
    coupled = None if decoupled or weight_decay == 0 else weight_decay
    if compile and _native(w, g, state, weights, moments):  # [Note: native compact kernel]
        compact_kernel.update(w, g, state, seed=seed, neg_step_size=values[0], inv_bc2_sqrt=values[2],
                              decay=values[3], grad_scale=values[4], one_minus_beta1=values[5], beta2=beta2, eps=eps,
                              coupled_decay=coupled, weights=weights)
        return
    # fills, not copies: no host-device sync when the parameter is on a GPU
    scalars = tuple(torch.full((), value, dtype=torch.float32, device=w.device) for value in values)
    hyper = dict(beta2=beta2, eps=eps, coupled_decay=coupled, weights=weights, moments=moments)
    m, v, comp = state["exp_avg"], state["exp_avg_sq"], state.get("compensation")
    m_scale, v_scale = state.get("exp_avg_scale"), state.get("exp_avg_sq_scale")
    n, chunk = w.numel(), CHUNK if w.device.type == "cpu" else DEVICE_CHUNK
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        blocks = slice(start // BLOCK, n_blocks(end))
        # detached: the same memory without a view's base, whose sizes torch.compile would guard on (a graph for
        # each parameter shape and chunk position instead of one per format pair)
        args = tuple(None if t is None else t.detach() for t in (
            w[start:end], g[start:end], m[start:end], None if m_scale is None else m_scale[blocks],
            v[start:end], None if v_scale is None else v_scale[blocks], None if comp is None else comp[start:end],
            # the hash input on the weights' device; a fill, not a copy: no host-device sync on a GPU
            torch.full((), seed + start, dtype=torch.int64, device=w.device)))
        kernel = _kernel(compile)
        try:
            kernel(*args, *scalars, **hyper)
        except Exception as e:  # inductor could not build (no C++ compiler, ...): nothing was written yet
            if kernel is _chunk_update:
                raise
            _compile_failure = f"{type(e).__name__}: {e}"
            log.warning("MegaTrain: the compiled compact AdamW kernel does not build (%s); running it eagerly "
                        "(several times slower)", _compile_failure.splitlines()[0])
            _chunk_update(*args, *scalars, **hyper)


def _check_format(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"CompactAdamW({name}={value!r}): choose one of {allowed}")


class CompactAdamW(Optimizer):
    """AdamW (or Adam with ``decoupled_weight_decay=False``) over compact state: see [Note: compact host state].

    Args:
        params, lr, betas, eps, weight_decay, decoupled_weight_decay: as ``torch.optim.AdamW``.
        weights: ``"bf16_sr"`` (bf16 parameters, stochastic rounding), ``"bf16_kahan"`` (bf16 parameters and a bf16
            compensation buffer), ``"bf16"`` (bf16, round to nearest: small updates are lost; for comparison) or
            ``"fp32"`` (fp32 parameters).
        moments: ``"int8"`` (8-bit block-quantized m and v, [Note: 8-bit moments]) or ``"fp32"``.
        seed: the stochastic rounding's seed; the bits of step t of parameter i derive from (seed, t, i), so a
            resumed run rounds as the uninterrupted one.
        compile: run the fast kernels: the native one for CPU parameters with 8-bit moments, ``torch.compile``
            for the rest (``"auto"``: yes, falling back to eager ops where they do not build); False: eager ops.
            Not saved in the state dict.

    Raises:
        ValueError: an unknown ``weights``, ``moments`` or ``compile``; a state dict saved with other formats.
        TypeError: at a parameter's first step: its dtype is not the one ``weights`` stores, or it is not
            contiguous, or its gradient is sparse.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 1e-2, *, decoupled_weight_decay: bool = True, weights: str = "bf16_sr",
        moments: str = "int8", seed: int = 0, compile: bool | str = "auto",
    ) -> None:
        _check_format("weights", weights, WEIGHT_FORMATS)
        _check_format("moments", moments, MOMENT_FORMATS)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, weights=weights, moments=moments, seed=seed)
        if compile not in (True, False, "auto"):
            raise ValueError(f"CompactAdamW(compile={compile!r}): choose True, False or 'auto'")
        super().__init__(params, defaults)
        self.compile = compile in (True, "auto")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``Optimizer.load_state_dict``, each state tensor keeping its dtype.

        Raises:
            ValueError: the state dict was saved with other ``weights`` or ``moments`` formats.
        """
        for saved, own in zip(state_dict["param_groups"], self.param_groups):
            for key in ("weights", "moments"):
                if saved.get(key) != own[key]:
                    raise ValueError(
                        f"CompactAdamW.load_state_dict: the state was saved with {key}={saved.get(key)!r}, this "
                        f"optimizer has {key}={own[key]!r}. HINT: resume with the format it was saved with."
                    )
        # torch would cast every state tensor of a floating-point parameter to the parameter's dtype (the 8-bit codes
        # as fp32 or bf16: 4 or 2 transient bytes per code, all at once) and read a checkpoint's mapped states whole:
        # the groups go through torch, each saved tensor straight into memory of its own, in its own dtype
        super().load_state_dict({**state_dict, "state": {}})
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved, params):
            for key, value in state_dict["state"].get(i, {}).items():
                self.state[p][key] = _loaded(value, p.device) if isinstance(value, Tensor) else value

    def _check_param(self, p: Tensor, weights: str) -> None:
        want = HostStateLayout(weights, torch.float32, "fp32").weight_dtype
        if p.dtype != want or p.grad.is_sparse or not p.is_contiguous():
            raise TypeError(
                f"CompactAdamW(weights={weights!r}) updates contiguous {str(want).replace('torch.', '')} parameters "
                f"with dense gradients; got a {str(p.dtype).replace('torch.', '')} parameter on {p.device}"
                f"{' with a sparse gradient' if p.grad.is_sparse else ''}. HINT: cast the module with "
                f"`.to({want})` before building the optimizer, or choose weights='fp32' for fp32 parameters."
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # the parameter's position over all groups: its stochastic rounding stream
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._check_param(p, group["weights"])
                    state.update(new_state(p, group["weights"], group["moments"]))
                self.update_param(p, p.grad, group, index - 1)
        return loss

    @torch.no_grad()  # also on the overlapped step's worker thread, where grad mode is on by default
    def update_param(self, p: Tensor, grad: Tensor, hyper: dict[str, Any], index: int, grad_scale: float = 1.0,
                     weights: Tensor | None = None) -> None:
        """One update of ``p`` (its state already created) with ``grad`` multiplied by ``grad_scale`` and the
        hyperparameters ``hyper`` (its param group's, or a snapshot of them); ``index``: ``p``'s position over all
        param groups, which with the step count and ``seed`` picks its stochastic rounding bits. What :meth:`step`
        runs per parameter and the engine's update runs per flat group (optim/compact_update.py). ``weights``: the
        tensor updated in place of ``p`` (a device mirror of it, with its state on the same device; engine/
        device_state.py), ``p`` itself when None."""
        state = self.state[p]
        adamw_update(
            (p if weights is None else weights).view(-1), grad.reshape(-1), state, lr=hyper["lr"],
            betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"],
            decoupled=hyper["decoupled_weight_decay"], weights=hyper["weights"], moments=hyper["moments"],
            seed=mix_seed(hyper["seed"], int(state["step"]) + 1, index), grad_scale=grad_scale, compile=self.compile,
        )


def _loaded(value: Tensor, device: torch.device) -> Tensor:
    """A loaded state tensor in memory of its own on ``device``, its dtype kept: a checkpoint's mapped tensor read a
    chunk at a time, its pages released ([Note: mapped checkpoint tensors] in mapped.py), any other copied."""
    if device.type == "cpu" and mapped.is_mapped(value):
        return mapped.own(value)
    return value.to(device=device, copy=True)


def state_nbytes(optimizer: Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, scales, compensation, step counts)."""
    return sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor))

