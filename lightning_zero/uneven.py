"""Evaluation with different numbers of batches per rank under ZeRO stage 3.

Stage 3 gathers parameters with collectives inside every forward, so a rank that has run out
of evaluation batches must still take part in the other ranks' gathers, or they would wait for
it forever. :class:`JoinedEvalLoader` wraps an evaluation dataloader and reports the longest
rank's length, so Lightning's loop draws the same number of batches D on every rank (D is that
length or the loop's limit). A rank whose own batches end before D joins the remaining
``D - n`` forwards of the others with :meth:`Stage3Runtime.shadow_forward` (it gathers and
releases the units in the recorded order, computing nothing), then ends with ``StopIteration``.
Every rank therefore runs D gather sequences in the same order.

Metrics logged with ``sync_dist=True`` and ``on_epoch=True`` (the default in validation) are
reduced at the epoch end, after the join, and are correct. A collective inside the step (e.g.
``on_step=True`` with ``sync_dist=True``) cannot be joined by a rank without a batch: avoid it
with uneven batches (DDP has the same rule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.stage3 import Stage3Runtime


class JoinedEvalLoader:
    """An evaluation dataloader whose ranks finish together (see the module docstring).

    Args:
        dataloader: the rank's own evaluation dataloader; it needs a length.
        runtime: the stage-3 runtime whose gathers an exhausted rank joins.
        comm: the data-parallel group (one all-reduce here, to agree on the length).
        draws: returns how many batches the loop will draw from this loader (its limit).
    """

    def __init__(
        self, dataloader: Any, runtime: Stage3Runtime, comm: DataParallelComm, draws: Callable[[Any], float]
    ) -> None:
        self.dataloader = dataloader
        self.runtime = runtime
        self.draws = draws
        try:
            local = len(dataloader)
        except TypeError:
            local = -1
        longest, shortest = comm.extremes(local)
        if shortest < 0:
            raise NotImplementedError(
                "ZeRO stage 3 evaluates with collectives inside every forward, so every rank must know how many "
                "evaluation batches the others have, and an evaluation dataloader here has no length on some rank "
                "(an IterableDataset?). Give the dataset a `__len__`, or evaluate after fit with `trainer.validate` "
                "(which does not partition), or use ZeRO stage 0-2."
            )
        self._length = longest

    def __len__(self) -> int:
        return self._length

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, dataset ... for Lightning
        return getattr(self.__dict__["dataloader"], name)

    def __iter__(self) -> Iterator[Any]:
        drawn = 0
        for batch in self.dataloader:
            drawn += 1
            yield batch
        target = min(self.draws(self), self._length)
        for _ in range(int(target) - drawn):
            self.runtime.shadow_forward()
