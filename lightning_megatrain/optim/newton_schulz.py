"""Muon's orthogonalisation: the Newton-Schulz quintic iteration, on the CPU or on a CUDA device for host matrices.

[Note: Newton-Schulz placement]
Muon replaces each matrix's momentum ``M`` (``m x n``) by the nearest semi-orthogonal matrix, ``U V^T`` of
``M = U S V^T``, approximated by 5 iterations of ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and
``(a, b, c) = (3.4445, -4.7750, 2.0315)`` on ``X = M / ||M||_F`` (Keller Jordan's coefficients: they push every
singular value into about [0.7, 1.2] in 5 steps; the exact ``U V^T`` is not needed). With ``X`` wide (``m <= n``,
transposed otherwise) one iteration is three matmuls: ``X X^T`` (``2 m^2 n`` FLOPs), ``A A`` (``2 m^3``) and
``B X`` (``2 m^2 n``), so a step costs :func:`ns_flops` ``= steps * (4 m^2 n + 2 m^3)``, per matrix:

- Llama-2-7B (32 layers of four 4096 x 4096 and three 4096 x 11008 matrices): 684 TFLOP per optimizer step;
  Llama-3.2-3B (28 layers, GQA): 207 TFLOP; Llama-3.1-8B: 666 TFLOP.
- On the CPU in fp32 that is hours per step for 7B on a small machine (2 cores of the test VM: ~34 GFLOP/s, so
  ~5.6 h for 7B), and 16 AVX-512 cores at 1-2 TFLOP/s would still take 350-700 s. On an H200 in bf16 (989 TFLOP/s
  dense peak; 50-70% of it assumed on these shapes, not yet measured) it is about 1-1.4 s for 7B, 0.3-0.4 s for 3B.

So the iteration runs where the training computes: on the CUDA device for host matrices (``ns_device="auto"``
under ``MegaTrainStrategy`` on a GPU), in bf16 as Muon does, through :class:`DeviceOrthogonalizer`: each matrix
crosses PCIe as bf16 (2 bytes per parameter each way, beside the 4 B/param of fp32 weights the next forward
uploads) while the host prepares the next matrix and applies the previous one. On the CPU (tests, a CPU compute
device, or ``ns_device="cpu"``) it runs in fp32: exact, and only practical for small models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # (a, b, c) of the quintic X <- a X + b A X + c A^2 X, A = X X^T
NS_EPS = 1e-7  # added to ||M||_F: a zero momentum stays zero instead of dividing by 0


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """Matmul FLOPs of :func:`newton_schulz` on an ``m x n`` matrix (see [Note: Newton-Schulz placement])."""
    small, large = min(m, n), max(m, n)
    return steps * (4 * small * small * large + 2 * small**3)


def newton_schulz(g: Tensor, steps: int = 5) -> Tensor:
    """The orthogonalised ``g`` (2-D, any float dtype), computed in ``g``'s dtype on ``g``'s device; ``g`` is not
    modified. See [Note: Newton-Schulz placement]."""
    a, b, c = NS_COEFFICIENTS
    tall = g.size(0) > g.size(1)
    x = g.mT if tall else g  # wide: X X^T is the smaller (m x m) product
    x = x / (torch.linalg.matrix_norm(x) + NS_EPS)
    for _ in range(steps):
        s = x @ x.mT  # [m, m]
        t = torch.addmm(s, s, s, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, t, x, beta=a)  # a X + (b A + c A^2) X, [m, n]
    return x.mT if tall else x


# A job: (the matrix's shape; make(out): write the matrix to orthogonalise into ``out`` and return it, or, for
# ``out=None``, return it as a new tensor; NS steps; apply(o): consume the orthogonalised matrix)
Job = tuple[torch.Size, Callable[[Tensor | None], Tensor], int, Callable[[Tensor], None]]


def orthogonalize_here(jobs: Iterable[Job]) -> None:
    """Run each job with the iteration on its input's own device and dtype: ``apply(newton_schulz(make(None)))``."""
    for _, make, steps, apply in jobs:
        apply(newton_schulz(make(None), steps))


