"""Different numbers of batches per rank: joined evaluation under ZeRO stage 3, refused training.

Training: a rank that runs out of training batches first would leave the others waiting forever in
their next gradient reduction (DDP hangs the same way). :func:`check_training_batches` compares the
ranks' numbers of training batches when training starts and raises on every rank when they differ
within the batches the run will train on.

Evaluation under ZeRO stage 3:

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

import math
from collections.abc import Callable, Iterator
from typing import Any

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.stage3.runtime import Stage3Runtime

_UNKNOWN = 2**62  # stands for an unknown (infinite) number of batches in the integer agreement

def check_training_batches(num_batches: float, comm: DataParallelComm, steps_needed: float) -> None:
    """Raise on every rank when the ranks have different numbers of training batches per epoch.

    Args:
        num_batches: this rank's training batches per epoch (``trainer.num_training_batches``; inf: unknown).
        comm: the data-parallel group (one all-reduce).
        steps_needed: the batches the run trains on before it stops (inf: whole epochs).
    """
    if not comm.active:
        return
    local = float(num_batches)
    most, fewest = comm.extremes(_UNKNOWN if math.isinf(local) else int(local))
    if most in (fewest, _UNKNOWN) or fewest >= steps_needed:
        return  # equal, unknown (an iterable without a length), or the run stops before the shortest epoch ends
    raise ValueError(
        f"The ranks have different numbers of training batches per epoch: this rank {local:g}, between "
        f"{fewest:g} and {most:g} across ranks. A rank that runs out first would leave the others waiting forever "
        "in the next gradient reduction (DDP hangs the same way). Give every rank the same number of batches "
        "(`use_distributed_sampler=True`, or a DistributedSampler: it pads; or `drop_last=True`), or set "
        f"`Trainer(limit_train_batches={int(fewest)})`."
    )


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
