"""How each Lightning step runs under :class:`~lightning_zero.ZeroStrategy`.

``training_step``: resumed random streams first, then the step (or, pipelined, the schedule over
the micro-batches), with an agreement across ranks so that an exception on one rank stops every
rank. Evaluation steps: the forward-only pipeline schedule, or the step followed by the release
of what stage 3 gathered for it; evaluation loaders of stage 3 join the other ranks' gathers when
this rank runs out of batches (``uneven.py``). The sampler shards over the data-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_zero.checkpoint.rng import restore_rng
from lightning_zero.core.mesh import ParallelDims
from lightning_zero.lightning.uneven import JoinedEvalLoader
from lightning_zero.sequence_parallel.lightning import sampler_kwargs


class StepDispatchMixin:
    """Mixin of :class:`~lightning_zero.ZeroStrategy` (before ``DDPStrategy`` in its bases): the steps."""

    # set by ZeroStrategy (strategy.py): what these methods read
    _pending_rng: Any
    check_step_errors: bool
    _comm: Any  # DataParallelComm | None
    _engine: Any  # ZeroEngine | None
    _pipeline: Any  # StrategyPipeline | None
    pipeline_config: Any  # PipelineConfig | None
    sequence_parallel: int
    precision_plugin: Any
    lightning_module: Any
    num_nodes: int
    num_processes: int
    global_rank: int
    last_step_skipped: bool
    lr_scheduler_configs: Any

    def _guard_lr_schedulers(self) -> None:
        """Note [skipped steps and schedulers]
            Lightning steps step-interval LR schedulers after every optimizer step, also one the
            fp16 loss scaler skipped; DeepSpeed's schedule does not advance then. The module's
            ``lr_scheduler_step`` hook (the user's override, or Lightning's default) is wrapped for
            the fit (an instance attribute, removed at teardown) and does nothing for a
            step-interval scheduler right after a skipped step. Epoch-interval schedulers and
            manual optimization (the user calls ``scheduler.step()``; check
            ``strategy.last_step_skipped``) are left alone.
        """
        module = self.lightning_module
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if self.last_step_skipped and any(
                c.scheduler is scheduler and c.interval == "step" for c in self.lr_scheduler_configs
            ):
                return None
            return original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending_rng is not None:  # resumed: continue the saved random streams (dropout, ...)
            restore_rng(self._pending_rng)
            self._pending_rng = None
        if not self.check_step_errors or self._comm is None or not self._comm.active:
            return self._training_step(*args, **kwargs)
        error: BaseException | None = None
        try:
            output = self._training_step(*args, **kwargs)
        except Exception as exc:
            error = exc
        failed = self._comm.ranks_with(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"training_step raised on data-parallel rank(s) {failed}; stopping this rank too. "
                "The traceback of the failing rank(s) says why."
            )
        return output

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None or self._engine is None:
            return super().training_step(*args, **kwargs)
        scaler = self.precision_plugin.scaler  # the schedule scales each micro-batch's loss itself
        module = self.lightning_module
        # Lightning divides a returned loss by the accumulation count before its backward; the schedule's
        # backward ran already, so the division goes into the loss the schedule backpropagates
        accumulate = module.trainer.accumulate_grad_batches if module.automatic_optimization else 1
        return self._pipeline.training_step(module, self._engine, scaler.scale if scaler is not None else 1.0,
                                            args[0], accumulate)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.sequence_parallel > 1:  # the data dimension only (Note [sequence parallel in the strategy])
            return sampler_kwargs(ParallelDims(self.num_nodes * self.num_processes, sequence=self.sequence_parallel),
                                  self.global_rank)
        if self.pipeline_config is None:
            return super().distributed_sampler_kwargs
        world = self.num_nodes * self.num_processes
        mesh_dp = self.pipeline_config.data_parallel_size(world)
        return {"num_replicas": mesh_dp, "rank": self.global_rank % mesh_dp}  # Note [rank layout]

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            stage = {"validation_step": "val", "test_step": "test"}.get(step.__name__, "predict")
            return self._pipeline.evaluation_step(self.lightning_module, self._engine, stage, args[0])
        try:
            return step(*args, **kwargs)
        finally:
            if self._engine is not None:
                self._engine.end_forward_only()  # stage 3: free what the step gathered

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        engine, trainer = self._engine, self.lightning_module.trainer if self.lightning_module else None
        evaluating = trainer is not None and trainer.state.stage not in (None, RunningStage.TRAINING)
        if engine is None or engine.runtime is None or not engine.comm.active or not evaluating:
            return dataloader
        # stage 3 gathers inside every forward: ranks with fewer batches must join the others
        return JoinedEvalLoader(dataloader, engine.runtime, engine.comm, self._batches_drawn_from)

    def _batches_drawn_from(self, loader: Any) -> float:
        """How many batches the running evaluation loop draws from ``loader`` (limits applied)."""
        loop = self.lightning_module.trainer._evaluation_loop
        for dl, limit in zip(loop._combined_loader.flattened, loop.max_batches):
            if dl is loader:
                return limit
        return float("inf")
