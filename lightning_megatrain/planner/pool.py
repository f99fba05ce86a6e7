"""Both memories as one pool: how many device groups a model needs so that the rest of its state fits the host.

[Note: memory pool]
A device group (engine/device_state.py, [Note: device groups]) keeps its master, grad and both Adam moments on the
GPU; of those the host keeps only the master (the parameter itself, brought up to date when the host reads it) and,
only where code reads ``p.grad`` before the step, the grad. With the fp32 Adam/AdamW a group moved to the GPU thus
frees 12 of the host's 16 bytes per parameter and takes 18 of the GPU's (8 for the residents, whose compute copy
and grad exist anyway). Compact layouts pool too ([Note: compact device groups]): the GPU holds the ``host_state``
layout itself and the host the master in its weight dtype, so a layer parameter moved frees 4.03 of ``compact``'s
6.03 host bytes (bf16 grad, 8-bit moments) for 6.03 on the GPU, 6.03 of ``compact_kahan``'s 8.03 (the Kahan
compensation moves too) for 8.03, 6.03 of ``int8_moments``' 10.03 for 12.03 (memory.py ``host_bytes``, engine/
device_state.py ``gpu_bytes_per_param``). When the host cannot hold every group's grads and states,
``gpu_optimizer_groups="auto"`` moves the fewest groups, in the order the forward reads them (the residents, then
layers 0, 1, ...), with which

    host:  what the host groups still allocate (grads, optimizer states)  +  the offloaded layer-input checkpoints
           <=  the host memory free once the masters are packed  -  SPLIT_HOST_MARGIN_GIB
    GPU:   the planned peak of one micro-batch with those groups (memory.py ``gpu_bytes``)  <=  the GPU's memory

both hold, with the checkpoints placed for that split as planner/long_context.py places them (the fewer the
groups, the less host memory is left for the checkpoints, so a split may move checkpoints to the GPU or into
segments). The host side falls as groups are added and the GPU side rises, so the fitting counts are one range and
the fewest is the first that fits; once the GPU's floor (one checkpoint per layer, none on the GPU) overflows with
``n`` groups, it overflows with more, and nothing fits. Where more groups are wanted to hide the overlapped fp32 host
Adam (planning.py's suggestion, not made for compact layouts), the larger count is used if it fits. The host's
masters (4 bytes/param in fp32, 2 in bf16) stay: they are the parameters every reader of host state sees
(checkpoints, validation, hooks); they bound the model to about a quarter (fp32) or a half (bf16) of the usable host
RAM per parameter, and the GPU, at 18 (6.03 compact) bytes/param, to what it holds beside the working set. On the
H200 (139 GiB GPU, 124.2 GiB of a 128 GiB host usable) the Llama-2-13B shape fits at full precision with
both memories; the Qwen2.5-14B shape does not (tests/planner/test_pool.py has the numbers). Compact, the 13B's
width fits 65 layers (20.95B) on the host alone and 110 (35.22B) with both memories, 72 groups on the GPU, at 8 x
1,024 (tests/planner/test_compact_pool.py).

The engine decides with the same search at the first training micro-batch, with the host bytes it measures and the
exact bytes its groups and optimizers will allocate (engine/placement.py, ``choose_gpu_optimizer_groups``); the
planner with its model of them (``host_to_come``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_megatrain._hardware import ENGINE_HOST_SLACK_GIB, GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS
from lightning_megatrain.planner.constants import GPU_RESERVE_GIB, SPLIT_HOST_MARGIN_GIB
from lightning_megatrain.planner.long_context import Placement, place
from lightning_megatrain.planner.memory import HOST_STATE_BYTES, _gpu_peak, gpu_bytes, gpu_keywords
from lightning_megatrain.planner.shape import _Shape, describe


@dataclass(frozen=True)
class Split:
    """The device groups of one micro-batch shape (:func:`split`). Bytes are bytes."""

    groups: int  # device groups: the residents, then the first ``groups - 1`` layers
    device_params: int
    host_to_come: int  # grads and optimizer states the host groups still allocate
    host_free: int  # host memory free for them and the offloaded checkpoints
    gpu_peak: int  # the planned peak with these groups and this placement
    gpu_limit: int
    placement: Placement | None  # the checkpoints placed for this split (None: the host cannot hold the states)
    fits: bool
    why: str
    numels: tuple[int, ...] = ()  # parameters of each group in forward order (:func:`forward_numels`)


def forward_numels(s: _Shape) -> list[int]:
    """Parameters of each group in the order the forward reads them: the residents, then each layer."""
    return [s.resident_params] + [ly.numel for ly in s.layers]


def host_to_come(s: _Shape, groups: int, *, grads: float, states: float, grads_read: bool = False) -> int:
    """The planner's model of the host bytes still to be allocated with ``groups`` device groups: ``grads`` +
    ``states`` bytes per parameter of each host group, and ``grads`` per device-group parameter when code reads
    ``p.grad`` (``grads_read``: their grads then reach the host, engine/device_state.py)."""
    numels = forward_numels(s)
    on_host = sum(numels[groups:])
    return round((grads + states) * on_host + (grads * (sum(numels) - on_host) if grads_read else 0))


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def split(s: _Shape, micro_batch: int, seq_len: int, *, config: EngineConfig, gkw: dict, host_free: int,
          gpu_limit: int, to_come: Callable[[int], int], least: int = 0) -> Split:
    """The fewest device groups, at least ``least``, with which the host holds ``to_come(n)`` and the offloaded
    checkpoints with ``SPLIT_HOST_MARGIN_GIB`` to spare and the GPU the planned peak (see [Note: memory pool]); where
    none does, ``fits`` is False and ``why`` has both memories' numbers of the closest count.

    Args:
        gkw: memory.py ``gpu_bytes``' keyword arguments without ``gpu_groups`` and the long-context ones.
        host_free: host bytes free for ``to_come(n)`` and the checkpoints.
        to_come: host bytes still to be allocated with ``n`` device groups (grads, optimizer states).
    """
    total = len(s.layers) + 1
    numels = forward_numels(s)
    room = host_free - round(SPLIT_HOST_MARGIN_GIB * GIB)  # what the split may plan of host_free

    def floor(n: int) -> int:  # the GPU peak with n groups, one checkpoint per layer, none on the GPU
        return _gpu_peak(gpu_bytes(s, micro_batch, seq_len, **gkw, gpu_groups=n)[0])

    def result(n: int, placed: Placement | None, fits: bool, why: str) -> Split:
        peak = placed.gpu_peak if placed is not None else floor(n)
        return Split(groups=n, device_params=sum(numels[:n]), host_to_come=to_come(n), host_free=host_free,
                     gpu_peak=peak, gpu_limit=gpu_limit, placement=placed, fits=fits, why=why, numels=tuple(numels))

    def numbers(n: int, placed: Placement | None) -> str:
        host = to_come(n) + (placed.host_need if placed is not None else 0)
        peak = placed.gpu_peak if placed is not None else floor(n)
        return (f"host needs {_size(host)} more of {_size(host_free)} free ({SPLIT_HOST_MARGIN_GIB:g} GiB kept "
                f"spare), GPU peak {_size(peak)} of {_size(gpu_limit)}")

    for n in range(least, total + 1):
        if to_come(n) <= room:
            placed = place(s, micro_batch, seq_len, config=config, gkw={**gkw, "gpu_groups": n},
                           host_free=room - to_come(n), gpu_limit=gpu_limit)
            if placed.fits:
                moved = f"{n} group{'s' if n != 1 else ''} ({sum(numels[:n]) / 1e9:.2f}B params) on the GPU"
                lead = "" if n == least else (f"with {n - 1} the host holds not both the rest of the state and the "
                                              "layer-input checkpoints; ")
                return result(n, placed, True, f"{lead}{moved}: {numbers(n, placed)}")
        if floor(n) > gpu_limit:  # more groups only raise the GPU's floor
            break
    fewest = next((k for k in range(least, total + 1) if to_come(k) <= room), None)
    if fewest is None:
        return result(total, None, False, f"not even with all {total} groups on the GPU does the host hold the "
                                          f"rest: it needs {_size(to_come(total))} more of {_size(host_free)} free "
                                          f"({SPLIT_HOST_MARGIN_GIB:g} GiB kept spare)")
    placed = place(s, micro_batch, seq_len, config=config, gkw={**gkw, "gpu_groups": fewest},
                   host_free=room - to_come(fewest), gpu_limit=gpu_limit)
    detail = "" if floor(fewest) > gpu_limit else f"; {placed.why}"
    return result(fewest, placed, False,
                  f"the host holds the grads and optimizer states only with {fewest} groups "
                  f"({sum(numels[:fewest]) / 1e9:.2f}B params) or more on the GPU, and with {fewest}: "
                  f"{numbers(fewest, placed)}{detail}")


def auto_split(model: object, host: dict[str, int], host_usable: int, gpu_limit: int, *, micro_batch: int,
               seq_len: int, host_state: str, attn_implementation: str | None, config: EngineConfig,
               gkw: dict) -> Split:
    """:func:`split` as :func:`~lightning_megatrain.planner.plan` runs it for ``gpu_optimizer_groups="auto"`` with
    Adam/AdamW in the ``host_state`` layout (memory.py ``HOST_STATE_BYTES``): ``host`` is the plan's host items
    without device groups; the host memory free for the split is ``host_usable`` less every item but the grads, the
    optimizer states, the offloaded layer inputs and the masters' Kahan compensation (which device groups keep on
    the GPU with their moments: it is counted as a host group's state), and less ``ENGINE_HOST_SLACK_GIB``, which
    the engine's split leaves free of what it measures ([Note: host reserve] in _hardware.py), so that the plan
    chooses the engine's count."""
    s = describe(model, attn_implementation=attn_implementation)
    per = HOST_STATE_BYTES[host_state]
    compensation = per["masters"] - HOST_STATE_LAYOUTS[host_state].weight_dtype.itemsize
    fixed = sum(v for k, v in host.items() if k not in ("grads", "optimizer states", "activation offload"))
    fixed -= round(compensation * s.n_params)
    to_come = lambda n: host_to_come(  # noqa: E731
        s, n, grads=per["grads"], states=per["optimizer states"] + compensation)
    slack = round(ENGINE_HOST_SLACK_GIB * GIB)
    return split(s, micro_batch, seq_len, config=config, gkw=gkw, host_free=host_usable - fixed - slack,
                 gpu_limit=gpu_limit, to_come=to_come)


