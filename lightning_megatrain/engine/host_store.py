"""Host-resident state: each layer's *masters* and *grads* packed into one flat host buffer each.

After :func:`pack_group`, every parameter of the group is a view into ``FlatGroup.master`` (pinned when the compute
device is CUDA, so the H2D stream reads it at full PCIe speed), so optimizers, ``state_dict()`` and checkpoints see
ordinary CPU parameters: fp32, or bf16 where ``host_state`` stores bf16 masters and grads (optim/compact_adam.py,
[Note: compact host state]). Norms of the grads are accumulated in fp32 whatever their dtype. ``p.grad`` is a view
into ``FlatGroup.grad`` once a gradient has arrived; Lightning's ``zero_grad(set_to_none=True)`` drops the views,
and the next :meth:`FlatGroup.accumulate` re-attaches them.

[Note: aligned views]
The flat buffers (and the device slots, which copy their layout: engine/transfer.py) hold the parameters one after
another, so a parameter's view starts where the previous ones' elements end. Kernels that read their operands
through vector loads need 16-byte aligned pointers: torch's grouped GEMM (transformers' default ``grouped_mm``
experts) refuses an unaligned one ("expected data_ptr to be aligned to 16 bytes"). A small parameter of odd size
shifts every view after it: a gpt-oss layer with 4 attention heads has a 4-element ``sinks`` first, which left its
experts' weights 8 bytes off in bf16. :func:`pack_group` therefore lays out the parameters whose element count is a
multiple of :data:`ALIGN_ELEMENTS` first (in module order), then the others: every view of the first kind starts
16-byte aligned in any dtype of 1 to 4 bytes, with no padding. Nothing else depends on the order: every reader of a
group goes through ``params`` and ``offsets``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_megatrain._hardware import GIB, placeable_host_bytes
from lightning_megatrain.engine.discovery import TensorSlot
from lightning_megatrain.engine.pinned import PAGE, HostRegistry, round_up
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS

# A parameter of a multiple of this many elements keeps the next view's alignment ([Note: aligned views]): 16 bytes
# at 1 byte per element, more at 2 and 4.
ALIGN_ELEMENTS = 16


@dataclass
class FlatGroup:
    """Parameters of one layer (or all residents) packed into one 1D host buffer."""

    params: list[nn.Parameter]  # unique parameters in layout order
    offsets: list[int]  # start of each parameter in the flat buffers
    master: Tensor  # 1D host, [numel], fp32 or bf16 (the layout's); the parameters' storage
    new_grad: Callable[[], Tensor]  # allocates ``grad`` on first use
    slot_index: list[tuple[TensorSlot, int]] = field(default_factory=list)  # parameter slot -> index into params
    grad_dtype: torch.dtype = torch.float32  # the dtype ``new_grad`` allocates (the layout's)
    # Squared norm of ``self.grad`` as the device last wrote it whole (0-dim device tensor: one arrival, or the
    # device-side sum of all arrivals); it spares clipping a pass over host memory. Set and cleared by the gradient
    # drains (engine/drain.py, engine/residents.py), None whenever a host-side add changed ``self.grad`` afterwards.
    device_norm_sq: Tensor | None = None
    _grad: Tensor | None = None

    @property
    def grad(self) -> Tensor:
        """1D host, [numel], in ``grad_dtype``; storage of ``p.grad`` views. Allocated on first use: a device group
        whose grads no code reads never needs it (engine/device_state.py)."""
        if self._grad is None:
            self._grad = self.new_grad()
        return self._grad

    @property
    def numel(self) -> int:
        return self.master.numel()

    def release_grad(self, free: Callable[[Tensor], None] | None) -> None:
        """Drop the grad buffer while no ``p.grad`` views it (a group that became a device group: its grads are
        allocated again only if code reads them); ``free`` unregisters page-locked memory first."""
        if self._grad is None or any(p.grad is not None for p in self.params):
            return
        if free is not None:
            free(self._grad)
        self._grad = None

    @property
    def grad_nbytes(self) -> int:
        """Host bytes of the grad buffer, 0 while it is not allocated."""
        return 0 if self._grad is None else self._grad.nbytes

    def views(self, flat: Tensor) -> list[Tensor]:
        """Split a 1D buffer with this group's layout into per-parameter tensors shaped like the parameters."""
        return [flat[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]

    def accumulate(self, grads: list[Tensor | None], packed: Tensor | None = None) -> None:
        """Add ``grads`` (one per parameter, ``None`` = no gradient this pass) into the host grads (a bf16 add is
        computed in fp32 and rounded once, as torch adds bf16 tensors on the CPU).

        A parameter with ``p.grad is None`` gets a view of ``self.grad`` filled by copy (no zeroing pass), one with a
        gradient gets an in-place add, and a ``None`` entry leaves ``p.grad`` untouched, exactly as autograd would
        (an expert that saw no token keeps ``grad=None`` and the optimizer skips it). ``packed`` is the same data as
        one contiguous buffer, used for a single large copy/add when every parameter takes the same path.
        """
        if packed is not None and all(g is not None for g in grads):
            # ``packed`` may be shorter than the group: a rank's owned share whose pieces end before its padding
            # (engine/sharding.py), which stays zero
            if all(p.grad is None for p in self.params):
                self.grad[: packed.numel()].copy_(packed)
                self.attach_grads()
                return
            if self.grads_are_views():
                self.grad[: packed.numel()].add_(packed)
                return
        for p, view, g in zip(self.params, self.views(self.grad), grads):
            if g is None:
                continue
            if p.grad is None:
                view.copy_(g)
                p.grad = view
            else:
                p.grad.add_(g)

    def grads_are_views(self) -> bool:
        """Every parameter's grad is its view of ``self.grad`` (so the flat buffer *is* the gradient)."""
        return all(
            p.grad is not None and p.grad.data_ptr() == self.grad.data_ptr() + o * self.grad.element_size()
            for p, o in zip(self.params, self.offsets)
        )

    def attach_grads(self, present: list[bool] | None = None) -> None:
        """Point every ``p.grad`` (or those flagged in ``present``) at its view of ``self.grad`` (after a D2H wrote
        the whole flat buffer)."""
        for k, (p, view) in enumerate(zip(self.params, self.views(self.grad))):
            if present is None or present[k]:
                p.grad = view

    def grad_norm_sq(self) -> Tensor:
        """Squared L2 norm of all present grads (fp32 0-dim; on the device when measured there during backward).

        The device norm stands for the grads when the host holds them whole (the flat buffer is every ``p.grad``) or
        holds none of them: a device group's grads that stay on the device (engine/device_state.py).
        """
        if self.device_norm_sq is not None and all(p.grad is None for p in self.params):
            return self.device_norm_sq
        if self.grads_are_views():
            if self.device_norm_sq is not None:
                return self.device_norm_sq
            return _flat_norm_sq(self.grad)
        norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32).square() for p in self.params
                 if p.grad is not None]
        return torch.stack(norms).sum() if norms else torch.zeros(())

    def unpacked(self) -> list[TensorSlot]:
        """The parameter slots that no longer hold this group's master (the parameter replaced, or its data cast or
        moved: ``.double()``, ``.to(...)``); the engine streams and steps the masters only."""
        # a sharded layer's master is a stride-0 placeholder ([Note: sharded layer masters]): every view starts at base
        base, step = self.master.data_ptr(), self.master.stride(0) * self.master.element_size()
        return [
            slot
            for slot, k in self.slot_index
            if slot.get() is not self.params[k] or slot.get().data_ptr() != base + self.offsets[k] * step
        ]

    def scale_grads(self, factor: Tensor) -> None:
        """Multiply all present grads by ``factor`` in place (one op over the flat buffer when possible)."""
        if self.grads_are_views():
            self.grad.mul_(factor)
            return
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)


