"""The largest model of a given family shape that fits a machine, in each host-state mode.

"Family shape" is the model's width (hidden size, heads, MLP, vocabulary) with the depth varied: each candidate is
the config with ``num_hidden_layers`` (and a ``layer_types`` pattern, repeated) changed, planned with :func:`plan`
exactly as ``megatrain plan`` plans it. Host RAM grows by the same bytes per added layer (its state and its offloaded
layer input), so two plans give the depth where host RAM runs out; plans at that depth and the next confirm it (a
step down while the estimate does not fit, up while the next does).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from lightning_megatrain.planner.memory import HOST_STATE_BYTES
from lightning_megatrain.planner.planning import Plan, plan
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


def _with_layers(config: Any, layers: int) -> Any:
    out = copy.deepcopy(config)
    out.num_hidden_layers = layers
    pattern = getattr(config, "layer_types", None)
    if isinstance(pattern, list) and pattern:
        out.layer_types = [pattern[i % len(pattern)] for i in range(layers)]
    return out


def largest_models(model: Any, *, host_states: tuple[str, ...] = tuple(HOST_STATE_BYTES), **plan_kwargs: Any
                   ) -> list[Capacity]:
    """For each of ``host_states``, the deepest model of ``model``'s shape whose :func:`plan` (with ``plan_kwargs``:
    ``seq_len``, ``micro_batch``, ``machine``, ``config``, ...) fits the machine.

    Raises:
        ValueError: as :func:`plan`; a config without ``num_hidden_layers``.
    """
    base = load_config(model)
    if not hasattr(base, "num_hidden_layers"):
        raise ValueError(f"largest_models needs a config with num_hidden_layers (the depth it varies); got "
                         f"{type(base).__name__}")
    out = []
    for state in host_states:
        at = lambda layers: plan(_with_layers(base, layers), host_state=state, **plan_kwargs)  # noqa: E731
        one, two = at(1), at(2)
        per_layer = two.host_total - one.host_total
        layers = max(1, 1 + (one.host_usable - one.host_total) // per_layer) if per_layer > 0 else 1
        best: Plan = at(layers)
        while not best.fits and layers > 1:
            layers -= 1
            best = at(layers)
        while best.fits and (deeper := at(layers + 1)).fits:
            layers, best = layers + 1, deeper
        out.append(Capacity(state, layers if best.fits else 0, best.n_params if best.fits else 0, best.host_total,
                            best.host_usable, best.host_state_bytes_per_param))
    return out


def render_capacities(model_name: str, capacities: list[Capacity]) -> str:
    """``megatrain plan --largest``'s table."""
    gib = 2**30
    lines = [f"Largest model of {model_name}'s shape (its width, num_hidden_layers varied) that fits, by host_state:",
             f"  {'host_state':<16}{'state B/param':>14}{'layers':>8}{'params':>10}{'host RAM GiB':>14}"]
    for c in capacities:
        params = f"{c.n_params / 1e9:.2f}B" if c.layers else "none"
        lines.append(f"  {c.host_state:<16}{c.state_bytes_per_param:>14.2f}{c.layers:>8}{params:>10}"
                     f"{c.host_total / gib:>8.1f} of {c.host_usable / gib:.1f}")
    lines.append("  (fp32 and int8_moments run today, int8_moments as CompactAdamW(weights='fp32') in "
                 "configure_optimizers; compact and compact_kahan need the engine integration: docs/compact-state.md)")
    return "\n".join(lines)
