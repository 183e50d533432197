"""``PackedLayout``: a (heads x blocks x blocks) 0/1 layout kept as bits, eight blocks per byte, and
unpacked to the bool corner a call's length needs.

Note [layout as bits]
    ``SparseSelfAttention`` keeps the layout made for ``max_seq_length`` for the whole run (every
    shorter call takes its top-left corner). As bools that is ``(L / block)^2`` bytes per distinct
    head layout: 4 MiB at 16k tokens with blocks of 8, as much as the attention's own working memory
    saves against a flash kernel. As bits it is an eighth. A layout shared by every head is kept once
    (``shared``) and its unpacked corner is a broadcast view over the heads. Unpacking happens when an
    executor plans a length (its plans are cached), not on every call.
"""

from __future__ import annotations

import torch

_BAND = 256  # block rows packed at a time
_BIT_VALUES = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(layout: torch.Tensor) -> torch.Tensor:
    """``layout`` (..., n) of 0/1 as uint8 (..., ceil(n / 8)): bit ``j % 8`` of byte ``j // 8`` is column ``j``."""
    n = layout.shape[-1]
    padded = torch.nn.functional.pad(layout.to(torch.uint8), (0, -n % 8))
    grouped = padded.reshape(*padded.shape[:-1], -1, 8)
    return (grouped * _BIT_VALUES).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The bool (..., n) that :func:`pack_bits` packed (its first ``n`` columns)."""
    bits = packed.unsqueeze(-1).bitwise_and(_BIT_VALUES).ne(0)
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


class PackedLayout:
    """A sparsity layout as bits.

    Args:
        layout: ``(heads, blocks, blocks)``, 0/1 of any dtype (``make_layout``'s int64), or ``(1, blocks,
            blocks)`` for a layout every one of ``heads`` shares (``make_distinct_bool_layout``'s).
        heads: the number of heads (default: the layout's first dimension).
    """

    def __init__(self, layout: torch.Tensor, heads: int | None = None) -> None:
        if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
            raise ValueError(f"a layout is (heads, blocks, blocks), got shape {tuple(layout.shape)}")
        if heads is not None and layout.shape[0] not in (1, heads):
            raise ValueError(f"a layout of {layout.shape[0]} heads for {heads} heads: give one per head, or one")
        self.heads, self.blocks = heads or layout.shape[0], layout.shape[1]
        self.shared = bool((layout == layout[:1]).all())  # one layout for every head: kept once
        kept = layout[:1] if self.shared else layout
        # packed a band of rows at a time: the transient uint8 copies stay small at any length
        self.bits = torch.cat([pack_bits(kept[:, r : r + _BAND]) for r in range(0, self.blocks, _BAND)], dim=1)

    def corner(self, n: int) -> torch.Tensor:
        """The bool ``(heads, n, n)`` top-left corner; a broadcast view over the heads when they share it."""
        if not 0 <= n <= self.blocks:
            raise ValueError(f"corner of {n} blocks from a layout of {self.blocks}")
        rows = unpack_bits(self.bits[:, :n, : -(-n // 8)], n)
        return rows.expand(self.heads, n, n) if self.shared else rows.contiguous()

    def heads_slice(self, start: int, stop: int) -> PackedLayout:
        """The layout of heads ``[start, stop)`` only (a copy of their bits)."""
        local = object.__new__(PackedLayout)
        local.heads, local.blocks, local.shared = stop - start, self.blocks, self.shared
        local.bits = self.bits.clone() if self.shared else self.bits[start:stop].clone()
        return local

    @property
    def nbytes(self) -> int:
        """The bytes the layout holds."""
        return self.bits.untyped_storage().nbytes()