def check_packed(groups: list[FlatGroup], module: nn.Module) -> None:
    """Before a step: every parameter still holds its packed host master.

    Raises:
        RuntimeError: a parameter was cast, moved or replaced after setup (``.double()``, ``.half()``, ``.to(...)``,
            ``.cuda()``, a new ``nn.Parameter``); the engine would otherwise fail deep in a layer, or train the
            masters it packed while the module shows other tensors.
    """
    moved = [slot for group in groups for slot in group.unpacked()]
    if not moved:
        return
    names = {id(t): name for name, t in module.named_parameters()}
    found = [f"'{names.get(id(s.get()), s.name)}' is now {str(s.get().dtype).replace('torch.', '')} on {s.get().device}"
             for s in moved]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    raise RuntimeError(
        f"MegaTrainStrategy packed every parameter into a master in host RAM at setup, but {', '.join(found[:3])}"
        f"{more}: a parameter cast, moved or replaced after setup (`.double()`, `.half()`, `.to(...)`, `.cuda()`, a "
        "new nn.Parameter) is not what the engine streams and updates. HINT: build the module in its final form "
        "before fit (in __init__ or configure_model); choose the compute dtype with Trainer(precision=...) and leave "
        "devices to the strategy."
    )


def _flat_norm_sq(x: Tensor) -> Tensor:
    """Squared norm (fp32) of a 1D host tensor (fp32 or bf16, widened as it is read), reduced over rows of a 2D view
    so the reduction parallelizes over threads."""
    rows = 1024
    if x.numel() < rows:
        return x.float().square().sum()
    cut = x.numel() - x.numel() % rows
    # [rows] partial norms, in parallel
    head = torch.linalg.vector_norm(x[:cut].view(rows, -1), dim=1, dtype=torch.float32).square().sum()
    return head + x[cut:].float().square().sum()


