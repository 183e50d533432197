"""Stage 3 at the end of fit: gather the whole model back only where it fits, else leave it released.

Note [teardown gather]
    Gathering at teardown (``gather_on_teardown=True``, the default) puts the whole parameters,
    and the whole optimizer state so that it can be saved or stepped after fit, on every rank.
    For a model that only fits sharded that allocation fails after a fit that succeeded. So the
    ranks first compare what it needs with what each can still get:

    * needed: the ZeRO formulas of ``memory.py`` at stage 0 with one rank (whole parameters, and
      whole optimizer state plus a separate master where there is one), with the optimizer's
      bytes per element measured from this rank's state, plus 5% and 64 MiB of slack;
    * available: every pool the gather draws from, with the needs of all the ranks that draw from it
      summed (Note [memory pools] in ``memory_room.py``): on a CUDA device what ``torch.cuda.mem_get_info``
      reports free plus what the caching allocator holds unused; on the CPU the host's ``MemAvailable``,
      every memory cgroup above the process that has a limit (how clusters limit a job: a run in a 20 GiB
      cgroup whose 2 ranks each saw 14 GiB free gathered 12 GB each and was killed after its last step),
      and the room left under ``RLIMIT_DATA`` and ``RLIMIT_AS``.

    Every rank holding part of the model agrees (the needs summed over the ZeRO group, then over the
    pipeline x tensor ranks; then whether any rank is short, over both): everything is gathered if it
    fits in every pool; else only the parameters if they fit (the optimizer state is dropped); else
    nothing, and the parameters stay released (NaN placeholders of the right shapes, Note [released
    parameters]).
    An engine without an optimizer in a 16-bit mixed mode (evaluating a model built in
    ``configure_model``) has no fp32 master: its parameters come back as their 16-bit values, with
    a warning that says so.
    Either fallback warns once, naming ``gather_on_teardown``; so does ``gather_on_teardown=False``,
    which gathers nothing (the module is left without weights, Note [released parameters]).
    After a failed fit no collective is safe (a rank may be gone): the parameters stay released and
    the warning says so, never partly filled with this rank's shard and zeros elsewhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zero.core.common.memory import model_state_formula
from lightning_zero.core.precision.loss_scaler import any_rank
from lightning_zero.core.stage3 import memory_room

if TYPE_CHECKING:
    from lightning_zero.core.zero.engine import ZeroEngine

_SLACK = 64 * 2**20


@dataclass(frozen=True)
class TeardownPlan:
    """What ``ZeroEngine.detach`` does: ``gather_params`` / ``keep_optimizer_state``."""

    gather_params: bool
    keep_optimizer_state: bool


def _precision(engine: ZeroEngine) -> str:
    if engine.separate_master:
        return "mixed"
    return "fp32" if engine.dtypes.param_dtype.itemsize >= 4 else "bf16-true"


def _optimizer_bytes_per_element(engine: ZeroEngine) -> float:
    """Measured: bytes of per-element optimizer state per master element on this rank, in fp32 terms."""
    sharded = engine.sharded
    if sharded is None:
        return 0.0
    elements = sum(m.numel() for m in sharded.masters)
    state = sum(v.numel() * v.element_size() for st in sharded.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return state / max(elements, 1) * (2.0 if _precision(engine) == "bf16-true" else 1.0)


def whole_bytes(engine: ZeroEngine) -> tuple[int, int]:
    """``(parameters, optimizer)``: bytes the whole model and its whole optimizer state take on
    one rank (``model_state_formula`` at stage 0, N = 1; frozen parameters count as parameters)."""
    total = sum(p.numel() for p in engine.names)
    trainable = sum(g.numel for g in engine.groups)
    formula = model_state_formula(0, trainable, 1, _precision(engine), _optimizer_bytes_per_element(engine))
    frozen = (total - trainable) * engine.dtypes.param_dtype.itemsize
    return int(formula.params + frozen), int(formula.optimizer)


def plan_teardown(engine: ZeroEngine, failed: bool, gather_on_teardown: bool) -> TeardownPlan:
    """Decide what detaching ``engine`` gathers (Note [teardown gather]); a collective at stage 3
    after a successful fit (every rank calls it). Warns once (rank 0) when it gathers less than asked."""
    if engine.runtime is None:  # stages 0-2: the parameters are whole already
        return TeardownPlan(gather_params=True, keep_optimizer_state=gather_on_teardown and not failed)
    rank0 = engine.comm.rank == 0
    if not gather_on_teardown:
        if rank0:
            warnings.warn(
                "ZeroStrategy(gather_on_teardown=False): the stage-3 parameters are left released after this run "
                "(they read as NaN, with their true shapes) and the optimizer state is dropped, so the module "
                "holds no weights to save or serve. Use the checkpoints saved during fit, or leave "
                "`gather_on_teardown` at True to get the whole model back.",
                stacklevel=2,
            )
        return TeardownPlan(gather_params=False, keep_optimizer_state=False)
    if failed:
        if rank0:
            warnings.warn(
                "ZeroStrategy: the fit failed, so the stage-3 parameters were not gathered back (a collective "
                "after an error could hang): the module's parameters are left released and read as NaN. Load "
                "the last checkpoint to get trained weights (`gather_on_teardown` applies to fits that succeed).",
                stacklevel=2,
            )
        return TeardownPlan(gather_params=False, keep_optimizer_state=False)
    params, optimizer = whole_bytes(engine)
    comm, model_parallel = engine.comm, engine.model_parallel
    pools = memory_room.memory_pools(comm.device if comm.device.type == "cuda" else torch.device("cpu"))
    needs = [int(n * 1.05 + _SLACK) for n in (params + optimizer, params)]
    summed = memory_room.pooled_needs(pools, needs, (comm, model_parallel))

    def short_ranks(level: int) -> list[int]:
        """The ZeRO group's ranks with a pool too small for its ranks' summed need (agreed over the model's ranks:
        where another pipeline stage / TP rank is short, this group's ranks count as short too)."""
        mine = any(total > pool.room for total, pool in zip(summed[level], pools))
        short = comm.ranks_with(mine)
        if model_parallel is not None and any_rank(bool(short), model_parallel) and not short:
            return list(range(comm.world_size))
        return short

    short = short_ranks(0)
    if not short:
        if rank0 and engine.optimizer is None and engine.separate_master:
            warnings.warn(
                "ZeroStrategy: this model was built in `configure_model` and evaluated in a 16-bit mixed mode, so "
                f"it existed only as {engine.dtypes.param_dtype} shards: its parameters come back in their own "
                "dtype but hold those 16-bit values, rounded from the checkpoint's. For the exact weights load "
                "them from the checkpoint (`lightning_zero.checkpoint.consolidate_checkpoint`, or the file's "
                "`state_dict`).",
                stacklevel=2,
            )
        return TeardownPlan(gather_params=True, keep_optimizer_state=True)
    gather_params = not short_ranks(1)
    if rank0:
        kept = "only the parameters were gathered (the optimizer state was dropped)" if gather_params else (
            "the parameters are left released (they read as NaN; load a checkpoint to use the weights)")
        tight = [f"{pool.what}: {max(pool.room, 0) / 2**30:.2f} GiB free, {total / 2**30:.2f} GiB needed by its ranks"
                 for total, pool in zip(summed[0], pools) if total > pool.room]
        where = f"; on this rank {'; '.join(tight)}" if tight else ""
        warnings.warn(
            f"ZeroStrategy(gather_on_teardown=True): the whole model ({params / 2**30:.2f} GiB of parameters, "
            f"{optimizer / 2**30:.2f} GiB of optimizer state per rank) does not fit in the memory rank(s) {short} "
            f"can still allocate{where}, so {kept}. Pass `gather_on_teardown=False` to skip the gather, and save "
            "checkpoints during fit.",
            stacklevel=2,
        )
    return TeardownPlan(gather_params=gather_params, keep_optimizer_state=False)
