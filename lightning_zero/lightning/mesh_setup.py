"""The strategy's device mesh: the sizes chosen in one place, the groups and the dimensions built on them, and
the strategy's part :class:`ParallelRun` that holds them with what each setup composes on them (``compose.py``).

Note [one mesh per strategy]
    A strategy makes one :class:`~lightning_zero.core.mesh.ProcessMesh` (every group it needs, created once,
    in the same order on every rank) and ZeRO's comm over ``zero_axes``; tensor and sequence parallelism take
    their groups from it. Later setups of the same strategy reuse it while its groups live; the mesh and the
    comm are registered to be closed before interpreter exit (Note [clean exit] in core/comm/process_groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.process_groups import own, reusable
from lightning_zero.core.mesh import ORDER, Axis, ParallelDims, ProcessMesh
from lightning_zero.core.offload.config import OffloadConfig
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.zero.config import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.lightning.compose import ParallelPlan, apply_parallelisms, release_parallelisms
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.moe.config import ExpertParallelConfig
from lightning_zero.moe.lightning import StrategyExpertParallel, expert_size
from lightning_zero.pipeline.config import PipelineConfig
from lightning_zero.pipeline.lightning import StrategyPipeline
from lightning_zero.sequence_parallel.lightning import StrategySequenceParallel
from lightning_zero.tensor_parallel.config import TensorParallelConfig
from lightning_zero.tensor_parallel.lightning import StrategyTensorParallel


def parallel_dims(world: int, pipeline: PipelineConfig | None, tensor: TensorParallelConfig,
                  sequence: int, expert: int = 1) -> ParallelDims:
    """The sizes of the parallel dimensions: the one place they are chosen."""
    sizes = {"tensor": tensor.size, "sequence": sequence, "expert": expert}
    if pipeline is None:
        return ParallelDims(world, **sizes)
    pipeline.data_parallel_size(world)  # its error names the pipeline's fix
    return ParallelDims(world, pipeline=pipeline.stages, **sizes)


@dataclass(frozen=True)
class StrategyMesh:
    """What :func:`build_mesh` made: the mesh, ZeRO's comm over ``zero_axes`` (with the experts' over
    ``expert_zero_axes``), when on the tensor-, sequence- and expert-parallel dimensions, and the comm over every
    rank holding part of the model (the step-error agreement: data x tensor x pipeline x sequence)."""

    mesh: ProcessMesh
    comm: DataParallelComm
    tensor: StrategyTensorParallel | None
    sequence: StrategySequenceParallel | None
    everyone: DataParallelComm  # every rank of the run (``comm`` when ZeRO's group is the world): the step errors
    expert: StrategyExpertParallel | None = None


def build_mesh(dims: ParallelDims, rank: int, tensor: TensorParallelConfig, zero: ZeroConfig) -> StrategyMesh:
    """Create the groups (collective over the world: every rank calls it with the same arguments); Note [one mesh
    per strategy]. The groups use the strategy's ``timeout_s``."""
    axis_sets = [dims.zero_axes] + [(a,) for a in (Axis.PIPELINE, Axis.SEQUENCE, Axis.TENSOR) if dims.enabled(a)]
    if dims.pipeline_enabled and dims.tensor_enabled:  # the engine's norm and overflow agreement: one group
        axis_sets.append((Axis.PIPELINE, Axis.TENSOR))
    if dims.expert_enabled:  # the all-to-alls' group, and the experts' ZeRO group (Note [expert axes])
        axis_sets += [(Axis.EXPERT,), dims.expert_zero_axes]
    beyond_zero = dims.pipeline_enabled or dims.tensor_enabled  # ZeRO's group is not every rank
    if beyond_zero:
        axis_sets.append(ORDER)
    mesh = own(ProcessMesh(dims, rank, axis_sets, zero.timeout_s))
    experts = (own(DataParallelComm(mesh.group(*dims.expert_zero_axes), zero.collective))
               if dims.expert_enabled else None)
    comm = own(DataParallelComm(mesh.group(*dims.zero_axes), zero.collective, expert_data=experts))
    return StrategyMesh(
        mesh, comm,
        StrategyTensorParallel(tensor, mesh) if dims.tensor_enabled else None,
        StrategySequenceParallel(mesh) if dims.sequence_enabled else None,
        own(DataParallelComm(mesh.group(*ORDER), zero.collective)) if beyond_zero else comm,
        StrategyExpertParallel(mesh) if dims.expert_enabled else None,
    )


