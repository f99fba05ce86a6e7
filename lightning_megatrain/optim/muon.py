"""Muon for the hidden matrices, AdamW for the rest, in one torch optimizer that the engine steps on the host.

[Note: Muon]
Muon (Keller Jordan, 2024) updates a weight matrix ``W`` (``m x n``) with the orthogonalised momentum of its
gradient ``G``, per step::

    M <- beta M + (1 - beta) G                  # one fp32 momentum buffer per matrix
    U <- (1 - beta) G + beta M   (Nesterov)     # or U <- M
    O <- NewtonSchulz(U)                        # ~ U V^T of U's SVD (optim/newton_schulz.py)
    W <- W (1 - lr wd) - lr s O                 # decoupled weight decay, shape-dependent scale s

``update_scale`` picks ``s``: ``"rms"`` (default) is Moonshot's ``0.2 sqrt(max(m, n))`` ("Muon is Scalable for LLM
Training", 2025): ``O``'s RMS is about ``1/sqrt(max(m, n))``, so the update's RMS is 0.2, as AdamW's typically is,
and the same ``lr`` and ``weight_decay`` serve the Muon and the AdamW groups (what fine-tuning an AdamW-trained
model expects). ``"spectral"`` is Keller Jordan's ``sqrt(max(1, m / n))`` for an ``[out, in]`` weight, with its own
learning rate (0.02 in his runs). Embeddings, the output head, norms, biases and any parameter that is not 2-D take
AdamW (torch's fused kernel), as Muon prescribes; :func:`muon_param_groups` splits a model so.

Host state: a Muon matrix keeps one fp32 momentum buffer (4 B/param) instead of AdamW's two moments (8 B), so a
matrix costs 12 B/param of host RAM (master, grad, momentum) against 16; a Llama-shaped model, whose matrices are
88-96% of its parameters, needs about 12.2-12.5 B/param in all (docs/strategy.md, "Muon").

Under ``MegaTrainStrategy`` the engine takes this optimizer's step like the host AdamW's: all or nothing
(engine/step_guard.py), overlapped layer by layer with the next forward (engine/overlap.py), clipping applied in
the update; ``gpu_optimizer_groups`` (Adam/AdamW only) are refused. ``step()`` runs the same :class:`MuonUpdate`, so
plain Lightning and the strategy compute the same update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatrain.optim.host_optimizer import (
    Hyper,
    _fused_adam,
    allocate_states,
    check_like,
    hyper_snapshot,
)
from lightning_megatrain.optim.newton_schulz import DeviceOrthogonalizer, orthogonalize_here

UpdateScale = Literal["rms", "spectral"]
UPDATE_SCALES = ("rms", "spectral")


def update_scale(shape: Sequence[int], kind: UpdateScale) -> float:
    """The factor ``s`` of a Muon update of an ``[m, n]`` matrix (see [Note: Muon])."""
    m, n = shape
    return 0.2 * max(m, n) ** 0.5 if kind == "rms" else max(1.0, m / n) ** 0.5


class Muon(Optimizer):
    """Muon for the param groups with ``use_muon=True`` (2-D matrices), AdamW for the others (see [Note: Muon]).

    Works as any torch optimizer under plain Lightning; under ``MegaTrainStrategy`` the engine steps it on the host
    masters, with the Newton-Schulz iteration on the GPU it trains on.

    Args:
        params: parameters or param-group dicts; a group without ``use_muon`` takes Muon. :func:`muon_param_groups`
            builds the usual split.
        lr: learning rate of every group (``update_scale="rms"`` makes one rate fit both kinds). Default 1e-3.
        weight_decay: decoupled weight decay of every group. Default 0.01.
        momentum: Muon's momentum ``beta``. Default 0.95.
        nesterov: Muon's Nesterov momentum. Default True.
        ns_steps: Newton-Schulz iterations. Default 5.
        update_scale: ``"rms"`` (AdamW-matched, default) or ``"spectral"`` (Keller Jordan's), see [Note: Muon].
        betas: AdamW's ``(beta1, beta2)`` for the groups without Muon. Default (0.9, 0.999).
        eps: AdamW's epsilon. Default 1e-8.
        ns_device: where the Newton-Schulz iteration runs (in bf16 on CUDA, fp32 on the CPU): ``"auto"`` (default)
            is the GPU ``MegaTrainStrategy`` trains on, else the parameters' own device; ``"cpu"``, ``"cuda"`` or
            ``"cuda:N"`` force one. For host parameters on a GPU, through pinned buffers
            (optim/newton_schulz.py, [Note: Newton-Schulz placement]).

    Raises:
        ValueError: a Muon group holds a parameter that is not 2-D, or an argument is out of range.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        update_scale: UpdateScale = "rms",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        ns_device: str | torch.device = "auto",
    ) -> None:
        problems = []
        if not 0.0 <= momentum < 1.0:
            problems.append(f"momentum={momentum!r}: need 0 <= momentum < 1")
        if type(ns_steps) is not int or ns_steps < 1:
            problems.append(f"ns_steps={ns_steps!r}: need an int >= 1 (5 is Muon's)")
        if update_scale not in UPDATE_SCALES:
            problems.append(f"update_scale={update_scale!r}: choose one of {UPDATE_SCALES}")
        device = _parse_device(ns_device)
        if device is None:
            problems.append(f"ns_device={ns_device!r}: need 'auto', 'cpu', 'cuda' or 'cuda:N'")
        elif device != "auto" and device.type == "cuda" and not torch.cuda.is_available():
            problems.append(f"ns_device={ns_device!r}: CUDA is not available here; use 'auto' or 'cpu'")
        if problems:
            raise ValueError("Invalid Muon arguments:\n- " + "\n- ".join(problems))
        defaults = dict(
            lr=lr, weight_decay=weight_decay, use_muon=True, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, update_scale=update_scale, betas=betas, eps=eps,
        )
        self.ns_device: torch.device | Literal["auto"] = device  # type: ignore[assignment]
        self._orthogonalizer: DeviceOrthogonalizer | None = None  # pinned slots, made on first use
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            flat = [p for p in group["params"] if p.ndim != 2]
            if flat:
                self.param_groups.pop()  # the optimizer stays as it was
                raise ValueError(
                    f"Muon orthogonalises 2-D matrices, but a param group with use_muon=True holds a parameter of "
                    f"shape {list(flat[0].shape)}. HINT: build the groups with "
                    "lightning_megatrain.optim.muon_param_groups(model) (embeddings, head, norms, biases and other "
                    "non-matrices to AdamW), or put such parameters in a group with use_muon=False."
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p, state in self.state.items():  # torch keeps "step" where it was saved; the fused kernel reads it here
            if isinstance(state.get("step"), Tensor):
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device)

    def orthogonalizer(self, device: torch.device) -> DeviceOrthogonalizer:
        """The pinned slots and side stream for host matrices orthogonalised on ``device``, kept between steps."""
        largest = max((p.numel() for g in self.param_groups if g["use_muon"] for p in g["params"]), default=1)
        current = self._orthogonalizer
        if current is None or current.device != device or current.max_numel < largest:
            self._orthogonalizer = current = DeviceOrthogonalizer(device, largest)
        return current

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = MuonUpdate(self)
        params = [p for group in self.param_groups for p in group["params"]]
        update.prepare([params])
        update(params)
        return loss


