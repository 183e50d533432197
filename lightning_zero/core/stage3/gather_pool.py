"""Stage 3: a pool of the storage that gathered units live in, reused instead of re-allocated.

Note [gather buffer pool]
    A stage-3 unit's flat buffer keeps its storage object for life (the autograd graph saves
    views of it, Note [released parameters]); releasing the unit empties that storage and
    gathering it fills it again. Filling by ``resize_`` asks the allocator for fresh memory on
    every gather, which on the CPU is fresh pages from the kernel (page faults on the first
    write) for each of the 2 gathers per unit per step. The pool keeps released memory instead:
    ``release`` moves the memory out of the unit's storage into a spare storage object, and the
    next gather of a unit of the same byte size moves it back in (``_swap_data_ptr_``: the
    storage objects stay, only their memory is exchanged, so saved views stay valid). What the
    pool holds plus what is gathered never exceeds the most that was ever gathered at once
    (``limit_bytes``), so stage 3's peak memory is unchanged; past it a release frees the memory.

Note [one rank]
    With one data-parallel rank a unit's shard is the whole flat buffer, and gathering it was a
    copy of the shard into the flat storage (nothing to exchange). Instead the shard's memory is
    lent to the flat storage (:func:`lend`, the same exchange of memory as above) and taken back
    on release (:func:`take_back`): no copy in either direction. While lent, the group's
    ``shard`` is a view of the flat buffer (so code that reads or writes the shard while the
    unit is gathered sees the same numbers), and the original shard tensor, which the optimizer
    holds, gets its memory back, with any change made meanwhile, when the unit is released.
    While lent, that original tensor (and an fp32 master that is a view of it) has no memory:
    reading it crashes the process. So only forward / backward lend (no optimizer code runs
    between a unit's gather there and its release); gathers outside them (``gathered_parameters``,
    state dicts, teardown, a pipeline's held step) copy (``may_lend=False``).
"""

from __future__ import annotations

import torch

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class GatherPool:
    """Spare memory for unit storages, by (device, byte size)."""

    def __init__(self) -> None:
        self._spares: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}
        self.pooled_bytes: int = 0
        self.live_bytes: int = 0  # bytes in unit storages filled through this pool
        self.limit_bytes: int = 0  # the most ever live at once: the pool never holds more than that minus live
        self.reused: int = 0  # fills served from the pool (tests, benchmarks)
        self.keeping: bool = True  # False after close(): releases free their memory

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory (contents undefined)."""
        spares = self._spares.get((storage.device, nbytes))
        if _CAN_SWAP and spares:
            spare = spares.pop()
            storage._swap_data_ptr_(spare)
            self.pooled_bytes -= nbytes
            self.reused += 1
        else:
            storage.resize_(nbytes)
        self.live_bytes += nbytes
        self.limit_bytes = max(self.limit_bytes, self.live_bytes)

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory away (into the pool while it stays within the limit)."""
        nbytes = storage.nbytes()
        self.live_bytes = max(0, self.live_bytes - nbytes)
        if self.keeping and _CAN_SWAP and nbytes and self.pooled_bytes + self.live_bytes + nbytes <= self.limit_bytes:
            spare = torch.UntypedStorage(0, device=storage.device)
            spare._swap_data_ptr_(storage)
            self._spares.setdefault((storage.device, nbytes), []).append(spare)
            self.pooled_bytes += nbytes
        else:
            storage.resize_(0)

    def spares(self) -> list[torch.UntypedStorage]:
        """The memory the pool holds now (idle)."""
        return [s for spares in self._spares.values() for s in spares]

    def clear(self) -> None:
        """Free the pooled memory."""
        self._spares.clear()
        self.pooled_bytes = 0

    def close(self) -> None:
        """Teardown: free the pooled memory and keep none from now on (releases free their memory)."""
        self.clear()
        self.keeping = False


def lend(flat: torch.Tensor, shard: torch.Tensor) -> bool:
    """Note [one rank]: move ``shard``'s memory into ``flat``'s empty storage when the shard is the whole buffer;
    False (nothing done) when it is not, or when this torch cannot exchange storage memory."""
    storage, own = flat.untyped_storage(), shard.untyped_storage()
    whole = shard.storage_offset() == 0 and own.nbytes() == flat.numel() * flat.element_size()
    if not (_CAN_SWAP and whole and storage.nbytes() == 0 and shard.is_contiguous()):
        return False
    storage._swap_data_ptr_(own)
    return True


def take_back(flat: torch.Tensor, shard: torch.Tensor) -> None:
    """Undo :func:`lend`: ``shard`` gets the memory back (with the flat buffer's current values), ``flat`` none."""
    shard.untyped_storage()._swap_data_ptr_(flat.untyped_storage())
