"""How each Lightning step runs under :class:`~lightning_zero.ZeroStrategy` (its part ``StepDispatch``).

``training_step``: resumed random streams first, then the step (or, pipelined, the schedule over
the micro-batches), with an agreement across ranks so that an exception on one rank stops every
rank. Evaluation steps: the forward-only pipeline schedule, or the step followed by the release
of what stage 3 gathered for it; evaluation loaders of stage 3 join the other ranks' gathers when
this rank runs out of batches (``uneven.py``). The sampler shards over the data-parallel group.
The engine around Lightning's own training pieces: ``block_backward_sync`` (no communication before the
accumulation boundary), ``backward`` (the reduction; pipelined, the schedule already ran the backwards) and
``optimizer_step`` (prepare, the non-finite check, then the shards written back and all-gathered).
The strategy's Lightning hooks delegate here, passing Lightning's own step where it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.checkpoint.rng import restore_rng
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.deferred import settle_pending
from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.core.mesh import Axis
from lightning_zero.core.reliability.progress_record import RECORD
from lightning_zero.core.settings.tree import ParallelSettings
from lightning_zero.lightning.precision import ZeroPrecision, to_zero_precision
from lightning_zero.lightning.run import ParallelRun
from lightning_zero.lightning.uneven import JoinedEvalLoader, check_training_batches
from lightning_zero.parallel.mesh import parallel_dims
from lightning_zero.reliability.nonfinite_guard import NonFiniteGuard
from lightning_zero.reliability.step_errors import AGREEMENT_WAIT_S, FirstStepError, StepFailedElsewhere, step_failed


def _plugin(lightning: ParallelStrategy) -> ZeroPrecision:
    """The strategy's precision plugin as the ``ZeroPrecision`` it is (a stock one converted)."""
    return to_zero_precision(lightning.precision_plugin)


