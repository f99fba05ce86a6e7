"""The largest model of a given family shape that fits a machine, in each host-state mode.

"Family shape" is the model's width (hidden size, heads, MLP, vocabulary) with the depth varied: each candidate is
the config with ``num_hidden_layers`` (and a ``layer_types`` pattern, repeated) changed, planned with :func:`plan`
exactly as ``megatrain plan`` plans it. Host RAM grows by the same bytes per added layer (its state and its offloaded
layer input), so two plans give the depth where host RAM runs out; from there plans in doubling steps and a
bisection find the deepest that fits (the GPU bounds it too where device groups take state, [Note: memory pool]).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS
from lightning_megatrain.planner.memory import HOST_STATE_BYTES
from lightning_megatrain.planner.planning import plan
from lightning_megatrain.planner.result import Plan
from lightning_megatrain.planner.shape import load_config


@dataclass(frozen=True)
class Capacity:
    """The deepest fitting model of one host-state mode (``layers == 0``: not even one layer fits)."""

    host_state: str
    layers: int
    n_params: int
    host_total: int  # bytes, of that model's plan
    host_usable: int
    state_bytes_per_param: float
    gpu_groups: int = 0  # device groups of that plan: > 0 where both memories hold the state ([Note: memory pool])
    both_memories: bool = False  # planned with gpu_optimizer_groups="auto" where the row's config had an int
    gpu_total: int = 0  # bytes, that plan's GPU peak


def with_layers(config: Any, layers: int) -> Any:
    """``config`` (a ``PretrainedConfig`` or an HF config dict) at ``layers`` decoder layers, a copy: a
    ``layer_types`` pattern (gpt-oss's sliding and full attention) repeated to that depth."""
    is_dict = isinstance(config, dict)
    pattern = config.get("layer_types") if is_dict else getattr(config, "layer_types", None)
    changes: dict[str, Any] = {"num_hidden_layers": layers}
    if isinstance(pattern, list) and pattern:
        changes["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    if is_dict:
        return {**config, **changes}
    out = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(out, key, value)
    return out


def _deepest(at: Callable[[int], Plan], start: int) -> tuple[int, Plan]:
    """The deepest depth whose plan fits (fitting falls with depth), searched from ``start`` by doubling steps up or
    down, then bisection; ``(0, the plan at 1)`` where not even 1 layer fits."""
    plans: dict[int, Plan] = {}

    def fits(layers: int) -> bool:
        if layers not in plans:
            plans[layers] = at(layers)
        return plans[layers].fits

    step = 1
    if fits(start):  # lo fits, hi does not
        lo = start
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, lo = start, 0
        while hi > 1:
            below = max(1, hi - step)
            if fits(below):
                lo = below
                break
            hi, step = below, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, plans[lo] if lo else plans.get(1) or at(1)


def largest_models(model: Any, *, host_states: tuple[str, ...] = tuple(HOST_STATE_BYTES), **plan_kwargs: Any
                   ) -> list[Capacity]:
    """For each of ``host_states``, the deepest model of ``model``'s shape whose :func:`plan` (with ``plan_kwargs``:
    ``seq_len``, ``micro_batch``, ``machine``, ``config``, ...) fits the machine; then, with Adam/AdamW where
    ``config.gpu_optimizer_groups`` is an int, for each of them the deepest with both memories
    (``gpu_optimizer_groups="auto"``, planner/pool.py, [Note: memory pool]; compact layouts keep theirs on the GPU
    too, [Note: compact device groups]).

    Raises:
        ValueError: as :func:`plan`; a config without ``num_hidden_layers``.
    """
    base = load_config(model)
    if not hasattr(base, "num_hidden_layers"):
        raise ValueError(f"largest_models needs a config with num_hidden_layers (the depth it varies); got "
                         f"{type(base).__name__}")
    config = plan_kwargs.pop("config", EngineConfig())
    if plan_kwargs.get("precision") == "32-true":  # layouts that plan() refuses under fp32 compute
        host_states = tuple(state for state in host_states if not HOST_STATE_LAYOUTS[state].bf16_compute_only)
    rows = [(state, config, False) for state in host_states]
    if config.gpu_optimizer_groups != "auto" and plan_kwargs.get("optimizer", "adamw") in ("adamw", "adam"):
        rows += [(state, config.replace(gpu_optimizer_groups="auto"), True) for state in host_states]
    out = []
    for state, row_config, both in rows:
        at = lambda layers: plan(with_layers(base, layers), host_state=state, config=row_config,  # noqa: E731
                                 **plan_kwargs)
        one, two = at(1), at(2)
        per_layer = two.host_total - one.host_total
        start = max(1, 1 + (one.host_usable - one.host_total) // per_layer) if per_layer > 0 else 1
        layers, best = _deepest(at, start)
        out.append(Capacity(state, layers, best.n_params if layers else 0, best.host_total, best.host_usable,
                            best.host_state_bytes_per_param, best.assumptions["gpu_optimizer_groups"], both,
                            best.gpu_total))
    return out


def render_capacities(model_name: str, capacities: list[Capacity]) -> str:
    """``megatrain plan --largest``'s table."""
    gib = 2**30
    lines = [f"Largest model of {model_name}'s shape (its width, num_hidden_layers varied) that fits, by host_state:",
             f"  {'host_state':<28}{'state B/param':>14}{'layers':>8}{'params':>10}{'host RAM GiB':>16}"
             f"{'GPU groups':>12}{'GPU peak GiB':>14}"]
    for c in capacities:
        params = f"{c.n_params / 1e9:.2f}B" if c.layers else "none"
        name = c.host_state + (" + GPU (auto)" if c.both_memories else "")
        lines.append(f"  {name:<28}{c.state_bytes_per_param:>14.2f}{c.layers:>8}{params:>10}"
                     f"{c.host_total / gib:>8.1f} of {c.host_usable / gib:<5.1f}{c.gpu_groups:>12}"
                     f"{c.gpu_total / gib:>14.1f}")
    lines.append("  (state B/param: host bytes; GPU groups keep their grads and Adam states (in the host_state's "
                 "layout) on the GPU and their masters on both, planner/pool.py; each host_state is "
                 "MegaTrainStrategy(host_state=...), docs/compact-state.md says what each costs and how far each is "
                 "tested)")
    return "\n".join(lines)
