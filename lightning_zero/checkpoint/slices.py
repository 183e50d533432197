"""Tensor-parallel slices in a sharded checkpoint: the element mapping between a slice and its whole tensor.

Note [TP slices in checkpoints]
    A parameter split by tensor parallelism (Note [split tags] in tensor_parallel/layers.py) is written by
    each TP rank as its own slice, in that rank's flat groups. ``metadata.json`` refers to the *whole*
    tensor with a parts reference (format version 2)::

        {"tp": {"dim": d, "chunks": c}, "parts": [ref of TP rank 0's slice, ...], "shape": whole shape,
         "numel": whole numel, "dtype": cast or null}

    and the top-level ``tensor_parallel`` record (:class:`~lightning_zero.checkpoint.layout.TensorParallelRecord`)
    names the TP size and every split key's ``dim`` / ``chunks``. The same holds for the optimizer state's
    per-element tensors (Adam's moments), so both are unsplit tensors to every reader: a whole value is read
    (``convert``, a run without TP) as from any other reference.

    Loading into a TP run (any TP size) asks for a slice of the whole: :func:`slice_ref` wraps the whole
    reference in a ``{"slice": {...}, "of": whole}`` reference of the local shape. Along ``dim`` a tensor of
    ``chunks`` blocks, each cut into ``size`` parts of ``part`` rows, is laid out (flattened, row-major) as
    runs of ``part x inner`` elements (``inner``: the product of the dimensions after ``dim``) that are
    contiguous both in the whole tensor and in one slice. :func:`slice_runs` maps a slice's elements to the
    whole's and :func:`whole_runs` the whole's to the slices', run by run; reading goes through both when a
    TP-2 checkpoint is read at TP 1 or 4, with no whole tensor ever built (one bounded read per run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


def split_dim(param: torch.Tensor) -> int | None:
    """The dimension ``param`` was split along, or ``None`` when it is replicated (Note [split tags] in
    tensor_parallel/layers.py)."""
    return getattr(param, "tp_split_dim", None)


@dataclass(frozen=True)
class SplitTag:
    """How a split parameter was cut (Note [split tags] in tensor_parallel/layers.py): ``chunks`` blocks along
    ``dim``, each cut into ``size`` parts, this one the ``rank``-th part of every block."""

    dim: int
    chunks: int
    size: int
    rank: int

    def whole_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The unsplit tensor's shape, from a slice's."""
        return tuple(n * self.size if i == self.dim else n for i, n in enumerate(local))


def split_of(param: torch.Tensor) -> SplitTag | None:
    """The whole tag of a split parameter, or ``None`` when it is replicated."""
    dim = split_dim(param)
    if dim is None:
        return None
    return SplitTag(dim, param.tp_chunks, param.tp_size, param.tp_rank)  # type: ignore[attr-defined]


def tag_split(param: torch.Tensor, tag: SplitTag) -> None:
    """Mark ``param`` as the slice ``tag`` describes (Note [split tags] in tensor_parallel/layers.py)."""
    param.tp_split_dim = tag.dim  # type: ignore[attr-defined]
    param.tp_chunks = tag.chunks  # type: ignore[attr-defined]
    param.tp_size = tag.size  # type: ignore[attr-defined]
    param.tp_rank = tag.rank  # type: ignore[attr-defined]


def _geometry(shape: list[int] | tuple[int, ...], dim: int, chunks: int, size: int) -> tuple[int, int, int]:
    """``(n, part, run)``: the whole size along ``dim``, one slice's rows of a block, one run's elements."""
    n = int(shape[dim])
    if n % (chunks * size):
        raise ValueError(f"dimension {dim} of size {n} does not split into {chunks} block(s) x {size} slices")
    inner = math.prod(int(s) for s in shape[dim + 1:])
    part = n // (chunks * size)
    return n, part, part * inner


def slice_runs(whole_shape: list[int] | tuple[int, ...], dim: int, chunks: int, size: int, rank: int,
               start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(slice offset, whole offset, length)`` covering elements ``[start, end)`` of slice ``rank`` of ``size``
    (flattened), as runs contiguous in both (Note [TP slices in checkpoints])."""
    n, part, run = _geometry(whole_shape, dim, chunks, size)
    if run == 0 or end <= start:
        return
    inner = run // part
    for r in range(start // run, (end - 1) // run + 1):
        outer, c = divmod(r, chunks)
        local = r * run
        whole = outer * n * inner + (c * size + rank) * run
        a, b = max(start, local), min(end, local + run)
        yield a, whole + (a - local), b - a


def whole_runs(whole_shape: list[int] | tuple[int, ...], dim: int, chunks: int, size: int,
               start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(slice rank, slice offset, whole offset, length)`` covering elements ``[start, end)`` of the whole
    tensor (flattened), run by run (Note [TP slices in checkpoints])."""
    _, _, run = _geometry(whole_shape, dim, chunks, size)
    if run == 0 or end <= start:
        return
    for r in range(start // run, (end - 1) // run + 1):
        outer, rest = divmod(r, chunks * size)
        c, rank = divmod(rest, size)
        whole = r * run
        a, b = max(start, whole), min(end, whole + run)
        yield rank, (outer * chunks + c) * run + (a - whole), a, b - a


def parts_ref(parts: list[Mapping[str, Any]], dim: int, chunks: int, whole_shape: list[int]) -> dict[str, Any]:
    """The reference to a whole tensor written as one slice per TP rank (in TP rank order)."""
    return {"tp": {"dim": dim, "chunks": chunks}, "parts": [dict(p) for p in parts], "shape": list(whole_shape),
            "numel": math.prod(whole_shape), "dtype": parts[0].get("dtype")}


def slice_ref(ref: Mapping[str, Any] | None, param: nn.Parameter, shape: list[int]) -> Mapping[str, Any] | None:
    """``ref`` (a tensor of ``shape``) as a reference to ``param``'s TP slice of it, when ``param`` is split and
    ``shape`` is the unsplit one; anything else (replicated, plain data such as Adam's ``step``, a wrong shape,
    which the loader reports) is returned as it is."""
    tag = split_of(param)
    if tag is None or ref is None or "value" in ref:
        return ref
    if tuple(shape) != tag.whole_shape(tuple(param.shape)):
        return ref
    return {"slice": {"dim": tag.dim, "chunks": tag.chunks, "size": tag.size, "rank": tag.rank}, "of": dict(ref),
            "shape": list(param.shape), "numel": param.numel(), "dtype": ref.get("dtype")}


class CutOnRead(Mapping[str, Tensor]):
    """A whole state dict whose entries named in ``cuts`` are cut to this rank's part when read (``cuts[key]`` maps
    the whole tensor to the part): tensor parallelism's slices, expert parallelism's experts."""

    def __init__(self, state: Mapping[str, Tensor], cuts: Mapping[str, Callable[[Tensor], Tensor]]) -> None:
        self._state, self._cuts = state, cuts

    def __getitem__(self, key: str) -> Tensor:
        value = self._state[key]
        cut = self._cuts.get(key)
        return cut(value) if cut is not None else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)