class DeviceOrthogonalizer:
    """:func:`newton_schulz` in bf16 on a CUDA ``device`` for host (CPU) matrices, pipelined with the host's work.

    :meth:`run` takes jobs (see ``Job``): ``make(out)`` writes a matrix into ``out``, a pinned bf16 slot on the host
    (Muon's momentum blend, cast on the way: no fp32 temporary), ``apply(o)`` consumes its orthogonalised bf16 host
    copy ``o`` (the parameter update). While the device orthogonalises matrix k, the host makes matrix k+1 and then
    applies matrix k-1. The side stream uploads each slot, iterates and writes the result back into the same slot
    (the upload precedes the download on that stream, so the slot can hold both).

    Pinned memory: two slots of the largest matrix's size in bf16 (torch's pinned allocator rounds each up to a
    power of two: 256 MiB for Llama-3.1-8B's 4096 x 14336). GPU memory: the iteration's working set for two
    matrices, about 5 bf16 copies of the larger of each (~0.6 GB each at 4096 x 14336), from the caching allocator.

    Args:
        device: the CUDA device the iteration runs on.
        max_numel: elements of the largest matrix a job may make.
    """

    SLOTS = 2  # one matrix on the device, one being made or applied on the host

    def __init__(self, device: torch.device, max_numel: int) -> None:
        self.device = device
        self.max_numel = max_numel
        # Side stream: each matrix's upload, iteration and download, in order. It shares no tensor with the compute
        # stream (its inputs are pinned host slots, its device tensors its own allocations), so it needs no event
        # from it; it competes with the forward for SMs and with the weights' H2D stream for PCIe.
        self.stream = torch.cuda.Stream(device)
        self._slots = [torch.empty(max_numel, dtype=torch.bfloat16, pin_memory=True) for _ in range(self.SLOTS)]
        # - CUDA events for stream synchronization
        # _done[k]: recorded by ``stream`` after slot k's download; the host thread running :meth:`run` (the overlap
        # worker or the training thread) synchronizes on it before reading slot k's result, which is also before it
        # writes slot k again.
        self._done = [torch.cuda.Event() for _ in range(self.SLOTS)]

    def run(self, jobs: Iterable[Job]) -> None:
        """Run every job (see the class docstring); returns once every ``apply`` has run."""
        in_flight: list[tuple[int, Tensor, Callable[[Tensor], None]]] = []  # (slot, its view, apply), oldest first
        for k, (shape, make, steps, apply) in enumerate(jobs):
            slot = k % self.SLOTS  # free: the job that used it last was applied before job k - 1 was submitted
            view = self._slot(slot, shape)
            make(view)
            self._submit(slot, view, steps)
            in_flight.append((slot, view, apply))
            if len(in_flight) == self.SLOTS:
                self._finish(*in_flight.pop(0))
        for job in in_flight:
            self._finish(*job)

    def _slot(self, slot: int, shape: torch.Size) -> Tensor:
        """Slot ``slot`` as a bf16 host matrix of ``shape``."""
        numel = shape.numel()
        if numel > self.max_numel:
            raise RuntimeError(
                f"a Muon matrix of {list(shape)} is larger than the {self.max_numel}-element pinned slots of the "
                "device orthogonalizer"
            )
        return self._slots[slot][:numel].view(shape)

    def _submit(self, slot: int, view: Tensor, steps: int) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            x = view.to(self.device, non_blocking=True)
            view.copy_(newton_schulz(x, steps), non_blocking=True)  # after the upload on this stream: slot reusable
            self._done[slot].record(self.stream)

    def _finish(self, slot: int, view: Tensor, apply: Callable[[Tensor], None]) -> None:
        self._done[slot].synchronize()
        apply(view)
