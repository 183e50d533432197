"""``ZeroStrategy``: DeepSpeed-style ZeRO as a Lightning strategy, on plain torch.distributed.

The strategy is thin glue: process groups and launchers come from Lightning's DDP machinery, and
all partitioning lives in :mod:`lightning_zero.core`, which the strategy drives:

    setup            -> ZeroEngine(module, optimizer)       flat buffers, hooks, broadcast
    block_backward_sync (non-boundary micro-steps) -> engine.no_sync()
    backward         -> loss.backward(); engine.finish_backward()
    clip (precision plugin) -> engine.clip_grad_norm_()     global norm over shards
    optimizer_step   -> [engine.prepare_step()] optimizer.step(); engine.after_step()
                                                            all-gather of updated shards
    teardown         -> engine.detach()                     params own their storage again

16-bit modes (``lightning_zero.lightning.precision``): the plugin casts the module before the engine is
built, hands the engine its dtypes and the pre-cast weights (the fp32 masters start from them)
and, for fp16, scales the loss and skips overflowing steps; the strategy then keeps step-interval
LR schedulers from advancing (Note [skipped steps and schedulers]).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.core.mesh import ProcessMesh
from lightning_zero.core.offload.config import OffloadConfig, offload_from_args
from lightning_zero.core.precision.loss_scaler import LossScalerConfig
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.zero.config import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.memory import ModelStateBytes
from lightning_zero.lightning.compose import (
    ParallelPlan,
    apply_parallelisms,
    check_parallel_options,
    release_parallelisms,
)
from lightning_zero.lightning.mesh_setup import new_strategy_mesh
from lightning_zero.lightning.precision import ZeroPrecision, strategy_precision, to_zero_precision
from lightning_zero.lightning.registry import register_zero_strategies
from lightning_zero.lightning.sharded_build import hidden_from_teardown, sharded_build_context
from lightning_zero.lightning.state import StrategyCheckpointing
from lightning_zero.lightning.steps import StepDispatch
from lightning_zero.lightning.uneven import check_training_batches
from lightning_zero.observability.callbacks import add_monitor
from lightning_zero.observability.monitoring import ProfilerWindow
from lightning_zero.pipeline.config import PipelineConfig
from lightning_zero.pipeline.lightning import StrategyPipeline
from lightning_zero.reliability.hang_watchdog import HangWatchdog, RecordedCollectives, add_hang_watchdog
from lightning_zero.reliability.nonfinite_guard import NonFiniteGuard
from lightning_zero.reliability.setup_agreement import setup_settings
from lightning_zero.sequence_parallel import StrategySequenceParallel
from lightning_zero.tensor_parallel.config import TensorParallelConfig
from lightning_zero.tensor_parallel.lightning import StrategyTensorParallel, refuse_pipeline_checkpoint

log = logging.getLogger(__name__)


class ZeroStrategy(DDPStrategy):
    """Data parallel training with ZeRO stage 0, 1, 2 or 3 partitioning.

    Args:
        stage: 0 (DDP-like), 1 (optimizer state and fp32 master partitioned), 2 (+ gradients),
            3 (+ parameters, gathered per unit just in time).
        config: a full :class:`~lightning_zero.core.zero.config.ZeroConfig`; overrides ``stage`` and
            ``zero_options`` when given.
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or a
            :class:`~lightning_zero.ZeroPrecision`; wins over the Trainer's ``precision``. Without
            it ``Trainer(precision=...)`` is converted (on CPU Lightning turns ``"16-mixed"``
            into ``"bf16-mixed"`` before the strategy sees it: pass fp16 here to keep it).
        loss_scaler: fp16 loss-scaler policy when ``precision="16-mixed"`` is given as a string.
        check_step_errors: after every ``training_step`` the ranks agree on whether any of them
            raised, so an error in one rank's step is raised on every rank instead of leaving the
            others waiting in a collective (one tiny asynchronous all-reduce per micro-step, read when the
            rank next issues a collective: Note [deferred agreement] in core/comm/data_parallel.py).
        param_init_fn: stage 3 with ``configure_model``: ``fn(module, name)`` initialises a
            module's own parameters, which were built on the meta device (default: the module's
            ``reset_parameters()``). See docs/large_models.md.
        gather_on_teardown: stage 3: after fit, give the module its whole parameters (and the
            optimizer its whole state) back, as for other stages, when that fits in the memory
            every rank can still allocate (else less, with one warning; Note [teardown gather] in
            core/stage3/teardown.py). ``False`` leaves them released: save checkpoints during fit instead.
        checkpoint_format: ``"sharded"``: ``trainer.save_checkpoint(path)`` / ``ModelCheckpoint``
            write a directory in which every rank writes its own shards, published atomically
            (docs/checkpoints.md); ``"consolidated"``: Lightning's single file, gathered on rank 0;
            ``"auto"`` (default): sharded at stage >= 1, consolidated at stage 0 (every rank holds
            everything there). Both formats are read whatever this says.
        monitor: when fitting, add a :class:`~lightning_zero.ZeroStatsMonitor` (loss, lr, gradient
            norm, loss scale, throughput, step-time split, memory per rank; docs/monitoring.md) to the
            Trainer's callbacks unless it already has one. ``False``: don't.
        profiler: a :class:`~lightning_zero.observability.monitoring.ProfilerWindow` (``True``: the default window)
            for the monitor this strategy adds: ``torch.profiler`` with memory profiling over a window
            of optimizer steps, traces in ``<log dir>/profiler``.
        pipeline: a :class:`~lightning_zero.PipelineConfig`: split the module into pipeline stages
            (it must follow the pipeline protocol, docs/pipeline.md); ZeRO then partitions each
            stage over its data-parallel group (world size / stages ranks).
        offload_optimizer: ``"cpu"`` or ``"nvme"`` (stages 1-3): this rank's master shard and optimizer
            state in host memory or in swap files under ``nvme_path`` (docs/offload.md).
        offload_param: ``"cpu"`` or ``"nvme"`` (stage 3): parameter shards too.
        nvme_path: an existing, writable directory for ``"nvme"``.
        offload: a full :class:`~lightning_zero.OffloadConfig` instead of the three shortcuts.
        tensor_parallel: ranks per tensor-parallel group (an int) or a
            :class:`~lightning_zero.TensorParallelConfig` (size, plan): split the planned layers across adjacent
            ranks; ZeRO then partitions over the data dimension only (docs/tensor_parallel.md).
        sequence_parallel: ranks per sequence group (DeepSpeed-Ulysses, docs/sequence_parallel.md): each
            sample's sequence is split over them, ZeRO partitions over data x sequence, the sampler shards
            over data only; the module must have ``configure_sequence_parallel`` (the GPT experiment has).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, start_method: as for Lightning's ``DDPStrategy``.
        resolved_config: settings that must agree on every rank (the CLI's resolved config), compared
            across ranks at setup before the first collective (Note [setup agreement]).
        **zero_options: fields of ``ZeroConfig`` (``reduce_bucket_size``, ``overlap_comm``,
            ``collective``, ``timeout_s``, ``elementwise_optimizers``, ...).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        *,
        config: ZeroConfig | None = None,
        precision: str | ZeroPrecision | None = None,
        loss_scaler: LossScalerConfig | None = None,
        check_step_errors: bool = True,
        param_init_fn: ParamInitFn | None = None,
        gather_on_teardown: bool = True,
        checkpoint_format: str = "auto",
        monitor: bool = True,
        profiler: ProfilerWindow | bool | None = None,
        pipeline: PipelineConfig | None = None,
        offload_optimizer: str | None = None,
        offload_param: str | None = None,
        nvme_path: str | None = None,
        offload: OffloadConfig | None = None,
        tensor_parallel: int | TensorParallelConfig | None = None,
        sequence_parallel: int = 1,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        resolved_config: dict[str, Any] | None = None,
        **zero_options: Any,
    ) -> None:
        self.zero_config: ZeroConfig = config or ZeroConfig.from_kwargs(stage, zero_options)
        self.offload: OffloadConfig = offload_from_args(offload, offload_optimizer, offload_param, nvme_path)
        self.offload.check(self.zero_config.stage)  # bad input refused before any process starts
        self.offload.check_path()
        self.tensor_parallel = check_parallel_options(tensor_parallel, sequence_parallel, pipeline, self.offload)
        self._tp: StrategyTensorParallel | None = None  # the applied plan (from the mesh, when tensor parallel)
        self.sequence_parallel = sequence_parallel
        self._sequence: StrategySequenceParallel | None = None  # the sequence groups (setup, when > 1)
        precision_plugin = strategy_precision(precision, loss_scaler, precision_plugin)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self.zero_config.timeout_s),
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.check_step_errors = check_step_errors
        self.param_init_fn = param_init_fn
        self.gather_on_teardown = gather_on_teardown
        if checkpoint_format not in ("auto", "sharded", "consolidated"):
            raise ValueError(
                f"checkpoint_format must be 'auto', 'sharded' or 'consolidated', got {checkpoint_format!r}."
            )
        self.checkpoint_format = checkpoint_format
        if profiler and not monitor:
            raise ValueError("`profiler` runs inside the monitor: drop `monitor=False`, or the profiler.")
        self.monitor = monitor
        self.profiler: ProfilerWindow | None = ProfilerWindow() if profiler is True else (profiler or None)
        self._fixed_precision = precision_plugin is not None
        self._engine: ZeroEngine | None = None  # set in setup() when fitting (or evaluating a sharded build)
        self._built_sharded = False  # this run's model was built in configure_model (stage 3), until teardown
        self._last_runtime: Stage3Runtime | None = None  # the stage-3 runtime of the last fit (its peak counters)
        self._mesh: ProcessMesh | None = None  # the process groups, one set per strategy (Note [clean exit])
        self._comm: DataParallelComm | None = None  # ZeRO's group of the mesh and its collectives
        self.pipeline_config = pipeline if pipeline is not None and pipeline.stages > 1 else None
        self._pipeline: StrategyPipeline | None = None  # this rank's stage (setup, when pipelined)
        self._hang: HangWatchdog | None = None  # this rank's heartbeat (core/reliability/heartbeat.py)
        self._nonfinite = NonFiniteGuard(self.zero_config.nonfinite)
        self.resolved_config: dict[str, Any] | None = resolved_config  # compared across ranks at setup
        self._steps = StepDispatch(self)  # how each Lightning step runs (steps.py)
        self._checkpointing = StrategyCheckpointing(self)  # state dicts and checkpoint files (state.py)
        self._collectives = RecordedCollectives()  # Lightning's own collectives in the hang watchdog's record
        self._after_fit_refusal: tuple[str, bool] | None = None  # a pipelined fit's teardown: why a save is incomplete

    # ------------------------------------------------------------------ state (its part: state.py)
    @property
    def engine(self) -> ZeroEngine | None:
        """The ZeRO engine driving the current fit, or, for a stage-3 model built in
        ``configure_model``, the current test / validate / predict run (``None`` otherwise)."""
        return self._engine

    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of ``params``, ``grads``, ``optimizer`` and ``comm_buffers``, counted from the
        tensors that exist (each storage once), not from a formula."""
        return self._checkpointing.model_state_bytes()

    def load_full_state_dict(
        self, source: str | os.PathLike | Mapping[str, Tensor], prefix: str = "", strict: bool = True
    ) -> None:
        """Load whole (unsharded) weights, e.g. a Hugging Face ``.safetensors`` file, into the model (on every
        rank, after setup; stage 3 streams them unit by unit into the shards): see
        :meth:`~lightning_zero.lightning.state.StrategyCheckpointing.load_full_state_dict`."""
        self._checkpointing.load_full_state_dict(source, prefix, strict)

    @property
    def gathered_peak_numel(self) -> int:
        """Stage 3: the most parameter elements ever gathered at once on this rank (0 for other stages)."""
        return self._checkpointing.gathered_peak_numel

    @property
    def gathered_bound_numel(self) -> int:
        """Stage 3: the bound on :attr:`gathered_peak_numel` (``prefetch_bucket_size``, ``max_live_parameters``)."""
        return self._checkpointing.gathered_bound_numel

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (``None`` in the other modes)."""
        return self.precision_plugin.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed (checkpointed)."""
        return self.precision_plugin.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (overflow on some rank)."""
        return self.precision_plugin.last_step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled) of the last step that measured it."""
        return self._checkpointing.last_grad_norm

    @property
    def engine_comm(self) -> DataParallelComm | None:
        """The running engine's data-parallel collectives (``None`` without an engine): what the monitor times
        and counts (Note [the monitor reads a view, not the engine] in observability/stats_source.py)."""
        return self._engine.comm if self._engine is not None else None

    @property
    def pipelined(self) -> bool:
        """Whether the module is split into pipeline stages."""
        return self.pipeline_config is not None

    def measure_grad_norm(self) -> float | None:
        """The global norm of the gradients held now (a collective), ``None`` without an engine."""
        return float(self._engine.grad_norm()) if self._engine is not None else None

    def step_stats(self) -> dict[str, float]:
        """``train/loss_scale``, ``train/skipped_steps``, ``train/grad_norm`` where known (the monitor's names)."""
        return self._checkpointing.step_stats()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpointing.lightning_module_state_dict(super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpointing.optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpointing.load_optimizer_state_dict(checkpoint, super().load_optimizer_state_dict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        refuse_pipeline_checkpoint(self.tensor_parallel, self.pipeline_config is not None,
                                   self._checkpointing._writes_shards)
        self._checkpointing.save_checkpoint(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpointing.remove_checkpoint(filepath, super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpointing.load_checkpoint(checkpoint_path, weights_only, super().load_checkpoint)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self._checkpointing.restore_checkpoint_after_setup

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpointing.load_model_state_dict(checkpoint, strict, super().load_model_state_dict)

    @property
    def nonfinite_skipped_steps(self) -> int:
        """Optimizer steps of the last fit skipped for nan / inf gradients (``nonfinite="skip"``)."""
        return self._nonfinite.skipped

    # ------------------------------------------------------------------ plugins
    @property  # type: ignore[override]
    def precision_plugin(self) -> ZeroPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, ZeroPrecision) else to_zero_precision(plugin)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if getattr(self, "_fixed_precision", False) and plugin is not None and not isinstance(plugin, ZeroPrecision):
            return  # the strategy's own precision wins over the Trainer's default
        self._precision_plugin = to_zero_precision(plugin) if plugin is not None else None

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        if self.num_nodes * self.num_processes == 1 and not dist.is_initialized():
            # one rank: no process group at all, so nothing is ever communicated
            assert self.accelerator is not None
            self.accelerator.setup_device(self.root_device)
            self.set_world_ranks()
            return
        super().setup_environment()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if self._pipeline is not None:  # batches that do not split into micro-batches: refused before any step
            self._pipeline.check_train_loader(trainer)
        if self._comm is not None:  # uneven training batches would hang a rank: refuse on every rank
            steps = trainer.max_steps * trainer.accumulate_grad_batches if trainer.max_steps > 0 else float("inf")
            check_training_batches(trainer.num_training_batches, self._comm, steps)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        mesh = self._process_mesh()
        self._hang = add_hang_watchdog(trainer, self.zero_config.hang_timeout_s)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            add_monitor(trainer, self.monitor, self.profiler)
        assert self._comm is not None
        composed = apply_parallelisms(
            self.lightning_module, mesh, self._comm,
            ParallelPlan(self.zero_config, self.offload, self.pipeline_config, self.param_init_fn, self._tp,
                         self._sequence),
            self.precision_plugin, self.root_device, (lambda: self._the_optimizer(trainer)) if fitting else None,
            setup_settings(self, trainer),
        )
        self._pipeline, self._engine = composed.pipeline, composed.engine
        self._built_sharded = self._built_sharded or composed.built_sharded
        if fitting:
            if isinstance(opt := self.optimizers[0], OneBitAdam) and (why := opt.warmup_outlasts(trainer.max_steps)):
                rank_zero_warn(why)
            if self.precision_plugin.scaler is not None:
                self._steps.guard_lr_schedulers()
        self.setup_precision_plugin()

    def _the_optimizer(self, trainer: pl.Trainer) -> Optimizer:
        """Lightning's ``configure_optimizers``, refused unless it makes exactly one optimizer."""
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise NotImplementedError(
                f"ZeroStrategy supports exactly one optimizer, got {len(self.optimizers)}. Put several "
                "parameter sets in param groups of one optimizer."
            )
        return self.optimizers[0]

    def _process_mesh(self) -> ProcessMesh:
        """The strategy's mesh, ZeRO's comm over it and the dimensions built on it (Note [one mesh per strategy])."""
        made = new_strategy_mesh(self._mesh, self._comm, self.pipeline_config, self.tensor_parallel,
                                 self.sequence_parallel, self.zero_config)
        if made is not None:
            self._mesh, self._comm, self._tp, self._sequence = made.mesh, made.comm, made.tensor, made.sequence
        assert self._mesh is not None
        return self._mesh

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 or a pipeline: parameters built in ``configure_model`` go to the meta device (sharded_build.py)."""
        with sharded_build_context(self.zero_config, self.pipeline_config):
            yield

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # never wrapped: the engine's hooks do what DDP's wrapper would

    # ------------------------------------------------------------------ steps (their part: steps.py)
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.training_step(super().training_step, *args, **kwargs)

    # Lightning's own collectives and the end of training settle the step-error agreement first
    @override
    def barrier(self, name: str | None = None) -> None:
        self._steps.settle_step_errors()
        with self._collectives.barrier(name):
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._steps.settle_step_errors()
        with self._collectives.broadcast():
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        self._steps.settle_step_errors()
        with self._collectives.reduce():
            return super().reduce(tensor, *args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self._steps.settle_step_errors()
        super().on_train_end()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.evaluation_step(super().predict_step, *args, **kwargs)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._steps.sampler_kwargs() or super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self._steps.process_dataloader(dataloader)

    # ------------------------------------------------------------------ training (the engine around Lightning's)
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._steps.backward_sync_blocked():
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        return self._steps.backward(super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        return self._steps.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)

    @override
    def teardown(self) -> None:
        self._steps.resume_rng(None)
        if self._hang is not None:
            self._hang.stop()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        failed = trainer is None or trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            self._teardown(failed)
        except Exception as err:
            if not failed:
                raise
            # the run already failed: its error, which Lightning re-raises next, is the one to see
            log.warning(f"ZeroStrategy.teardown after the error also failed: {err!r}")
        finally:
            self._built_sharded = False

    def _teardown(self, failed: bool) -> None:
        released = release_parallelisms(self._engine, self._pipeline, self.optimizers, self.precision_plugin, failed,
                                        self.gather_on_teardown)
        self._engine = self._pipeline = None
        self._last_runtime = released.last_runtime or self._last_runtime
        self._after_fit_refusal = released.pipeline_refusal or self._after_fit_refusal
        module = self.lightning_module
        if module is not None and self._sequence is not None:
            self._sequence.detach(module)
        if module is not None:
            module.__dict__.pop("lr_scheduler_step", None)  # Note [skipped steps and schedulers]
            self.precision_plugin.restore_module(module)
        if not hidden_from_teardown(module):
            super().teardown()
            return
        self._lightning_module = None  # Lightning's teardown moves the module: nothing of it exists to move
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_zero_strategies(cls, strategy_registry)
