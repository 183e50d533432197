"""The strategy's part :class:`ParallelRun`: its one mesh (``parallel/mesh.py``) and, from setup to teardown, the
one object :func:`~lightning_zero.parallel.parallelize.parallelize` returns; the strategy's other parts read them
here."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.mesh import ProcessMesh
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.parallel.expert import StrategyExpertParallel
from lightning_zero.parallel.mesh import StrategyMesh, open_mesh
from lightning_zero.parallel.parallelize import Parallelized, parallelize, release
from lightning_zero.parallel.pipeline import StrategyPipeline
from lightning_zero.parallel.sequence import StrategySequenceParallel
from lightning_zero.parallel.tensor import StrategyTensorParallel


class ParallelRun:
    """The strategy's mesh and what each setup applied on it.

    ``strategy_mesh`` (the mesh, ZeRO's collectives and every rank's: Note [one mesh per strategy]) is made by the first
    setup and reused; ``parallelized`` exists from setup to teardown (:meth:`setup`, :meth:`release`), and its pieces
    are read through ``engine``, ``pipeline``, ``sequence``; ``tensor`` and ``expert`` (tensor and expert parallelism,
    which know the module they split), ``last_runtime`` (the last fit's stage-3 runtime: its peak counters) and
    ``after_fit_refusal`` (a pipelined fit's reason why a save after it is incomplete) stay after teardown.
    """

    def __init__(self) -> None:
        self.strategy_mesh: StrategyMesh | None = None
        self.parallelized: Parallelized | None = None
        self.tensor: StrategyTensorParallel | None = None
        self.expert: StrategyExpertParallel | None = None
        self.last_runtime: Stage3Runtime | None = None
        self.after_fit_refusal: tuple[str, bool] | None = None

    @property
    def mesh(self) -> ProcessMesh | None:
        return self.strategy_mesh.mesh if self.strategy_mesh is not None else None

    @property
    def comm(self) -> DataParallelComm | None:
        """ZeRO's collectives (its group: ``zero_axes``)."""
        return self.strategy_mesh.comm if self.strategy_mesh is not None else None

    @property
    def everyone(self) -> DataParallelComm | None:
        """Every rank's collectives: the step-error agreement."""
        return self.strategy_mesh.everyone if self.strategy_mesh is not None else None

    @property
    def engine(self) -> ZeroEngine | None:
        return self.parallelized.engine if self.parallelized is not None else None

    @property
    def pipeline(self) -> StrategyPipeline | None:
        return self.parallelized.pipeline if self.parallelized is not None else None

    @property
    def sequence(self) -> StrategySequenceParallel | None:
        return self.parallelized.sequence if self.parallelized is not None else None

    def open_mesh(self, settings: Settings) -> StrategyMesh:
        """This setup's mesh: the strategy's while it lives, else a new one (collective over the world)."""
        self.strategy_mesh = open_mesh(settings, self.strategy_mesh)
        return self.strategy_mesh

    def setup(self, module: pl.LightningModule | None, settings: Settings, precision: ZeroPrecision,
              device: torch.device, make_optimizer: Callable[[], Optimizer] | None, agreed: Mapping[str, str],
              param_init_fn: ParamInitFn | None) -> Parallelized:
        """Every parallelism applied to ``module`` on the mesh :meth:`open_mesh` opened (``make_optimizer`` when
        fitting, ``agreed`` compared across ranks)."""
        assert module is not None and self.strategy_mesh is not None
        self.parallelized = parallelize(module, self.strategy_mesh, settings, precision, device, make_optimizer,
                                        agreed, param_init_fn, self.tensor, self.expert)
        self.tensor, self.expert = self.parallelized.tensor, self.parallelized.expert
        return self.parallelized

    def layout(self) -> dict[str, int]:
        """The dimensions the mesh spans and how many modules the tensor-parallel plan and expert parallelism split
        (empty before the first setup)."""
        if self.mesh is None:
            return {}
        d, tp, ep = self.mesh.dims, self.tensor, self.expert
        return {"world_size": d.world_size, "data": d.data, "pipeline": d.pipeline, "tensor": d.tensor,
                "sequence": d.sequence, "tensor_split_modules": len(tp.split) if tp is not None else 0,
                "expert": d.expert, "expert_split_layers": len(ep.layers) if ep is not None else 0}

    def release(self, module: pl.LightningModule | None, optimizers: list[Optimizer], precision: ZeroPrecision,
                failed: bool, gather_on_teardown: bool) -> None:
        """Teardown: :func:`~lightning_zero.parallel.parallelize.release` (no collective after an error,
        ``failed``); what was applied goes, what the last fit leaves for later reads stays."""
        released = release(self.parallelized, module, optimizers, precision, failed, gather_on_teardown)
        self.parallelized = None
        self.last_runtime = released.last_runtime or self.last_runtime
        self.after_fit_refusal = released.pipeline_refusal or self.after_fit_refusal
