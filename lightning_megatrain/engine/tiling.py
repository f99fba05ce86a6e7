"""Sequence tiles: the position-wise block of each decoder layer (its MLP or MoE block) run a tile of positions at a
time, in forward and in the recompute.

[Note: sequence tiles]
(to be written with the mechanism)
"""

from __future__ import annotations

from lightning_megatrain.config import Auto

# ``seq_tile="auto"`` tiles only rows longer than this many positions: below it the block's transient memory is small
# next to a layer's saved activations, and a tiled block inside a kept layer's graph is recomputed in backward.
AUTO_MIN_POSITIONS = 32_768
# ``seq_tile="auto"``'s tile: long enough that the block's matmuls stay efficient ([tile * B, H] x [H, I]).
AUTO_TILE = 16_384


def tile_length(seq_tile: int | Auto | None, seq_len: int) -> int | None:
    """Positions per tile for rows of ``seq_len`` positions under ``seq_tile``; None when the block runs untiled."""
    if seq_tile is None:
        return None
    if seq_tile == "auto":
        return AUTO_TILE if seq_len > AUTO_MIN_POSITIONS else None
    return seq_tile if seq_len > seq_tile else None
