"""DeepSpeed's six block-sparsity patterns: each config's ``make_layout(seq_len)`` returns the
``(num_heads, num_blocks, num_blocks)`` 0/1 layout of which key blocks each query block attends to.

The names, constructor arguments and layouts are DeepSpeed's (``deepspeed/ops/sparse_attention/
sparsity_config.py``, checked block for block in tests/unit/test_sparse_layouts.py). Random blocks are
drawn with Python's ``random`` in DeepSpeed's order, so the same ``random.seed`` gives the same
layout; ``seed=`` (our addition) draws them from a private ``random.Random(seed)`` instead, which
is what every rank of a run needs (Note [same layout on every rank]).

Note [same layout on every rank]: a layout with random blocks must be identical on all ranks, or
data-parallel ranks would train different models. DeepSpeed broadcasts it from rank 0 inside the
forward; we build it from a seed instead (the JSON and Hydra paths always pass one), so no
collective runs inside attention (which would hang a pipeline stage whose peers never call it).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

import torch

_DIRECTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str, horizontal_global_attention: bool = False) -> None:
    if attention not in _DIRECTIONS:
        raise NotImplementedError(f"attention={attention!r}: only 'unidirectional' and 'bidirectional' are supported")
    if attention != "bidirectional" and horizontal_global_attention:
        raise ValueError("horizontal_global_attention needs attention='bidirectional' (a global row would see "
                         "the future)")


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_indices ({len(starts)}) and global_block_end_indices ({len(ends)}) "
                         "must have the same length")
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"global block start index {start} must be smaller than its end index {end}")


def _global_ranges(starts: Sequence[int], ends: Sequence[int] | None, num_blocks: int) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges of the global blocks that fall inside ``num_blocks``."""
    if ends is None:
        return [(s, s + 1) for s in starts if s < num_blocks]
    return [(s, min(e, num_blocks)) for s, e in zip(starts, ends) if s < num_blocks]