def new_strategy_mesh(mesh: ProcessMesh | None, comm: DataParallelComm | None, pipeline: PipelineConfig | None,
                      tensor: TensorParallelConfig, sequence: int, zero: ZeroConfig,
                      expert: int = 1) -> StrategyMesh | None:
    """A setup's groups: ``None`` when the strategy's ``mesh`` (and ``comm``) has these dimensions and its groups
    live, to be reused; else a new mesh (collective over the world). Note [one mesh per strategy]."""
    initialized = dist.is_available() and dist.is_initialized()
    dims = parallel_dims(dist.get_world_size() if initialized else 1, pipeline, tensor, sequence, expert)
    if mesh is not None and mesh.dims == dims and reusable(comm):
        return None
    return build_mesh(dims, dist.get_rank() if initialized else 0, tensor, zero)


class RunHost(Protocol):
    """What :class:`ParallelRun` reads of its strategy (``ZeroStrategy`` is one)."""

    zero_config: ZeroConfig
    offload: OffloadConfig
    pipeline_config: PipelineConfig | None
    tensor_parallel: TensorParallelConfig
    sequence_parallel: int
    expert_parallel: ExpertParallelConfig | None
    param_init_fn: ParamInitFn | None
    gather_on_teardown: bool

    @property
    def precision_plugin(self) -> ZeroPrecision: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...


class ParallelRun:
    """The strategy's part that holds its mesh and what each setup composes on it; the other parts read it.

    ``mesh``, ``comm`` (ZeRO's group and its collectives), ``tensor`` and ``sequence`` (the dimensions on the
    mesh, when on) and ``everyone`` (every rank's collectives: the step-error agreement) are made by the first
    setup and reused (Note [one mesh per strategy]); ``pipeline`` (this rank's stage) and ``engine`` exist from
    setup to teardown (the engine when fitting, or evaluating a model built sharded); ``last_runtime`` is the last
    fit's stage-3 runtime (its peak counters) and ``after_fit_refusal`` a pipelined fit's reason why a save after
    it is incomplete.

    Args:
        host: the strategy, whose settings are read at each setup (a subclass may change them before).
    """

    def __init__(self, host: RunHost) -> None:
        self._host = host
        self.mesh: ProcessMesh | None = None
        self.comm: DataParallelComm | None = None
        self.everyone: DataParallelComm | None = None  # every rank of the run: the step-error agreement
        self.tensor: StrategyTensorParallel | None = None
        self.sequence: StrategySequenceParallel | None = None
        self.expert: StrategyExpertParallel | None = None
        self.pipeline: StrategyPipeline | None = None
        self.engine: ZeroEngine | None = None
        self.last_runtime: Stage3Runtime | None = None
        self.after_fit_refusal: tuple[str, bool] | None = None

    def open_mesh(self) -> ProcessMesh:
        """This setup's groups: the strategy's mesh while they live, else a new one (collective over the world)."""
        h = self._host
        made = new_strategy_mesh(
            self.mesh, self.comm, h.pipeline_config, h.tensor_parallel, h.sequence_parallel, h.zero_config,
            expert_size(h.expert_parallel, h.lightning_module),
        )
        if made is not None:
            self.mesh, self.comm, self.tensor, self.sequence = made.mesh, made.comm, made.tensor, made.sequence
            self.everyone, self.expert = made.everyone, made.expert
        assert self.mesh is not None
        return self.mesh

    def compose(self, make_optimizer: Callable[[], Optimizer] | None, settings: Mapping[str, str]) -> None:
        """Apply every parallelism to the strategy's module on the mesh :meth:`open_mesh` opened
        (:func:`~lightning_zero.lightning.compose.apply_parallelisms`: ``make_optimizer`` when fitting, ``settings``
        compared across ranks)."""
        h, module = self._host, self._host.lightning_module
        assert self.mesh is not None and self.comm is not None and module is not None
        plan = ParallelPlan(h.zero_config, h.offload, h.pipeline_config, h.param_init_fn, self.tensor, self.sequence,
                            self.expert)
        composed = apply_parallelisms(
            module, self.mesh, self.comm, plan, h.precision_plugin, h.root_device, make_optimizer, settings
        )
        self.pipeline, self.engine = composed.pipeline, composed.engine

    def release(self, failed: bool) -> None:
        """Teardown: :func:`~lightning_zero.lightning.compose.release_parallelisms` (no collective after an error,
        ``failed``); the engine and the stage go, what the last fit leaves for later reads stays."""
        h = self._host
        released = release_parallelisms(
            h.lightning_module,
            self.engine,
            self.pipeline,
            self.sequence,
            h.optimizers,
            h.precision_plugin,
            failed,
            h.gather_on_teardown,
        )
        self.engine = self.pipeline = None
        self.last_runtime = released.last_runtime or self.last_runtime
        self.after_fit_refusal = released.pipeline_refusal or self.after_fit_refusal
