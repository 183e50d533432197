"""Setup agreement: the ranks compare what must be identical (parameter names, shapes, dtypes, the
resolved config) by one hash before the first collective that depends on it, and a mismatch names
the first differing entry and the rank(s) that differ.

Note [setup agreement]
    Every rank hashes its ordered list of ``(what, value)`` entries (crc32 of their text). One
    all-reduce of ``[h, -h]`` (MAX) tells whether all hashes are equal: the common case costs one
    tiny collective. Only on a mismatch the entry lists are all-gathered (``all_gather_object``,
    pickled strings) and every rank computes the same description: for each rank that differs from
    rank 0, the first entry where it does, with both values. Every rank raises the same
    ``ValueError``, so no rank goes on into a collective the others never join.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_zero.core.comm.data_parallel import DataParallelComm

Entry = tuple[str, str]  # (what, its value on this rank)


def fingerprint(entries: Sequence[Entry]) -> int:
    """crc32 of the entries in order (a signed int64-safe value)."""
    return zlib.crc32("\n".join(f"{k}={v}" for k, v in entries).encode())


def first_difference(reference: Sequence[Entry], other: Sequence[Entry]) -> str | None:
    """The first entry where ``other`` differs from ``reference``, described; ``None`` if equal."""
    for i in range(max(len(reference), len(other))):
        ref = reference[i] if i < len(reference) else None
        got = other[i] if i < len(other) else None
        if ref == got:
            continue
        if ref is not None and got is not None and ref[0] == got[0]:
            return f"{ref[0]}: {got[1]} (rank 0 has {ref[1]})"
        return (f"entry {i}: {got[0] + ' = ' + got[1] if got else 'nothing'} "
                f"(rank 0 has {ref[0] + ' = ' + ref[1] if ref else 'nothing'})")
    return None


def describe_mismatch(per_rank: Sequence[Sequence[Entry]]) -> str:
    """One line per rank that differs from rank 0 (global ranks of the group, in order)."""
    lines = []
    for r, entries in enumerate(per_rank[1:], start=1):
        diff = first_difference(per_rank[0], entries)
        if diff is not None:
            lines.append(f"rank {r}: {diff}")
    return "; ".join(lines)


def check_same_everywhere(entries: Sequence[Entry], comm: DataParallelComm, fix: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``comm`` unless all ranks hold equal ``entries``."""
    if not comm.active:
        return
    h = fingerprint(entries)
    both = torch.tensor([h, -h], dtype=torch.int64, device=comm.device)
    comm.all_reduce_max(both)
    if both[0].item() == -both[1].item():
        return
    per_rank: list[list[Entry]] = [[] for _ in range(comm.world_size)]
    with comm.blocking("all_gather_object (setup agreement)"):
        dist.all_gather_object(per_rank, list(entries), group=comm.group)
    raise ValueError(
        "The ranks disagree at setup (parameter names, shapes, dtypes, optimizer groups or settings); the first "
        f"difference per rank: {describe_mismatch(per_rank) or 'none found (hash collision?)'}. {fix}"
    )