def _engine_split(s: _Shape, micro_batch: int, seq_len: int, *, config: EngineConfig, gpu_limit: int,
                  host_free: int, to_come: Callable[[int], int], precision: str, loss: str,
                  loss_chunk_size: int, gpu_reserve_gib: float) -> Split:
    gkw = gpu_keywords(config, precision=precision, loss=loss, loss_chunk=loss_chunk_size, reserve_gib=gpu_reserve_gib)
    return split(s, micro_batch, seq_len, config=config, gkw=gkw, host_free=host_free, gpu_limit=gpu_limit,
                 to_come=to_come)


def split_first_batch(model: object, micro_batch: int, seq_len: int, *, config: EngineConfig, gpu_limit: int,
                      host_free: int, to_come: Callable[[int], int], precision: str = "bf16-mixed",
                      loss: str = "chunked", attn_implementation: str | None = None, loss_chunk_size: int = 4096,
                      gpu_reserve_gib: float = GPU_RESERVE_GIB) -> Split:
    """:func:`split` as the engine runs it at the first training micro-batch (engine/placement.py): the model from
    its HF config, the host bytes free (measured) and still to come (``to_come(n)``, counted from its groups and
    optimizers), and a GPU of ``gpu_limit`` bytes (the plan counts the slots, residents, groups and reserve); the
    device groups in ``config.host_state``'s layout."""
    s = describe(model, attn_implementation=attn_implementation)
    return _engine_split(s, micro_batch, seq_len, config=config, gpu_limit=gpu_limit, host_free=host_free,
                         to_come=to_come, precision=precision, loss=loss, loss_chunk_size=loss_chunk_size,
                         gpu_reserve_gib=gpu_reserve_gib)