class StepDispatch:
    """The steps of a :class:`~lightning_zero.ZeroStrategy`, and the random streams a resumed run continues at its
    first training step (:meth:`resume_rng`).

    Args:
        lightning: the strategy, for what Lightning keeps on it (the module, the precision plugin, the schedulers,
            the ranks).
        run: its engine, stage and groups.
        check_step_errors: agree after every ``training_step`` on whether one raised (Note [deferred agreement]).
        nonfinite: the strategy's non-finite gradient guard (``ZeroConfig.nonfinite``).
    """

    def __init__(self, lightning: ParallelStrategy, run: ParallelRun, *, check_step_errors: bool,
                 nonfinite: NonFiniteGuard) -> None:
        self._lightning = lightning
        self._run = run
        self._check_step_errors = check_step_errors
        self._nonfinite = nonfinite
        self._pending_rng: dict[str, Any] | None = None  # RNG states of a loaded sharded checkpoint
        self._first_error = FirstStepError(None, 0)  # this fit's first failing rank (start_fit: the store's)

    def resume_rng(self, states: dict[str, Any] | None) -> None:
        """Continue these random streams at the next training step (``None``: forget any)."""
        self._pending_rng = states

    def start_fit(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        """End of a fit's setup: a 1-bit Adam warm-up longer than the run is named; with an fp16 loss scaler, LR
        schedulers skip the steps it skipped (:meth:`guard_lr_schedulers`); this fit's first step error gets its key
        (Note [first step error])."""
        self._first_error = FirstStepError.for_this_fit()
        if isinstance(optimizer, OneBitAdam) and (why := optimizer.warmup_outlasts(trainer.max_steps)):
            rank_zero_warn(why)
        if _plugin(self._lightning).scaler is not None:
            self.guard_lr_schedulers()

    def check_train_start(self, trainer: pl.Trainer) -> None:
        """Before the first training step, on every rank: batches a pipeline cannot split into micro-batches, and
        different numbers of training batches per rank (which would hang a rank, ``uneven.py``), are refused."""
        if self._run.pipeline is not None:
            self._run.pipeline.check_train_loader(trainer)
        if self._run.comm is not None:
            steps = trainer.max_steps * trainer.accumulate_grad_batches if trainer.max_steps > 0 else float("inf")
            check_training_batches(trainer.num_training_batches, self._run.comm, steps)

    def guard_lr_schedulers(self) -> None:
        """Note [skipped steps and schedulers]
            Lightning steps step-interval LR schedulers after every optimizer step, also one the
            fp16 loss scaler skipped; DeepSpeed's schedule does not advance then. The module's
            ``lr_scheduler_step`` hook (the user's override, or Lightning's default) is wrapped for
            the fit (an instance attribute, removed at teardown) and does nothing for a
            step-interval scheduler right after a skipped step. Epoch-interval schedulers and
            manual optimization (the user calls ``scheduler.step()``; check
            ``strategy.last_step_skipped``) are left alone.
        """
        host, module = self._lightning, self._lightning.lightning_module
        assert module is not None
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if _plugin(host).last_step_skipped and any(
                c.scheduler is scheduler and c.interval == "step" for c in host.lr_scheduler_configs
            ):
                return None
            return original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    def training_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step``: Lightning's ``training_step`` of the strategy."""
        if self._pending_rng is not None:  # resumed: continue the saved random streams (dropout, ...)
            restore_rng(self._pending_rng)
            self._pending_rng = None
        comm = self._run.everyone  # every rank holding part of the model: data x tensor x pipeline x sequence
        if not self._check_step_errors or comm is None or not comm.active:
            return self._training_step(step, *args, **kwargs)
        broken = RECORD.broken
        try:
            output = self._training_step(step, *args, **kwargs)
        except StepFailedElsewhere:  # an earlier micro-step's agreement, settled inside this step
            raise
        except Exception as error:
            raise self._failed(comm, error, RECORD.broken > broken)  # noqa: B904 - the error itself, or one naming its cause
        # Note [deferred agreement] in core/comm/deferred.py: no synchronisation of its own per micro-step; any
        # collective of the strategy settles it (ZeRO's, tensor or sequence parallel's, Lightning's)
        agreement = comm.ranks_with_later(False)
        agreement.error_for, agreement.when_lost = self._step_failed, self._first_failure
        comm.defer(agreement)
        return output

    def _failed(self, comm: DataParallelComm, error: Exception, collective_broke: bool) -> BaseException:
        """This rank's step raised ``error``: the others learn it, and the error to raise is ``error``, or, when a
        collective of the strategy broke in the step (``collective_broke``) after another rank had failed, the one
        naming that rank (Note [first step error] in reliability/step_errors.py)."""
        first = self._first_error.claim(comm.rank)  # the everyone group: its ranks are the global ranks
        with suppress(Exception):  # the others learn it before they wait on this rank, unless blocked elsewhere
            comm.ranks_with_later(True).ranks_within(AGREEMENT_WAIT_S)
        if not collective_broke or first is None or first == comm.rank:
            return error
        named = self._step_failed([first])
        named.__cause__ = error
        return named

    def _first_failure(self) -> BaseException | None:
        """An agreement broke (a rank's process ended): the error naming the first failing rank, where posted."""
        first = self._first_error.first()
        return None if first is None else self._step_failed([first])

    def _step_failed(self, ranks: list[int]) -> StepFailedElsewhere:
        return step_failed(self._run.mesh.dims if self._run.mesh is not None else None)(ranks)

    def settle_step_errors(self) -> None:
        """Raise here a step error of another rank not yet settled (before Lightning's own collectives)."""
        settle_pending()

    def _training_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        host = self._lightning
        if self._run.pipeline is None or self._run.engine is None:
            return step(*args, **kwargs)
        scaler = _plugin(host).scaler  # the schedule scales each micro-batch's loss itself
        module = host.lightning_module
        assert module is not None
        # Lightning divides a returned loss by the accumulation count before its backward; the schedule's
        # backward ran already, so the division goes into the loss the schedule backpropagates
        accumulate = module.trainer.accumulate_grad_batches if module.automatic_optimization else 1
        return self._run.pipeline.training_step(module, self._run.engine, scaler.scale if scaler is not None else 1.0,
                                            args[0], accumulate)

    # ------------------------------------------------------------------ training: the engine around Lightning's
    @contextmanager
    def backward_sync_blocked(self) -> Iterator[None]:
        """``block_backward_sync``: micro-steps before the accumulation boundary (stages 0-1 do not communicate)."""
        engine = self._run.engine
        if engine is None:
            yield
            return
        with engine.no_sync():
            yield

    def backward(self, backward: Callable[..., Tensor], closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's ``backward`` between the engine's ``before_backward`` and ``finish_backward`` (the reduction)."""
        engine, pipeline = self._run.engine, self._run.pipeline
        if pipeline is not None and engine is not None:
            pipeline.backward(engine)  # the schedule ran the backwards in training_step
            return closure_loss
        if engine is not None:
            engine.before_backward()
        loss = backward(closure_loss, *args, **kwargs)
        if engine is not None:
            engine.finish_backward()
        return loss

    def optimizer_step(self, step: Callable[..., Any], optimizer: Optimizer, closure: Callable[[], Any],
                       model: Any, **kwargs: Any) -> Any:
        """With an engine: the precision plugin's step, its closure followed by the engine's ``before_step`` and the
        non-finite check, then ``after_step``; without one, Lightning's ``step``."""
        host, engine = self._lightning, self._run.engine
        if engine is None:
            return step(optimizer, closure, model, **kwargs)
        plugin = _plugin(host)

        def checked_closure() -> Any:
            result = closure()
            engine.before_step()
            trainer = host.lightning_module.trainer if host.lightning_module is not None else None
            self._nonfinite.check(engine, trainer, fp16=plugin.scaler is not None)
            return result

        output = plugin.optimizer_step(optimizer, model=model or host.lightning_module, closure=checked_closure,
                                       **kwargs)
        engine.after_step()
        return output

    # ------------------------------------------------------------------ data
    def sampler_kwargs(self, parallel: ParallelSettings) -> dict[str, Any] | None:
        """The sampler's replicas and rank: the data dimension of the mesh only (its ``data_shard``: the ranks of a
        pipeline, a tensor-parallel or a sequence group see the same samples; Note [rank order]); ``None``:
        Lightning's (every rank is a data-parallel rank). Before the first setup (a data module's ``setup``) the mesh
        those sizes will make, ``parallel`` on the launched world."""
        host, mesh = self._lightning, self._run.mesh
        world = host.num_nodes * host.num_processes
        if mesh is not None and mesh.dims.world_size == world:
            replicas, rank = mesh.data_shard
        else:
            dims = parallel_dims(world, parallel)
            replicas, rank = dims.data, dims.coordinates(host.global_rank)[Axis.DATA]
        return None if replicas == world else {"num_replicas": replicas, "rank": rank}

    def evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step``: Lightning's ``validation_step`` / ``test_step`` / ``predict_step`` of the strategy."""
        host = self._lightning
        if self._run.pipeline is not None:
            assert host.lightning_module is not None
            stage = {"validation_step": "val", "test_step": "test"}.get(step.__name__, "predict")
            return self._run.pipeline.evaluation_step(host.lightning_module, self._run.engine, stage, args[0])
        try:
            return step(*args, **kwargs)
        finally:
            if self._run.engine is not None:
                self._run.engine.end_forward_only()  # stage 3: free what the step gathered

    def process_dataloader(self, dataloader: Any) -> Any:
        host = self._lightning
        engine, module = self._run.engine, host.lightning_module
        trainer = module.trainer if module is not None else None
        evaluating = trainer is not None and trainer.state.stage not in (None, RunningStage.TRAINING)
        if engine is None or engine.runtime is None or not engine.comm.active or not evaluating:
            return dataloader
        # stage 3 gathers inside every forward: ranks with fewer batches must join the others
        return JoinedEvalLoader(dataloader, engine.runtime, engine.comm, self._batches_drawn_from)

    def _batches_drawn_from(self, loader: Any) -> float:
        """How many batches the running evaluation loop draws from ``loader`` (limits applied)."""
        module = self._lightning.lightning_module
        assert module is not None
        loop = module.trainer._evaluation_loop
        for dl, limit in zip(loop._combined_loader.flattened, loop.max_batches):
            if dl is loader:
                return limit
        return float("inf")
