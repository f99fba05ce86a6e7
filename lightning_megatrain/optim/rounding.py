"""The two number formats of compact host state: 8-bit block-quantized Adam moments and bf16 by stochastic rounding.

Plain torch ops on 1D chunks, written so that ``torch.compile`` fuses them (optim/compact_adam.py calls them inside
its kernel); every function is a pure function of its inputs, so a step computed twice, or after a resume, is
bitwise the same.

[Note: 8-bit moments]
Block-wise quantization as in Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022): each
block of ``BLOCK`` consecutive elements is normalized by its own absolute maximum (one fp32 scale per block, so an
outlier costs precision in its block only) and each normalized value is stored in one byte. The code map is not the
paper's dynamic-tree map (a 256-entry table searched per element) but a closed-form non-linear map, chosen because
it needs no table lookup and fuses into the update's single pass over memory:

- first moment (signed): ``code = round(127 * sign(x) * sqrt(|x| / scale))`` (int8, -127..127), decoded as
  ``scale * d * |d|`` with ``d = code / 127``: relative error 0.8% at the block maximum, 8% at 1/100 of it;
- second moment (>= 0): ``code = round(255 * (x / scale) ** (1/4))`` (uint8), decoded as ``scale * d**4`` with
  ``d = code / 255``: sqrt(v), what the update divides by, has 0.4% relative error at the block maximum and 3.9%
  at 1/10,000 of it; values below 1.5e-11 of the maximum decode as 0.

``BLOCK = 256``: the two scales cost 2 x 4 / 256 = 0.031 bytes per parameter.

[Note: stochastic rounding]
A bf16 weight keeps 8 significant bits, so an update below half a unit in the last place (2**-9 relative: an AdamW
step of lr=1e-4 on a weight of 0.1) rounds back to the same weight every time and training stalls. Stochastic
rounding rounds up with probability equal to the discarded fraction, so the expected bf16 weight equals the fp32
result and small updates accumulate in expectation. The random bits are a counter-based hash of (element index,
seed): no generator state to save, the same bits on a resume, whatever the chunking (optim/compact_adam.py derives
the seed from the optimizer's seed, the step count and the parameter's index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 256  # elements per quantization block, one fp32 scale each; see [Note: 8-bit moments]
_M32 = 0xFFFFFFFF


def n_blocks(numel: int) -> int:
    """Quantization blocks (scales) for ``numel`` elements."""
    return -(-numel // BLOCK)


def _blocks(x: Tensor) -> Tensor:
    """``x`` (1D) zero-padded to whole blocks, as [n_blocks, BLOCK]."""
    pad = -x.numel() % BLOCK
    return (F.pad(x, (0, pad)) if pad else x).view(-1, BLOCK)


def _per_element(scale: Tensor, numel: int) -> Tensor:
    """Each block's scale repeated over its elements: [numel]."""
    return scale.view(-1, 1).expand(-1, BLOCK).reshape(-1)[:numel]


def _inverse(scale: Tensor, numel: int) -> Tensor:
    """1 / each block's scale (0 for an all-zero block) over its elements: [numel]. The reciprocal is taken per block,
    so the elements are multiplied, not divided."""
    return _per_element(torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)), numel)


def encode_signed(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 [n] -> (int8 codes [n], fp32 scales [n_blocks]); see [Note: 8-bit moments]."""
    scale = _blocks(x).abs().amax(dim=1)  # [n_blocks]
    y = x.abs() * _inverse(scale, x.numel())  # in [0, 1]
    q = torch.round(127.0 * torch.sqrt(y))
    return torch.where(x < 0, -q, q).to(torch.int8), scale  # where, not copysign: inductor vectorizes it


def decode_signed(codes: Tensor, scale: Tensor) -> Tensor:
    """int8 codes [n] and fp32 scales -> fp32 [n]."""
    d = codes.to(torch.float32) * (1.0 / 127.0)
    return d * d.abs() * _per_element(scale, codes.numel())


def encode_unsigned(x: Tensor, root: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 x >= 0 [n] and its square root (which the Adam update has computed already: one square root fewer per
    element) -> (uint8 codes [n], fp32 scales [n_blocks]: each block's max of x); see [Note: 8-bit moments]. The
    code is round(255 * sqrt(root / sqrt(scale)))."""
    scale = _blocks(x).amax(dim=1)  # [n_blocks]
    codes = torch.round(255.0 * torch.sqrt(root * _inverse(scale.sqrt(), root.numel())))  # a root per block
    return codes.to(torch.uint8), scale


def decode_unsigned(codes: Tensor, scale: Tensor) -> Tensor:
    """uint8 codes [n] and fp32 scales -> fp32 [n]."""
    d = codes.to(torch.float32) * (1.0 / 255.0)
    d = d * d
    return d * d * _per_element(scale, codes.numel())


def mix_seed(*values: int) -> int:
    """One 32-bit seed from several integers (the optimizer's seed, a step, a parameter index)."""
    h = 0x811C9DC5
    for v in values:
        h = _hash32(h ^ (v & _M32))
    return h


def _hash32(x: int) -> int:
    """A 32-bit integer hash ("lowbias32"-style: xor-shifts and two odd multipliers, both below 2**31)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def _hash_bits(start: Tensor, numel: int) -> Tensor:
    """The low 16 bits of :func:`_hash32` of ``start + i`` for ``i < numel`` (int32 [numel]; ``start`` 0-dim int64).
    In int32 with wrapping adds and multiplies (vectorized integer ops wrap) and logical shifts written as
    arithmetic shift and mask: half the vector work of int64."""
    low = ((start + 2**31) & 0xFFFFFFFF) - 2**31  # the low 32 bits as a signed int32 value
    x = low.to(torch.int32) + torch.arange(numel, dtype=torch.int32, device=start.device)
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x5BD1E995
    return (x ^ ((x >> 16) & 0xFFFF)) & 0xFFFF


def nearest_bits(x: Tensor) -> Tensor:
    """fp32 [n] -> int32 [n]: the bits of the fp32 value equal to the bf16 nearest to ``x`` (ties to even), by
    integer arithmetic. ``x.to(bfloat16).float()`` is the same value in eager mode, but inductor folds that round trip
    away, so a rounding error computed from it comes out 0 under ``torch.compile``. Finite values only (a NaN's
    payload may wrap)."""
    bits = x.view(torch.int32)
    return (bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000


def round_stochastic(x: Tensor, start: Tensor) -> Tensor:
    """fp32 [n] -> fp32 [n] holding ``x`` rounded stochastically to a bf16 value (see [Note: stochastic rounding]);
    its conversion to bf16 is exact.

    ``start`` (0-dim int64): the hash input of element 0 (the seed plus the chunk's offset); element ``i`` draws
    its 16 random bits from ``hash(start + i)``. Adding them below the 16 bits that bf16 drops and clearing those
    rounds the magnitude up with probability (dropped bits) / 2**16 (the sign bit is untouched: finite values do not
    carry into it). inf stays inf; a finite value within one bf16 unit of the largest finite one may round to inf,
    as round-to-nearest does; a NaN's payload may wrap. (Writing the top 16 bits through an int16 view of the bf16
    weights instead would skip a bit cast, but inductor does not vectorize a loop that stores int16.)
    """
    return ((x.view(torch.int32) + _hash_bits(start, x.numel())) & -0x10000).view(torch.float32)