def pack_group(
    slots: list[TensorSlot],
    registry: HostRegistry | None = None,
    lazy_grad: bool = False,
    master_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype = torch.float32,
) -> FlatGroup:
    """Move the parameters named by ``slots`` into one flat host buffer of ``master_dtype`` (their ``.data`` become
    views; a bf16 master is each value rounded to nearest, as ``module.to(torch.bfloat16)`` rounds it).

    With a ``registry`` (CUDA compute) both flat buffers are page-locked at their exact size (engine/pinned.py), so the
    H2D stream reads the masters and the D2H stream writes the grads at full PCIe speed. Parameters are copied one
    at a time so host memory peaks at the model plus one group, never twice the model. ``lazy_grad``: the grad
    buffer is allocated when first used (a device group's), else now; it holds ``grad_dtype``.
    """
    unique = {id(s.get()): s.get() for s in slots if s.is_param}  # module order, a tied weight once
    # the sizes that keep alignment first, each kind in module order ([Note: aligned views])
    params: list[nn.Parameter] = sorted(unique.values(), key=lambda p: p.numel() % ALIGN_ELEMENTS != 0)
    index_of = {id(p): k for k, p in enumerate(params)}
    slot_index = [(slot, index_of[id(slot.get())]) for slot in slots if slot.is_param]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()

    def copy_params(flat: Tensor) -> None:
        for p, offset in zip(params, offsets):
            flat[offset : offset + p.numel()].view(p.shape).copy_(p.detach())

    if registry is None:
        master = torch.empty(total, dtype=master_dtype)
        copy_params(master)
    else:
        master = registry.empty(total, master_dtype, init=copy_params)

    def new_grad() -> Tensor:
        return torch.empty(total, dtype=grad_dtype) if registry is None else registry.empty(total, grad_dtype)

    for p, view in zip(params, [master[o : o + p.numel()].view(p.shape) for p, o in zip(params, offsets)]):
        p.data = view  # the original storage is freed here unless the user holds another reference
    return FlatGroup(params=params, offsets=offsets, master=master, new_grad=new_grad, slot_index=slot_index,
                     grad_dtype=grad_dtype, _grad=None if lazy_grad else new_grad())


def check_host_memory(group_numels: list[int], pinned: bool, slab_bytes: int = 0, master_bytes: int = 4,
                      grad_bytes: int = 4, grad_numels: list[int] | None = None, host_state: str = "fp32") -> None:
    """Refuse to start when host RAM cannot hold the masters, grads and grad slabs (the optimizer states are checked
    once the optimizers exist, :func:`check_host_bytes_to_come`).

    Args:
        group_numels: parameters per flat group (each layer, and the residents).
        pinned: the flat buffers are page-locked (CUDA): exact sizes rounded to pages (engine/pinned.py).
        slab_bytes: bytes of each of the 3 pinned grad slabs (CUDA).
        master_bytes, grad_bytes: bytes per parameter of a master and a grad (the ``host_state`` layout's: 4 for
            fp32, 2 for bf16).
        grad_numels: parameters per group whose grad buffer setup allocates (default ``group_numels``); the others
            are allocated later or never (device groups, and every group while ``gpu_optimizer_groups="auto"`` is
            undecided: engine/placement.py) and are checked then.
        host_state: the run's layout; the refusal's HINT names only smaller ones (:func:`smaller_state_hint`).

    The fp32 model the user built (4 bytes/param) is freed group by group as it is packed, so it is subtracted.

    Raises:
        RuntimeError: the estimate exceeds what the process may allocate (``MemAvailable``, the cgroup's limit or
            ``RLIMIT_AS``) less the host reserve (``_hardware.placeable_host_bytes``, [Note: host reserve]); set
            ``MEGATRAIN_SKIP_MEMORY_CHECK=1`` to override.
    """
    n_params = sum(group_numels)
    block = (lambda nbytes: round_up(nbytes, PAGE) + PAGE) if pinned else (lambda nbytes: nbytes)
    grad_numels = group_numels if grad_numels is None else grad_numels
    flats = (sum(block(master_bytes * n) for n in group_numels)
             + sum(block(grad_bytes * n) for n in grad_numels if n))  # masters, grads
    need = flats + 3 * block(slab_bytes) - 4 * n_params
    what = "masters and grads" if grad_numels is group_numels else f"masters and {sum(grad_numels) / 1e9:.2f}B grads"
    _refuse_short(need, f"for {n_params / 1e9:.2f}B parameters ({what}: {_size(flats)}"
                        f"{' pinned' if pinned else ''}, minus the model already loaded)", host_state)


