"""Where reduced gradient shards land: :class:`GradHome` (the swap files of stage 3 with ``"nvme"`` offload implement
it, ``core/offload/grad_files.py``; the reducer in ``core/zero`` writes through it) and :func:`sum_in_rank_order`, the
one order in which the ranks' parts of a gradient are added, in memory or in a file, so that both agree bit for bit.
Declared here, below both the offload and the ZeRO engine (core's order, docs/design.md)."""

from __future__ import annotations

from typing import Protocol

import torch


def sum_in_rank_order(terms: list[torch.Tensor], target: torch.Tensor, first: bool) -> None:
    """``target`` := (``first``) or += the parts of ranks 0..N-1 added in that order. Every term is scratch
    (the staging slice already sent, or a receive slice), so ``terms[0]`` may accumulate in place."""
    if first and len(terms) > 1 and target.dtype == terms[0].dtype:
        torch.add(terms[0], terms[1], out=target)
        for t in terms[2:]:
            target.add_(t)
        return
    acc = terms[0]
    for t in terms[1:]:
        acc.add_(t)
    if first:
        target.copy_(acc)
    else:
        target.add_(acc)


class GradHome(Protocol):
    """Where the reduced gradient shards live when not in memory: stage 3 with ``"nvme"`` offload keeps them in
    swap files (``core/offload/grad_files.py``). Declared here, below the offload that implements it."""

    def tensor(self, group_index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The whole shard of a group as a tensor (for uses outside the step's streaming: it is a file mapping)."""
        ...

    def accumulate(self, group_index: int, lo: int, terms: list[torch.Tensor], first: bool) -> None:
        """Elements from ``lo`` of the group's shard := (``first``) or += the ``terms`` added in rank order."""
        ...

    def zero(self, group_index: int, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of the group's shard := 0."""
        ...