def _parse_device(value: object) -> torch.device | Literal["auto"] | None:
    """``ns_device`` as a device or ``"auto"``; None when it names neither the CPU nor a CUDA device."""
    if value == "auto":
        return "auto"
    try:
        device = torch.device(value)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        return None
    return device if device.type in ("cpu", "cuda") else None


def muon_param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """``module``'s trainable parameters as Muon's groups: the 2-D hidden matrices with ``use_muon=True``; with
    ``use_muon=False`` the embeddings and the output head (:func:`embedding_weights`) and every parameter that is not
    2-D (norms, biases, stacked 3-D MoE expert weights). Empty groups are left out; each dict may be edited (a ``lr``
    of its own, say)."""
    embeddings = embedding_weights(module)
    muon, adamw = [], []
    for p in module.parameters():  # a shared (tied) parameter comes once
        if p.requires_grad:
            (muon if p.ndim == 2 and id(p) not in embeddings else adamw).append(p)
    return [g for g in ({"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}) if g["params"]]


def embedding_weights(module: nn.Module) -> set[int]:
    """Ids of the weights that map tokens in or out: every ``nn.Embedding``'s, what each HF model inside ``module``
    returns from ``get_input_embeddings``/``get_output_embeddings``, and parameters named ``*lm_head.weight``."""
    found = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    found |= {id(p) for name, p in module.named_parameters() if name.endswith("lm_head.weight")}
    try:
        from transformers import PreTrainedModel
    except ImportError:  # an optional dependency of the package
        return found
    for sub in module.modules():
        if not isinstance(sub, PreTrainedModel):
            continue
        for getter in (sub.get_input_embeddings, sub.get_output_embeddings):
            try:
                weight = getattr(getter(), "weight", None)
            except NotImplementedError:  # a model without that embedding
                continue
            if isinstance(weight, Tensor):
                found.add(id(weight))
    return found


class MuonUpdate:
    """:class:`Muon`'s update of its parameters for one step, with its state of *now*, applied group by group: the
    host update the engine runs for Muon, with the interface of ``host_optimizer.HostUpdate`` (:meth:`prepare` first
    over every group: states allocated and checked; then calls that only compute; ``started`` counts parameters
    whose update has begun). ``Muon.step()`` runs it over all parameters at once.

    Args:
        optimizer: the :class:`Muon` optimizer.
        grad_scale: clipping's factor, multiplied into the grads right before their update (deferred clipping).
        skip: ids of parameters not to update.
        snapshot: a ``hyper_snapshot`` taken earlier (the step's own, when the update is built on the overlap worker).
        device: the engine's compute device: where ``ns_device="auto"`` orthogonalises; None outside the engine
            (each parameter's own device).
    """

    def __init__(
        self,
        optimizer: Muon,
        grad_scale: Tensor | None = None,
        skip: frozenset[int] = frozenset(),
        snapshot: Hyper | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.optimizer = optimizer
        self._group_of, self._hyper = snapshot or hyper_snapshot(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._grads = {id(p): p.grad for p in params if p.grad is not None and id(p) not in skip}
        self._grad_scale = grad_scale
        self._device = device
        self._orthogonalizers: dict[torch.device, DeviceOrthogonalizer] = {}  # by NS device, from prepare
        self.started = 0

    def _h(self, p: Tensor) -> dict[str, Any]:
        return self._hyper[id(self._group_of[id(p)])]

    def _present(self, params: Sequence[Tensor]) -> list[Tensor]:
        return [p for p in params if id(p) in self._grads]

    def _ns_device(self, p: Tensor) -> torch.device:
        """Where ``p``'s iteration runs: ``ns_device``, or for ``"auto"`` the engine's device, else ``p``'s own.

        Raises:
            RuntimeError: ``ns_device="cpu"`` for a parameter on a GPU.
        """
        chosen = self.optimizer.ns_device
        device = (self._device or p.device) if chosen == "auto" else chosen
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cpu" and p.device.type != "cpu":
            raise RuntimeError(
                f"Muon(ns_device={chosen!r}) orthogonalises on the CPU, but a parameter is on {p.device}. "
                "HINT: use ns_device='auto' (the parameters' device)."
            )
        return device

    def prepare(self, groups: Iterable[Sequence[Tensor]]) -> None:
        """Create the states a first update of ``groups``' parameters creates (Muon: ``momentum_buffer``; AdamW:
        ``step``, ``exp_avg``, ``exp_avg_sq`` as torch's fused AdamW has them), the pinned slots where matrices
        are orthogonalised on a GPU, and check every tensor the update reads; a failure removes what it created.

        Raises:
            RuntimeError: a gradient or state that is not a dense tensor of its parameter's shape, dtype and device.
        """
        allocate_states(self.optimizer, [p for group in groups for p in self._present(group)], self._new_state,
                        check=self._check)

    def _check(self, p: Tensor) -> None:
        """Raise for a gradient or state of ``p`` its update cannot take; make its NS device's orthogonalizer."""
        state = self.optimizer.state[p]
        if self._h(p)["use_muon"]:
            check_like(p, {"gradient": self._grads[id(p)], "momentum_buffer": state["momentum_buffer"]},
                       "Muon")
            device = self._ns_device(p)
            if device != p.device and device not in self._orthogonalizers:
                self._orthogonalizers[device] = self.optimizer.orthogonalizer(device)
            return
        check_like(p, {"gradient": self._grads[id(p)], "exp_avg": state["exp_avg"],
                       "exp_avg_sq": state["exp_avg_sq"]}, "AdamW")
        step = state["step"]
        if not (isinstance(step, Tensor) and step.numel() == 1 and step.device == p.device):
            raise RuntimeError(f"the AdamW step count of a Muon optimizer's parameter is {step!r}")

    def _new_state(self, p: Tensor) -> dict[str, Any]:
        zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)
        if self._h(p)["use_muon"]:
            return {"momentum_buffer": zeros()}
        return {"step": torch.zeros((), dtype=torch.float32, device=p.device), "exp_avg": zeros(),
                "exp_avg_sq": zeros()}

    @torch.no_grad()
    def __call__(self, params: list[Tensor]) -> None:
        """Update ``params`` (part of what :meth:`prepare` was given) as ``Muon.step()`` would."""
        adamw: dict[int, list[Tensor]] = {}
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in self._present(params):
            if self._h(p)["use_muon"]:
                by_device.setdefault(self._ns_device(p), []).append(p)
            else:
                adamw.setdefault(id(self._group_of[id(p)]), []).append(p)
        for key, ps in adamw.items():
            self.started += len(ps)
            grads = [self._grads[id(p)] for p in ps]
            if self._grad_scale is not None:  # as clip_grad_norm_ scales them (not the kernel's division by 1/scale)
                torch._foreach_mul_(grads, self._grad_scale)
            _fused_adam(ps, grads, [self.optimizer.state[p] for p in ps], self._hyper[key], True, None)
        for device, ps in by_device.items():
            jobs = [(p.shape, lambda out, p=p: self._direction(p, out), self._h(p)["ns_steps"],
                     lambda o, p=p: self._apply(p, o)) for p in ps]
            if device == ps[0].device:
                orthogonalize_here(jobs)  # fp32 on the CPU; bf16 (_direction casts) for parameters on a GPU
            else:
                self._orthogonalizers[device].run(jobs)

    def _direction(self, p: Tensor, out: Tensor | None) -> Tensor:
        """Update ``p``'s momentum and return the matrix to orthogonalise (``U`` in [Note: Muon]), written into
        ``out`` (a pinned bf16 slot: cast in the same pass) when given."""
        self.started += 1
        h, grad = self._h(p), self._grads[id(p)]
        if self._grad_scale is not None:
            grad.mul_(self._grad_scale)  # deferred clipping, as clip_grad_norm_ scales grads in place
        buf = self.optimizer.state[p]["momentum_buffer"]
        buf.lerp_(grad, 1 - h["momentum"])
        if out is not None:
            return torch.lerp(grad, buf, h["momentum"], out=out) if h["nesterov"] else out.copy_(buf)
        u = grad.lerp(buf, h["momentum"]) if h["nesterov"] else buf
        return u.bfloat16() if u.device.type == "cuda" else u  # Muon's bf16 iteration on a GPU

    def _apply(self, p: Tensor, o: Tensor) -> None:
        h = self._h(p)
        if h["weight_decay"]:
            p.mul_(1 - h["lr"] * h["weight_decay"])
        p.add_(o, alpha=-h["lr"] * update_scale(p.shape, h["update_scale"]))