def check_layout_compute(host_state: str, compute_dtype: torch.dtype) -> None:
    """Bf16 masters need bf16 compute: under fp32 compute the layers would run on fp32 copies of bf16 values and
    their fp32 grads be rounded to bf16 on their way to the host, neither fp32 training nor the layout's.

    Raises:
        ValueError: a bf16 ``host_state`` with ``precision="32-true"``.
    """
    if HOST_STATE_LAYOUTS[host_state].bf16_compute_only and compute_dtype == torch.float32:
        raise ValueError(
            f"MegaTrainStrategy(host_state={host_state!r}) keeps bf16 masters and grads, which compute in bf16; got "
            "precision='32-true' (fp32 compute). HINT: use Trainer(precision='bf16-mixed'), or "
            "host_state='int8_moments' (fp32 masters, 10.03 host bytes/param) or 'fp32' to compute in fp32."
        )


def check_host_bytes_to_come(to_come: int, host_state: str = "fp32", per_host: int = 1, reserve: int = 0) -> None:
    """Refuse before the first step when host RAM cannot hold ``to_come`` more bytes: the host groups' grads
    not yet allocated and the optimizers' states (engine/host_budget.py ``host_bytes_to_come``). ``per_host``: the
    ranks of this host, each with as much to come (several ranks: their shares are alike to the padding);
    ``reserve``: bytes the other ranks keep free besides (``_hardware.other_processes_slack``).

    Raises:
        RuntimeError: as :func:`check_host_memory`.
    """
    ranks = f", {per_host} ranks on this host with {_size(to_come)} each" if per_host > 1 else ""
    _refuse_short(to_come * per_host, "for the grads and optimizer states of the first step (Adam/AdamW: 8 bytes "
                                      f"per parameter, Muon's matrices 4, CompactAdamW's 8-bit moments about 2{ranks})",
                  host_state, reserve)


def smaller_state_hint(host_state: str) -> str:
    """The refusals' HINT for a smaller state than ``host_state``'s, ending in ", " (empty where none is smaller):
    ``compact`` (CompactAdamW's layout, which computes in bf16), and Muon's one moment under fp32."""
    compact = sum(HOST_STATE_LAYOUTS["compact"].bytes_per_param().values())
    if sum(HOST_STATE_LAYOUTS[host_state].bytes_per_param().values()) <= compact:
        return ""
    muon = " or lightning_megatrain.optim.Muon (one fp32 moment)" if host_state == "fp32" else ""
    return (f"host_state='compact' with torch.optim.AdamW and precision='bf16-mixed' ({compact:.2f} B/param on "
            f"either memory){muon}, ")


def _refuse_short(need: int, what: str, host_state: str = "fp32", reserve: int = 0) -> None:
    """Raise where ``need`` exceeds what this process may place on the host less ``reserve`` (what the host's other
    ranks keep free)."""
    bound = placeable_host_bytes()
    if bound is None or os.environ.get("MEGATRAIN_SKIP_MEMORY_CHECK") == "1":
        return
    available, limit = max(bound[0] - reserve, 0), bound[1]
    if reserve:
        limit += f", less the {_size(reserve)} the host's other ranks keep free"
    if need > available:
        raise RuntimeError(
            f"MegaTrainStrategy needs about {_size(need)} more host RAM {what} but only {_size(available)} is "
            f"available ({limit}). HINT: use a machine with more RAM, a smaller model, "
            f"{smaller_state_hint(host_state)}or set MEGATRAIN_SKIP_MEMORY_CHECK=1 if you know better."
        )


def _size(nbytes: int) -> str:
    """GiB for large sizes, MiB below one GiB (a small model's needs do not print as 0.0 GiB)."""
    return f"{nbytes / GIB:.1f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"