class SparsityConfig:
    """What every pattern shares: the number of heads, the block size (tokens per side of a block)
    and whether each head gets its own layout (otherwise head 0's is copied to all)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        if num_heads < 1 or block < 1:
            raise ValueError(f"num_heads ({num_heads}) and block ({block}) must be positive")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero int64 layout for ``seq_len`` tokens (which must be a multiple of ``block``)."""
        if seq_len % self.block:
            raise ValueError(f"sequence length {seq_len} is not a multiple of the block size {self.block}: pad it "
                             "(SparseAttentionUtils.pad_to_block_size) or choose a block that divides it")
        n = seq_len // self.block  # on the CPU even under a meta-device context (a model built on meta)
        return torch.zeros((self.num_heads, n, n), dtype=getattr(self, "_layout_dtype", torch.int64), device="cpu")

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no pattern: use one of its subclasses")

    def make_distinct_bool_layout(self, seq_len: int) -> torch.Tensor:
        """``make_layout(seq_len)`` as bool, for the distinct head layouts only: ``(1, n, n)`` when every head
        shares head 0's, else ``(num_heads, n, n)`` (the same values; an eighth of the int64's bytes, and one
        head's instead of all when shared: 32 MiB rather than 128 MiB at 16k tokens, blocks of 8, 4 heads)."""
        local = copy.copy(self)
        local.num_heads = self.num_layout_heads
        local._layout_dtype = torch.bool
        return local.make_layout(seq_len)

    def _rng(self) -> random.Random | object:
        seed = getattr(self, "seed", None)
        return random if seed is None else random.Random(seed)


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (for comparison: dense attention through the sparse path)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _set_windows(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Block rows and columns ``[start, end)`` attend to each other (only to the past if unidirectional)."""
    size = end - start
    window = torch.ones(size, size, dtype=layout.dtype, device=layout.device)
    block = layout[h, start:end, start:end]
    block.copy_(torch.maximum(block, torch.tril(window) if unidirectional else window))  # adds, never clears


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformers' fixed pattern: local windows of ``num_local_blocks`` blocks, and in each
    window the last ``num_global_blocks`` blocks (head ``h`` shifted by ``h % num_different_global_patterns``
    windows of globals) seen by every later (or every, bidirectional) row; ``horizontal_global_attention``
    makes the global rows see everything too."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks:
            raise ValueError(f"num_local_blocks ({num_local_blocks}) must be a multiple of num_global_blocks "
                             f"({num_global_blocks})")
        _check_attention(attention, horizontal_global_attention)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed "
                             f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        for start in range(0, n, self.num_local_blocks):
            _set_windows(layout, h, start, min(start + self.num_local_blocks, n), self.attention == "unidirectional")
        return layout

    def _set_global(self, h: int, layout: torch.Tensor, start: int) -> None:
        end = start + self.num_global_blocks
        layout[h, 0 if self.attention == "bidirectional" else start:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n, w, g = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        offset = w - (1 + h % self.num_different_global_patterns) * g  # first global block inside a window
        full_windows_end = n - n % w
        for start in range(offset, full_windows_end, w):
            self._set_global(h, layout, start)
        if full_windows_end < n:  # a short last window still gets its globals, pulled inside the sequence
            self._set_global(h, layout, min(full_windows_end + offset, n - g))
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """Fixed's generalisation: ``num_random_blocks`` random blocks per row, local windows of the sizes
    in ``local_window_blocks`` (the last size repeating), and global blocks at given indices (or
    ``[start, end)`` ranges with ``global_block_end_indices``). ``seed`` (ours): see the module note."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False,
                 seed: int | None = None) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention, horizontal_global_attention)
        if not local_window_blocks or min(local_window_blocks) < 1:
            raise ValueError(f"local_window_blocks must be non-empty positive sizes, got {local_window_blocks}")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: object = random) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) exceeds the {n} blocks of a row")
        for row in range(n):  # DeepSpeed draws Variable's random blocks from the whole row, either direction
            layout[h, row, rng.sample(range(n), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n, uni = layout.shape[1], self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            _set_windows(layout, h, min(start, n), min(start + size, n), uni)
            start += size
        size = self.local_window_blocks[-1]
        for begin in range(start, n, size):
            _set_windows(layout, h, begin, min(begin + size, n), uni)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, 0 if self.attention == "bidirectional" else start:, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout, rng = self.setup_layout(seq_len), self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def _set_sliding_window(layout: torch.Tensor, h: int, window_blocks: int, bidirectional: bool = True) -> None:
    n = layout.shape[1]
    if n < window_blocks:
        raise ValueError(f"num_sliding_window_blocks ({window_blocks}) exceeds the {n} blocks of a row")
    half = window_blocks // 2
    rows = torch.arange(n, device=layout.device)[:, None]
    cols = torch.arange(n, device=layout.device)[None, :]
    band = (cols >= rows - half) & (cols <= (rows + half if bidirectional else rows))
    layout[h][band] = 1


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: ``num_random_blocks`` random blocks per row (from the past only if unidirectional), a
    sliding window of ``num_sliding_window_blocks``, and the first ``num_global_blocks`` blocks as
    global rows and columns. ``seed`` (ours): see the module note."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional", seed: int | None = None) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: object = random) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) exceeds the {n} blocks of a row")
        for row in range(n):
            population = n if self.attention == "bidirectional" else row + 1
            layout[h, row, rng.sample(range(population), min(self.num_random_blocks, population))] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_global_blocks:
            raise ValueError(f"num_global_blocks ({self.num_global_blocks}) exceeds the {n} blocks of a row")
        layout[h, : self.num_global_blocks, :] = 1
        layout[h, :, : self.num_global_blocks] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout, rng = self.setup_layout(seq_len), self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        if self.attention == "unidirectional":  # nothing attends to the future
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window of ``num_sliding_window_blocks`` and global blocks at
    given indices (or ``[start, end)`` ranges) that see and are seen by everything."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, layout.shape[1]):
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Only a sliding window of ``num_sliding_window_blocks`` (its past half if unidirectional)."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional") -> None:
        super().__init__(num_heads, block)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, self.attention == "bidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)
