"""A ``training_step`` error on one rank raised on every rank, naming it: the agreement's error, and the first
failing rank posted where a rank whose collective broke can still read it.

Note [first step error]
    The step-error agreement (Note [deferred agreement] in core/comm/deferred.py) lets every rank learn of another
    rank's ``training_step`` error before it waits on a collective that rank never joins. Under tensor or sequence
    parallelism (and in stage 3's gathers, or a pipeline's schedule) a rank can already be inside such a
    collective when another rank raises: the forward's all-reduces. So a rank whose step raised

    1. posts its rank in the rendezvous store under this fit's key, the first writer winning (``compare_set``);
    2. issues its flag of the agreement and waits for it at most :data:`AGREEMENT_WAIT_S` (the ranks not
       blocked elsewhere join it and raise the agreement's error), then raises its own error. Its process ends,
       and the collectives the other ranks are blocked in fail ("Connection closed by peer"), or reach the
       groups' ``timeout_s`` where the process stays (a notebook, the test pool).

    A rank whose step then fails because a collective of the strategy broke in it (``ProgressRecord.broken``
    counts the collectives that raised), or whose wait for an agreement breaks, reads the key: when another rank
    posted first it raises the agreement's message naming that rank (``training_step raised on rank(s) [1]
    (rank 1: tensor-parallel rank 1)``), chained to its own error, instead of gloo's, which names no rank. A
    step that raised on its own (every rank refusing the same plan, say) raises its own error.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

import torch.distributed as dist

from lightning_zero.core.mesh import ORDER, Axis, ParallelDims

AGREEMENT_WAIT_S = 5.0  # how long a raising rank waits for the others' flags (Note [first step error])
_AXIS_NAMES = {Axis.PIPELINE: "pipeline stage", Axis.DATA: "data-parallel rank", Axis.SEQUENCE: "sequence-parallel "
               "rank", Axis.TENSOR: "tensor-parallel rank"}
_fits = [0]  # fits started in this process; every rank starts them in the same order


class StepFailedElsewhere(RuntimeError):
    """``training_step`` raised on other ranks (their tracebacks say why); this rank stops too."""


def step_failed(dims: ParallelDims | None) -> Callable[[list[int]], StepFailedElsewhere]:
    """The error a rank raises when ``training_step`` raised on the global ``ranks`` (``dims``: the mesh's sizes,
    whose dimensions name each rank: ``rank(s) [1] (rank 1: tensor-parallel rank 1)``; data parallelism alone
    says ``data-parallel rank(s) [1]``)."""

    def error(ranks: list[int]) -> StepFailedElsewhere:
        on = [a for a in ORDER if dims is not None and dims.enabled(a)]
        if on in ([], [Axis.DATA]):
            where = f"data-parallel rank(s) {ranks}"
        else:
            assert dims is not None
            named = "; ".join(f"rank {r}: " + ", ".join(f"{_AXIS_NAMES[a]} {dims.coordinates(r)[a]}" for a in on)
                              for r in ranks)
            where = f"rank(s) {ranks} ({named})"
        return StepFailedElsewhere(f"training_step raised on {where}; stopping this rank too. The traceback of the "
                                   "failing rank(s) says why.")

    return error


class FirstStepError:
    """This fit's first failing rank in the rendezvous store (Note [first step error]); every rank makes one per
    fit (:meth:`for_this_fit`, in the same order on every rank). Without a process group it knows nothing."""

    def __init__(self, store: dist.Store | None, fit: int) -> None:
        self.store, self.key = store, f"lightning_zero/first_step_error/{fit}"

    @classmethod
    def for_this_fit(cls) -> FirstStepError:
        _fits[0] += 1
        initialized = dist.is_available() and dist.is_initialized()
        return cls(dist.distributed_c10d._get_default_store() if initialized else None, _fits[0])

    def claim(self, rank: int) -> int | None:
        """Post ``rank`` as the first failing rank unless another rank was first; the first (``None``: unknown)."""
        if self.store is None:
            return None
        with suppress(Exception):  # the store's host may be gone with its process
            return int(self.store.compare_set(self.key, "", str(rank)))
        return None

    def first(self) -> int | None:
        """The first failing rank posted, or ``None``."""
        if self.store is None:
            return None
        with suppress(Exception):
            return int(self.store.get(self.key)) if self.store.check([self.key]) else None
        return None
