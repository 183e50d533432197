"""One gradient reducer per partition of the flat groups, behind the one reducer interface the engine drives.

Note [partitioned reduction]
    With expert parallelism the engine's flat groups fall in two partitions: the dense groups, reduced over
    ZeRO's data x sequence group, and the experts' groups (``FlatParamGroup.experts``), reduced over the
    expert-data x sequence group and divided by the data x sequence size (Note [expert axes] in
    core/mesh/dims.py). Each partition gets its own :class:`~lightning_zero.core.zero.grad_reducer.GradReducer`
    (its buckets, messages, hooks and fixed launch order, on its own group); :class:`PartitionedReducer` holds
    them and answers the engine as one reducer, its per-group lists in the engine's group order. Every rank
    has the same partitions, so each group's collectives are issued in the same order on all its ranks; the
    two groups' collectives are independent of each other. Without experts the engine keeps the one reducer
    (:func:`make_reducer`), unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.grad_home import GradHome
from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.zero.grad_reducer import BackwardState, GradReducer, ReductionMode


def make_reducer(groups: list[FlatParamGroup], comm: DataParallelComm, stage: int | ZeroStage, bucket_numel: int,
                 overlap: bool, grad_dtype: torch.dtype, names: dict[nn.Parameter, str],
                 accum_dtype: torch.dtype | None = None, grad_home: GradHome | None = None,
                 ) -> GradReducer | PartitionedReducer:
    """The engine's reducer: one :class:`GradReducer`, or with expert groups a :class:`PartitionedReducer`
    (the arguments are :class:`GradReducer`'s)."""
    if any(g.experts for g in groups):
        return PartitionedReducer(groups, comm, stage, bucket_numel, overlap, grad_dtype, names, accum_dtype,
                                  grad_home)
    return GradReducer(groups, comm, stage, bucket_numel, overlap, grad_dtype, names, accum_dtype, grad_home)


class _PartHome:
    """A partition's view of the engine's gradient home (``GradHome``): its group ``j`` is the engine's
    ``indices[j]``."""

    def __init__(self, home: GradHome, indices: list[int]) -> None:
        self.home, self.indices = home, indices

    def tensor(self, group_index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.home.tensor(self.indices[group_index], numel, dtype)

    def accumulate(self, group_index: int, lo: int, terms: list[torch.Tensor], first: bool) -> None:
        self.home.accumulate(self.indices[group_index], lo, terms, first)

    def zero(self, group_index: int, lo: int, hi: int) -> None:
        self.home.zero(self.indices[group_index], lo, hi)


class PartitionedReducer:
    """The dense and the experts' gradient reducers as one (Note [partitioned reduction]); the arguments are
    :class:`GradReducer`'s, ``comm`` the data group's (its ``expert_data`` the experts')."""

    def __init__(self, groups: list[FlatParamGroup], comm: DataParallelComm, stage: int | ZeroStage,
                 bucket_numel: int, overlap: bool, grad_dtype: torch.dtype, names: dict[nn.Parameter, str],
                 accum_dtype: torch.dtype | None = None, grad_home: GradHome | None = None) -> None:
        self.groups, self.comm, self.stage = groups, comm, ZeroStage.of(stage)
        self.parts: list[tuple[GradReducer, list[int]]] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * len(groups)  # engine group -> (part, index in the part)
        for experts in (False, True):
            indices = [i for i, g in enumerate(groups) if g.experts == experts]
            members = {s.param for i in indices for s in groups[i].slots}
            home = None if grad_home is None else _PartHome(grad_home, indices)  # the part's view of the home
            reducer = GradReducer([groups[i] for i in indices], comm.of(experts), stage, bucket_numel, overlap,
                                  grad_dtype, {p: n for p, n in names.items() if p in members}, accum_dtype, home,
                                  average_over=comm.world_size)
            for j, i in enumerate(indices):
                self._where[i] = (len(self.parts), j)
            self.parts.append((reducer, indices))

    def _in_order(self, per_part: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
        return [per_part[k][j] for k, j in self._where]

    # ---------------------------------------------------------------- the buffers, in the engine's group order
    @property
    def flat_grads(self) -> list[torch.Tensor | None]:
        return self._in_order([r.flat_grads for r, _ in self.parts])

    @property
    def grad_shards(self) -> list[torch.Tensor | None]:
        return self._in_order([r.grad_shards for r, _ in self.parts])

    def shard_grad(self, group_index: int) -> torch.Tensor:
        k, j = self._where[group_index]
        return self.parts[k][0].shard_grad(j)

    def local_grads(self) -> list[torch.Tensor]:
        if not self.stage.shards_optimizer:
            return [g for g in self.flat_grads if g is not None]
        return [self.shard_grad(i) for i in range(len(self.groups))]

    def whole_grads_valid(self) -> bool:
        return all(r.whole_grads_valid() for r, _ in self.parts)

    def idle_buffers(self) -> list[torch.Tensor]:
        return [t for r, _ in self.parts for t in r.idle_buffers()]

    def live_buffers(self) -> list[torch.Tensor]:
        return [t for r, _ in self.parts for t in r.live_buffers()]

    # ---------------------------------------------------------------- the modes, the same in every part
    @property
    def boundary_mode(self) -> ReductionMode:
        return self.parts[0][0].boundary_mode

    def set_boundary_mode(self, mode: ReductionMode) -> None:
        for r, _ in self.parts:
            r.set_boundary_mode(mode)

    @property
    def sync(self) -> bool:
        return self.parts[0][0].sync

    @property
    def deferred(self) -> bool:
        return self.parts[0][0].deferred

    @property
    def communicating(self) -> bool:
        return self.parts[0][0].communicating

    @property
    def state(self) -> BackwardState:
        running = any(r.state is BackwardState.RUNNING for r, _ in self.parts)
        return BackwardState.RUNNING if running else BackwardState.IDLE

    def defer(self) -> None:
        for r, _ in self.parts:
            r.defer()

    def end_window(self) -> None:
        for r, _ in self.parts:
            r.end_window()

    # ---------------------------------------------------------------- the step's work, part after part
    def reduce_deferred(self) -> None:
        for r, _ in self.parts:
            r.reduce_deferred()

    def finish(self) -> None:
        for r, _ in self.parts:
            r.finish()

    def zero(self) -> None:
        for r, _ in self.parts:
            r.zero()

    def remove_hooks(self) -> None:
        for r, _ in self.parts:
            r.remove_hooks()
