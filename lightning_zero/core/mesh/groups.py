"""The process groups of the device mesh, created once, and this rank's view of them (a strategy's one mesh).

Every rank creates every group of each requested axis set in the same order (``dist.new_group`` is
collective over the world) and keeps the one it belongs to. The groups a model adds (the pipeline stages sharing
a tied weight: :meth:`ProcessMesh.subgroup`) are the mesh's too, as are this rank's coordinates (the data rank the
sampler reads) and the sizes (``dims``: the data-parallel size is derived there alone). Without an initialised
process group (one process: unit tests, a single-device run) the mesh has world size 1 and no groups, and every
collective its users issue becomes a local no-op through ``DataParallelComm(group=None)``.

Note [connected before used]
    A gloo group connects its ranks' sockets while ``dist.new_group`` runs, and one side of a pair can return
    before the other has finished its handshake. A rank that then fails at once (a bad input found right after
    the mesh) and destroys its groups closes that pair under its peer, whose ``new_group`` raises "Gloo
    connectFullMesh failed ... Connection closed by peer" instead of the same clear error: 3 of 280 such tasks
    on a 2-core machine kept busy, 0 of 420 with the barrier. So on gloo each creation of groups (an axis set's, a
    subgroup's) ends with a world barrier: no rank leaves it before every rank has connected every group. NCCL
    connects at its first collective; a mixed backend ("cpu:gloo,cuda:nccl") is left without the barrier.
"""

from __future__ import annotations

from contextlib import suppress
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.core.mesh.dims import ALL_AXES, Axis, ParallelDims

AxisSet = tuple[Axis, ...]


def _key(axes: AxisSet) -> AxisSet:
    return tuple(a for a in ALL_AXES if a in axes)


class ProcessMesh:
    """This rank's place in the mesh and its process groups, one per requested axis set.

    Args:
        dims: the dimension sizes (checked).
        rank: this rank's global rank.
        axis_sets: the groups to create, e.g. ``[(Axis.DATA,), (Axis.DATA, Axis.SEQUENCE)]``; each is
            created only when it spans more than one rank or when ``dims`` spans several ranks (a one-rank
            group is still a real group then: ``None`` means the whole world to ``DataParallelComm``).
        timeout_s: the groups' collective timeout.

    Raises:
        ValueError: the world size does not match the initialised process group's.
    """

    def __init__(self, dims: ParallelDims, rank: int, axis_sets: list[AxisSet], timeout_s: float = 1800.0) -> None:
        self.dims = dims
        self.rank = rank
        self.coordinates = dims.coordinates(rank)
        self._groups: dict[AxisSet, dist.ProcessGroup | None] = {}
        self._subgroups: dict[tuple[Axis, tuple[int, ...]], dist.ProcessGroup | None] = {}
        self._timeout = timedelta(seconds=timeout_s)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and dist.get_world_size() != dims.world_size:
            raise ValueError(f"the mesh was sized for {dims.world_size} ranks but the process group has "
                             f"{dist.get_world_size()}: build ParallelDims from the launched world size")
        for axes in dict.fromkeys(_key(a) for a in axis_sets):  # unique, in the caller's order
            self._groups[axes] = self._new_groups(dims.all_groups(axes))

    @classmethod
    def single(cls, dims: ParallelDims | None = None) -> ProcessMesh:
        """The one-process mesh (no groups): for unit tests and single-device runs."""
        return cls(dims or ParallelDims(1), 0, [])

    def group(self, *axes: Axis) -> dist.ProcessGroup | None:
        """The group of this rank along ``axes`` (created at construction; ``None`` in one process).

        Raises:
            KeyError: that axis set was not requested at construction (name it in ``axis_sets``).
        """
        key = _key(axes)
        if key not in self._groups:
            if self.dims.world_size == 1:
                return None
            raise KeyError(f"no process group along {[a.value for a in key]} was created: add it to axis_sets")
        return self._groups[key]

    def subgroup(self, axis: Axis, positions: tuple[int, ...]) -> dist.ProcessGroup | None:
        """This rank's group of the ranks at ``positions`` along ``axis``, the other coordinates its own (e.g. the
        pipeline stages sharing a tied weight); one is created per group along ``axis`` on first use, every rank
        asking for the same ones in the same order (``dist.new_group`` is collective over the world), and kept
        and closed with the mesh's other groups. ``None`` when this rank is not at one of ``positions``."""
        key = (axis, tuple(positions))
        if key not in self._subgroups:
            self._subgroups[key] = self._new_groups([[ranks[i] for i in key[1]]
                                                     for ranks in self.dims.all_groups((axis,))])
        return self._subgroups[key]

    def _new_groups(self, groups: list[list[int]]) -> dist.ProcessGroup | None:
        """Create ``groups`` (collective over the world), keeping the one this rank is in (``None`` in one process)."""
        mine = None
        if dist.is_available() and dist.is_initialized() and self.dims.world_size > 1:
            for ranks in groups:
                group = dist.new_group(ranks, timeout=self._timeout)
                if self.rank in ranks:
                    mine = group
            if dist.get_backend() == "gloo":
                dist.barrier()  # Note [connected before used]
        return mine

    def index(self, axis: Axis) -> int:
        """This rank's coordinate along ``axis``."""
        return self.coordinates[axis]

    def peer(self, axis: Axis, index: int) -> int:
        """The global rank at this rank's coordinates but ``index`` along ``axis`` (another pipeline stage's rank
        holding the same data, sequence and tensor position)."""
        return self.dims.rank_of({**self.coordinates, axis: index})

    @property
    def data_shard(self) -> tuple[int, int]:
        """``(replicas, index)`` of the data dimension: what a sampler shards over (the ranks of a pipeline, tensor
        or sequence group see the same samples; Note [rank order])."""
        return self.dims.data, self.coordinates[Axis.DATA]

    def ranks(self, *axes: Axis) -> list[int]:
        """The global ranks of this rank's group along ``axes``."""
        return self.dims.group_ranks(self.rank, _key(axes))

    def close(self) -> None:
        """Destroy the groups this mesh created (Note [clean exit] in core/comm/process_groups.py)."""
        groups, self._groups = [*self._groups.values(), *self._subgroups.values()], {}
        self._subgroups = {}
        for group in groups:
            if group is not None and dist.is_available() and dist.is_initialized():
                with suppress(ValueError):  # already destroyed
                    dist.destroy_process_group(group)
