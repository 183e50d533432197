"""Non-finite gradients in fp32 / bf16 training: found across ranks, named by their first parameter.

Note [non-finite policy]
    fp16 has the loss scaler (an overflowing step is skipped and the scale lowered). fp32 and bf16
    have no scale to lower: a ``nan`` / ``inf`` gradient is a bug or a divergence, and one optimizer
    step on it poisons the weights (Adam's moments keep the ``nan`` for good). ``ZeroConfig.nonfinite``
    (a ``NonFinitePolicy``, ``core/common/choices.py``; users give its strings):

    * ``"off"`` (default): not checked (no extra pass over the gradients);
    * ``"skip"``: the step is skipped on every rank (parameters and optimizer state untouched) and
      counted; training goes on with the next batch;
    * ``"raise"``: every rank raises :class:`NonFiniteGradientError` naming the step and the first
      parameter (in module order) whose reduced gradient holds a non-finite value.

    The check runs after the gradients were reduced, before the optimizer step: each rank looks at
    the gradient elements it owns (its shards at stage >= 1), and one all-reduce over the data group
    (data x sequence: MIN over the index of each rank's first offending parameter) makes its ranks agree
    on whether and where. The ranks holding the rest of the model (pipeline stages, tensor-parallel
    ranks: other parameters, or other slices of them) then agree too (:func:`agree_over_model_parallel`:
    one more all-reduce of a flag, and, only when some rank found one, the name from the first of them),
    so every rank of data x tensor x pipeline x sequence skips, or raises, together, as for the fp16
    overflow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup

NONFINITE_POLICIES = ("off", "skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held ``nan`` / ``inf`` with ``nonfinite="raise"`` (raised on every rank)."""


def first_nonfinite_slot(group: FlatParamGroup, grad: torch.Tensor, offset: int) -> int | None:
    """Index in ``group.slots`` of the first parameter whose gradient elements in ``grad`` (the
    group's flat gradient from element ``offset`` on) are not all finite; ``None`` if all are."""
    bad = (~torch.isfinite(grad)).nonzero()
    if bad.numel() == 0:
        return None
    position = offset + int(bad[0, 0])
    for i, slot in enumerate(group.slots):
        if slot.offset <= position < slot.offset + slot.numel:
            return i
    return None  # padding (always zero) cannot be non-finite


def first_nonfinite_parameter(
    groups: Sequence[FlatParamGroup],
    grads: Sequence[tuple[torch.Tensor, int] | None],
    order: Sequence[torch.nn.Parameter],
    comm: DataParallelComm,
) -> int | None:
    """The position in ``order`` of the first parameter with a non-finite gradient on any rank
    (the same answer on every rank: a collective), or ``None`` when every gradient is finite.

    Args:
        groups: the flat parameter groups.
        grads: per group, this rank's reduced gradient and the flat offset it starts at (``None``:
            no gradient).
        order: every parameter in module order (the first offender is the first in this order).
        comm: the data-parallel group.
    """
    index = {p: i for i, p in enumerate(order)}
    mine = len(order)  # "none" sorts after every real parameter
    for group, entry in zip(groups, grads):
        if entry is None:
            continue
        slot = first_nonfinite_slot(group, *entry)
        if slot is not None:
            mine = min(mine, index[group.slots[slot].param])
    agreed = torch.tensor([-mine], dtype=torch.int64, device=comm.device)
    comm.all_reduce_max(agreed)  # max of the negated index: the smallest index over the ranks
    first = -int(agreed.item())
    return None if first == len(order) else first


def agree_over_model_parallel(name: str | None, model_parallel: DataParallelComm) -> str | None:
    """The first offender's name over the model-parallel ranks (each with the answer of its data group):
    ``None`` when no rank found one, else the name from the first rank of ``model_parallel`` (pipeline stages
    outermost, then TP ranks) that did; the same on every rank (a collective, Note [non-finite policy])."""
    holders = model_parallel.ranks_with(name is not None)
    return model_parallel.broadcast_text(name, holders[0]) if holders else None
