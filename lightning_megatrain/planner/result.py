"""A plan's result: :class:`Plan`, what :func:`~lightning_megatrain.planner.planning.plan` returns and the report
prints, and the rule that compares a plan with the attention memos against the same plan without them
(:func:`memo_pays`, the rule of ``attention_memo="auto"``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_megatrain.planner.constants import MEMO_MIN_GAIN
from lightning_megatrain.planner.memory import _gpu_peak
from lightning_megatrain.planner.report import render, verdict


@dataclass
class Plan:
    """Result of :func:`~lightning_megatrain.planner.planning.plan`. Bytes are bytes, times are seconds per optimizer
    step, rates per second."""

    model: str
    precision: str
    optimizer: str
    loss: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    offload_activations: bool
    n_params: int
    n_layers: int
    layer_params: int  # all layers together
    max_layer_params: int
    resident_params: int
    active_params: int  # per token: residents + shared layer weights + k/E of the experts
    host: dict[str, int]
    host_limit: int
    host_reserve: int  # of host_limit, left to the OS and other processes (host_os_reserve): the plan may use the rest
    gpu: dict[str, int]  # items; the "phase:" ones are alternatives (peak = persistent + the larger phase)
    gpu_limit: int
    max_micro_batch: int  # largest micro-batch that fits gpu_limit (0: none)
    max_micro_batch_host: int  # largest whose host RAM (offloaded activations grow with it) fits host_usable
    activation_per_token: dict[str, float]  # one layer recomputed with grad: saved, transient (bytes/token)
    time: dict[str, float]
    transfers_hidden: bool
    min_micro_batch_to_hide: int | None
    tokens_per_step: int
    tokens_per_s: float
    model_tflops: float
    mfu: float
    mfu_with_attention: float
    assumptions: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # overlap_optimizer only: the fewest gpu_optimizer_groups whose host Adam no longer outlasts the next forward
    suggested_gpu_optimizer_groups: int | None = None
    # long sequences, or seq_tile / segment_layers / device_checkpoints in effect: the placement planned, its
    # reason, and the longest sequence that fits this machine at this micro-batch (planner/long_context.py); None
    # for a plan those options leave as the engine was before them (and then absent from to_dict and report)
    long_context: dict[str, Any] | None = None
    # the host state layout planned (planner/memory.py HOST_STATE_BYTES); absent from to_dict and the report's
    # header when "fp32"
    host_state: str = "fp32"
    # gpu_optimizer_groups="auto" where the host cannot hold every group's state (planner/pool.py, [Note: memory
    # pool]): the groups planned, the fewest the split needs, their parameters, whether it fits, why; None otherwise
    memory_pool: dict[str, Any] | None = None
    # several ranks (planner/ranks.py, [Note: planning several ranks]): the layout, the per-rank host items, the
    # setup peak, the collectives' seconds and their assumptions; None (and absent from to_dict and report) for one
    ranks: dict[str, Any] | None = None
    # seconds of compute the attention memos take out of the step, the most they can shorten it (timing.py
    # memo_saved_s); 0 in fp32 (cuDNN's kernel, the one the memo calls, runs fp16/bf16). Not in to_dict
    memo_bound: float = 0.0
    # the last layers whose memos fit the GPU memory this plan leaves within the share keep_layers="auto" fills
    # (engine/recompute.py DEVICE_FRACTION; memory.py memo_layers_fitting): the partial memos ``megatrain plan``
    # weighs where all layers' do not fit or pay; 0 in fp32. Not in to_dict
    memo_fitting: int = 0

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def host_state_bytes_per_param(self) -> float:
        """Masters + grads + optimizer states per parameter (16 with AdamW)."""
        return (self.host["masters"] + self.host["grads"] + self.host["optimizer states"]) / self.n_params

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_total / self.n_params

    @property
    def gpu_total(self) -> int:
        return _gpu_peak(self.gpu)

    @property
    def gpu_allocated(self) -> int:
        """The GPU peak less the runtime reserve: the tensors ``torch.cuda.max_memory_allocated`` counts, what a run
        is compared with."""
        return self.gpu_total - self.gpu["runtime reserve"]

    @property
    def host_usable(self) -> int:
        """Host RAM the plan may use: the limit less what is left to the OS and other processes."""
        return self.host_limit - self.host_reserve

    @property
    def fits(self) -> bool:
        """The host RAM fits ``host_usable``, the GPU peak ``gpu_limit``, planned with the long-context options some
        placement of the layer-input checkpoints fits both, and a split of the state between both memories fits as
        the engine decides it (``memory_pool``: with its host slack, planner/pool.py)."""
        placed = self.long_context is None or self.long_context["fits"]
        pooled = self.memory_pool is None or self.memory_pool["fits"]
        setup = self.ranks is None or self.ranks["setup_host_bytes"] <= self.host_usable
        return (self.host_total <= self.host_usable and self.gpu_total <= self.gpu_limit and placed and pooled
                and setup)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["memo_bound"], d["memo_fitting"]
        for optional in ("long_context", "memory_pool", "ranks"):
            if d[optional] is None:
                del d[optional]
        if d["host_state"] == "fp32":
            del d["host_state"]
        d.update(host_total=self.host_total, gpu_total=self.gpu_total, host_bytes_per_param=self.host_bytes_per_param,
                 host_state_bytes_per_param=self.host_state_bytes_per_param, host_usable=self.host_usable,
                 fits=self.fits)
        return d

    def report(self) -> str:
        """A readable table (GiB = 2**30 bytes): planner/report.py."""
        return render(self)

    def verdict(self) -> str:
        """One line: FITS or DOES NOT FIT, each limit's use, and the binding one (the least spare) with its margin."""
        return verdict(self)


def memo_may_pay(without: Plan) -> bool:
    """Whether the memos could make ``without`` (a plan without them) ``MEMO_MIN_GAIN`` faster at all: it saves at
    most ``without.memo_bound`` of its step. Where it cannot, the plan with them is not made."""
    step = without.tokens_per_step / without.tokens_per_s
    return without.memo_bound >= step * (1 - 1 / MEMO_MIN_GAIN)


def memo_pays(without: Plan, memo: Plan, fits: bool | None = None) -> bool:
    """The rule of ``attention_memo="auto"`` (config.py) and of ``megatrain plan``'s line naming the memos: the plan
    with them (``memo``) fits and is ``MEMO_MIN_GAIN`` faster than the same plan without (``without``). ``fits``:
    whether the memos fit where the caller judged it (the engine, against the memory it measured), else
    ``memo.fits``."""
    fitting = memo.fits if fits is None else fits
    return "attention memos" in memo.gpu and fitting and memo.tokens_per_s >= MEMO_MIN_GAIN * without.tokens_per_s


def partial_memo(without: Plan, plan_with: Callable[[int], Plan], fits: bool | None = None) -> Plan | None:
    """The plan with the last ``without.memo_fitting`` layers' memos (``plan_with(n)``), where every layer's do not
    fit and those do, and it pays (:func:`memo_pays`, ``fits`` as there): the explicit ``attention_memo=N`` that
    ``megatrain plan`` and the engine's log line name. None where no such N does."""
    n = without.memo_fitting
    if not 0 < n < without.n_layers or not memo_may_pay(without):
        return None
    part = plan_with(n)
    return part if memo_pays(without, part, fits) else None