def split_options(model: object, micro_batch: int, seq_len: int, *, config: EngineConfig, gpu_limit: int,
                  host_free: int, to_come: Callable[[int], int], precision: str = "bf16-mixed",
                  loss: str = "chunked", attn_implementation: str | None = None, loss_chunk_size: int = 4096,
                  gpu_reserve_gib: float = GPU_RESERVE_GIB) -> str:
    """Where no split fits (:func:`split_first_batch`): what would, in words, for the refusal's HINT: the largest
    smaller micro-batch at this sequence length with its split, and, under the fp32 ``host_state``, whether
    CompactAdamW's 8-bit moments (``int8_moments``, memory.py ``HOST_STATE_BYTES``, all on the host) let the host hold
    every group's state."""
    s = describe(model, attn_implementation=attn_implementation)
    kw = dict(config=config, gpu_limit=gpu_limit, host_free=host_free, to_come=to_come, precision=precision,
              loss=loss, loss_chunk_size=loss_chunk_size, gpu_reserve_gib=gpu_reserve_gib)
    lo, hi = 0, micro_batch  # the largest fitting micro-batch below micro_batch (fitting falls as it grows)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _engine_split(s, mid, seq_len, **kw).fits else (lo, mid)
    out = []
    if lo:
        smaller = _engine_split(s, lo, seq_len, **kw)
        out.append(f"micro-batch {lo} x {seq_len} fits with gpu_optimizer_groups={smaller.groups} "
                   f"(host {_size(smaller.host_to_come + smaller.placement.host_need)} of {_size(host_free)} free, "
                   f"GPU peak {_size(smaller.gpu_peak)} of {_size(gpu_limit)})")
    else:
        out.append(f"no micro-batch of {seq_len} tokens fits at any split: shorter sequences hold fewer activations")
    if config.host_state != "fp32":
        return "; ".join(out)
    compact = HOST_STATE_BYTES["int8_moments"]
    need = host_to_come(s, 0, grads=compact["grads"], states=compact["optimizer states"])
    verdict = "fits" if need <= host_free else "does not fit either"
    out.append(f"CompactAdamW(weights='fp32') in configure_optimizers (8-bit moments, "
               f"{sum(compact.values()):.2f} B/param of host state, all on the host) {verdict}: its grads and "
               f"states need {_size(need)} of {_size(host_free)} free")
    return "; ".join(out)
