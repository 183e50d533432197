"""``ZeroStrategy``: DeepSpeed-style ZeRO as a Lightning strategy, on plain torch.distributed.

The strategy is thin glue: process groups and launchers come from Lightning's DDP machinery, its arguments are
the settings tree (``settings``, translated by ``arguments.py``: Note [one settings tree]), and all partitioning lives
in :mod:`lightning_zero.core`, which it drives through its parts (``run.ParallelRun``, ``steps.StepDispatch``,
``state.StrategyCheckpointing``), each given the settings and collaborators it needs explicitly:

    setup            -> ZeroEngine(module, optimizer)       flat buffers, hooks, broadcast (parallel/)
    block_backward_sync (non-boundary micro-steps) -> engine.no_sync()
    backward         -> loss.backward(); engine.finish_backward()
    clip (precision plugin) -> engine.clip_grad_norm_()     global norm over shards
    optimizer_step   -> [engine.prepare_step()] optimizer.step(); engine.after_step()
                                                            all-gather of updated shards
    teardown         -> engine.detach()                     params own their storage again
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.choices import CheckpointFormat
from lightning_zero.core.common.memory import ModelStateBytes
from lightning_zero.core.offload.swap_io import IOCounters
from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.precision import LossScalerConfig
from lightning_zero.core.settings.rules import check_settings
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.lightning.arguments import KEYWORDS, strategy_arguments
from lightning_zero.lightning.precision import ZeroPrecision, to_zero_precision
from lightning_zero.lightning.registry import register_zero_strategies
from lightning_zero.lightning.run import ParallelRun
from lightning_zero.lightning.sharded_build import hidden_from_teardown, sharded_build_context
from lightning_zero.lightning.state import StrategyCheckpointing, called_by_checkpoint_dump
from lightning_zero.lightning.steps import StepDispatch
from lightning_zero.observability.callbacks import add_monitor
from lightning_zero.observability.monitoring import ProfilerWindow
from lightning_zero.parallel.expert import expert_settings
from lightning_zero.reliability.hang_watchdog import HangWatchdog, RecordedCollectives, add_hang_watchdog
from lightning_zero.reliability.nonfinite_guard import NonFiniteGuard
from lightning_zero.reliability.setup_agreement import setup_settings

log = logging.getLogger(__name__)


def only_optimizer(optimizers: list[Optimizer]) -> Optimizer:
    """The one optimizer of Lightning's ``configure_optimizers``, refused unless it made exactly one (ZeRO shards
    one optimizer's state)."""
    if len(optimizers) != 1:
        raise NotImplementedError(
            f"ZeroStrategy supports exactly one optimizer, got {len(optimizers)}. Put several "
            "parameter sets in param groups of one optimizer."
        )
    return optimizers[0]


class ZeroStrategy(DDPStrategy):
    """Data parallel training with ZeRO stage 0, 1, 2 or 3 partitioning (docs/zero.md lists every option).

    Args:
        stage: 0 (DDP-like), 1 (optimizer state and fp32 master partitioned), 2 (+ gradients), 3 (+ parameters).
        settings: the whole settings tree (:class:`~lightning_zero.core.settings.Settings`: ZeRO, offload, parallel
            sizes, precision, checkpoint format) instead of the arguments that make it (``stage``, ``config``,
            ``precision``, ``loss_scaler``, ``checkpoint_format``, ``pipeline``, the offload arguments,
            ``tensor_parallel``, ``sequence_parallel``, ``zero_options``): the Hydra and DeepSpeed routes pass it.
        config: a full :class:`~lightning_zero.ZeroConfig`; overrides ``stage`` and ``zero_options``.
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or a ``ZeroPrecision``, over the
            Trainer's (on CPU Lightning turns ``"16-mixed"`` into ``"bf16-mixed"``: pass fp16 here).
        loss_scaler: fp16 loss-scaler policy when ``precision="16-mixed"`` is given as a string.
        check_step_errors: the ranks agree after every ``training_step`` on whether one raised, so its error is raised
            on every rank (one tiny asynchronous all-reduce per micro-step: Note [deferred agreement]).
        param_init_fn: stage 3 with ``configure_model``: ``fn(module, name)`` initialises a module's own parameters,
            built on the meta device (default: ``reset_parameters()``; docs/large_models.md).
        gather_on_teardown: stage 3: after fit, the module gets its whole parameters (the optimizer its whole state)
            back where every rank can still allocate them (Note [teardown gather]); ``False`` leaves them released.
        checkpoint_format: ``"sharded"`` (every rank writes its own shards, docs/checkpoints.md), ``"consolidated"``
            (Lightning's one file, gathered on rank 0) or ``"auto"`` (sharded at stage >= 1); both are read.
        monitor: when fitting, add a ``ZeroStatsMonitor`` (docs/monitoring.md) unless the Trainer has one.
        profiler: a :class:`~lightning_zero.ProfilerWindow` (``True``: the default) for that monitor:
            ``torch.profiler`` with memory profiling over a window of steps, traces in the log dir.
        pipeline: a :class:`~lightning_zero.PipelineConfig`: split the module into pipeline stages (docs/pipeline.md);
            ZeRO partitions each stage over its data-parallel group.
        offload_optimizer: ``"cpu"`` or ``"nvme"`` (stages 1-3): the master shard and optimizer state in host memory
            or in swap files under ``nvme_path`` (docs/offload.md).
        offload_param: ``"cpu"`` or ``"nvme"`` (stage 3): parameter shards too.
        nvme_path: an existing, writable directory for ``"nvme"``.
        offload: a full :class:`~lightning_zero.OffloadConfig` instead of the three shortcuts.
        tensor_parallel: ranks per tensor-parallel group or a :class:`~lightning_zero.TensorParallelConfig` (size,
            plan): the planned layers split across adjacent ranks, ZeRO over data only (docs/tensor_parallel.md).
        sequence_parallel: ranks per sequence group (DeepSpeed-Ulysses, docs/sequence_parallel.md; the module needs
            ``configure_sequence_parallel``): ZeRO partitions over data x sequence.
        expert_parallel: ranks per expert-parallel group or an :class:`~lightning_zero.ExpertParallelConfig`: each MoE
            layer's experts split over data ranks, tokens sent to them (docs/expert_parallel.md).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, start_method: as for Lightning's ``DDPStrategy``.
        resolved_config: the CLI's resolved config, which must agree on every rank (Note [setup agreement]).
        **zero_options: fields of ``ZeroConfig`` (``reduce_bucket_size``, ``timeout_s``, ``max_reuse_distance``, ...).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        *,
        settings: Settings | None = None,
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
        expert_parallel: int | ExpertParallelConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        resolved_config: dict[str, Any] | None = None,
        **zero_options: Any,
    ) -> None:
        args = strategy_arguments(  # every argument checked before any process starts
            stage, zero_options, settings=settings, config=config, precision=precision, loss_scaler=loss_scaler,
            precision_plugin=precision_plugin, checkpoint_format=checkpoint_format, pipeline=pipeline,
            offload=offload, offload_optimizer=offload_optimizer, offload_param=offload_param, nvme_path=nvme_path,
            tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
        )
        if profiler and not monitor:
            raise ValueError("`profiler` runs inside the monitor: drop `monitor=False`, or the profiler.")
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=args.precision_plugin,
            process_group_backend=process_group_backend, timeout=timedelta(seconds=args.settings.zero.timeout_s),
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.settings: Settings = args.settings  # the settings tree (Note [one settings tree]); a new one replaces it
        self.monitor, self.profiler = monitor, ProfilerWindow() if profiler is True else (profiler or None)
        self.check_step_errors, self.param_init_fn = check_step_errors, param_init_fn
        self.gather_on_teardown = gather_on_teardown
        self.resolved_config: dict[str, Any] | None = resolved_config  # compared across ranks at setup
        self._fixed_precision = args.precision_plugin is not None  # it wins over the Trainer's
        self._hang: HangWatchdog | None = None  # this rank's heartbeat (core/reliability/heartbeat.py)
        self._nonfinite = NonFiniteGuard(self.settings.zero.nonfinite)
        self._run = ParallelRun()  # the mesh, and what each setup parallelizes on it (run.py)
        # how each Lightning step runs (steps.py)
        self._steps = StepDispatch(self, self._run, check_step_errors=check_step_errors, nonfinite=self._nonfinite)
        self._checkpointing = StrategyCheckpointing(self, self._run, self._steps)  # state dicts, files (state.py)
        # Lightning's own collectives (and the end of training) settle another rank's step error first
        self._collectives = RecordedCollectives(settle=self._steps.settle_step_errors)

    # ------------------------------------------------------------------ the settings tree's nodes, read-only
    @property
    def zero_config(self) -> ZeroConfig:
        """The ZeRO node of :attr:`settings`."""
        return self.settings.zero

    @property
    def offload(self) -> OffloadConfig:
        """The offload node of :attr:`settings`."""
        return self.settings.offload

    @property
    def pipeline_config(self) -> PipelineConfig | None:
        """The pipeline of :attr:`settings` (``None``: not split)."""
        return self.settings.parallel.pipeline

    @property
    def tensor_parallel(self) -> TensorParallelConfig:
        """The tensor-parallel node of :attr:`settings`."""
        return self.settings.parallel.tensor

    @property
    def sequence_parallel(self) -> int:
        """Ranks per sequence group (:attr:`settings`)."""
        return self.settings.parallel.sequence

    @property
    def expert_parallel(self) -> ExpertParallelConfig | None:
        """The expert-parallel node of :attr:`settings` (``None``: the MoE layers' ``ep_size``, else off)."""
        return self.settings.parallel.expert

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """How checkpoints are saved (:attr:`settings`); assigning one replaces the settings tree's value."""
        return self.settings.checkpoint_format

    @checkpoint_format.setter
    def checkpoint_format(self, value: str | CheckpointFormat) -> None:
        self.settings = check_settings(replace(self.settings, checkpoint_format=value), KEYWORDS)

    # ------------------------------------------------------------------ read-outs (state.py and the engine)
    @property
    def engine(self) -> ZeroEngine | None:
        """The ZeRO engine of the current fit (or evaluation of a stage-3 model built in ``configure_model``)."""
        return self._run.engine

    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of ``params``, ``grads``, ``optimizer`` and ``comm_buffers``, counted from its tensors."""
        return self._checkpointing.model_state_bytes()

    def load_full_state_dict(
        self, source: str | os.PathLike | Mapping[str, Tensor], prefix: str = "", strict: bool = True
    ) -> None:
        """Load whole weights (e.g. a ``.safetensors`` file) into the model, on every rank after setup: see
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
    def nonfinite_skipped_steps(self) -> int:
        """Optimizer steps of the last fit skipped for nan / inf gradients (``nonfinite="skip"``)."""
        return self._nonfinite.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled) of the last step that measured it."""
        return self._checkpointing.last_grad_norm

    @property
    def engine_comm(self) -> DataParallelComm | None:
        """The running engine's collectives, timed by the monitor (Note [the monitor reads a view, not the engine])."""
        return self.engine.comm if self.engine is not None else None

    def layout(self) -> dict[str, int]:
        """What ran: the sizes of the mesh's dimensions (``world_size``, ``data``, ``pipeline``, ``tensor``,
        ``sequence``) and how many modules the tensor-parallel plan split (``tensor_split_modules``); empty before
        the first setup. ``lightning-zero train`` writes it into ``result.json``."""
        return self._run.layout()

    @property
    def pipelined(self) -> bool:
        """Whether the module is split into pipeline stages."""
        return self.pipeline_config is not None

    def measure_grad_norm(self) -> float | None:
        """The global norm of the gradients held now (a collective), ``None`` without an engine."""
        return float(self.engine.grad_norm()) if self.engine is not None else None

    @property
    def swap_io(self) -> IOCounters | None:
        """Disk offload's swap-file I/O so far (Note [I/O overlap] in ``core/offload/swap_io.py``), else ``None``."""
        sharded = self.engine.sharded if self.engine is not None else None
        return sharded.store.io_counters() if sharded is not None else None

    def step_stats(self) -> dict[str, float]:
        """``train/loss_scale``, ``train/skipped_steps``, ``train/grad_norm`` where known (the monitor's names)."""
        return self._checkpointing.step_stats()

    # ------------------------------------------------------------------ state dicts and files (state.py)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's whole state dict, at every stage and checkpoint format (a collective: call it on every
        rank). Only Lightning's own checkpoint dump of a sharded save gets ``{}`` (Note [state dicts for the
        strategy's own save] in state.py)."""
        return self._checkpointing.lightning_module_state_dict(self.settings, super().lightning_module_state_dict,
                                                               called_by_checkpoint_dump())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpointing.optimizer_state(self.settings, optimizer, called_by_checkpoint_dump())

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpointing.load_optimizer_state_dict(checkpoint, super().load_optimizer_state_dict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._checkpointing.save_checkpoint(self.settings, checkpoint, filepath, storage_options,
                                            super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpointing.remove_checkpoint(filepath, super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpointing.load_checkpoint(self.settings, checkpoint_path, weights_only,
                                                   super().load_checkpoint)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self._checkpointing.restore_checkpoint_after_setup(self.settings)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpointing.load_model_state_dict(checkpoint, strict, super().load_model_state_dict)

    # ------------------------------------------------------------------ plugins and setup
    @property  # type: ignore[override]
    def precision_plugin(self) -> ZeroPrecision:
        return to_zero_precision(self._precision_plugin)  # the Trainer's plugin converted where it is a stock one

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if getattr(self, "_fixed_precision", False) and plugin is not None and not isinstance(plugin, ZeroPrecision):
            return  # the strategy's own precision wins over the Trainer's default
        self._precision_plugin = to_zero_precision(plugin) if plugin is not None else None

    @override
    def setup_environment(self) -> None:
        if self.num_nodes * self.num_processes > 1 or dist.is_initialized():
            return super().setup_environment()
        assert self.accelerator is not None  # one rank: no process group at all, so nothing is ever communicated
        self.accelerator.setup_device(self.root_device)
        self.set_world_ranks()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._steps.check_train_start(self.lightning_module.trainer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        # the expert size the module's MoE layers ask for, when the strategy sets none (Note [expert parallel in
        # the strategy]): this setup's tree; the strategy's own stays as it was given
        settings = expert_settings(self.settings, self.lightning_module, KEYWORDS)
        self._run.open_mesh(settings)
        self._hang = add_hang_watchdog(trainer, settings.zero.hang_timeout_s)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            add_monitor(trainer, self.monitor, self.profiler)
        self._run.setup(
            self.lightning_module, settings, self.precision_plugin, self.root_device,
            make_optimizer=(lambda: self._the_optimizer(trainer)) if fitting else None,
            agreed=setup_settings(settings, self.precision_plugin, self.resolved_config, trainer),
            param_init_fn=self.param_init_fn,
        )
        if fitting:
            self._steps.start_fit(trainer, self.optimizers[0])
        self.setup_precision_plugin()

    def _the_optimizer(self, trainer: pl.Trainer) -> Optimizer:
        """Lightning's ``configure_optimizers``, refused unless it makes exactly one optimizer."""
        self.setup_optimizers(trainer)
        return only_optimizer(self.optimizers)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with sharded_build_context(self.settings.zero, self.settings.parallel.pipeline):
            yield

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # never wrapped: the engine's hooks do what DDP's wrapper would

    # ------------------------------------------------------------------ steps (their part: steps.py)
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.training_step(super().training_step, *args, **kwargs)

    @override
    def barrier(self, name: str | None = None) -> None:
        with self._collectives.barrier(name):
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._collectives.broadcast():
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
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
        return self._steps.sampler_kwargs(self.settings.parallel) or super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self._steps.process_dataloader(dataloader)

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
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        failed = trainer is None or trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            self._run.release(module, self.optimizers, self.precision_plugin, failed, self.gather_on_teardown)
            if hidden_from_teardown(module):  # Lightning's teardown moves the module: nothing of it exists to move
                self._lightning_module = None
            super().teardown()
        except Exception as err:  # after a failed run, its error (Lightning re-raises it next) is the one to see
            if not failed:
                raise
            log.warning(f"ZeroStrategy.teardown after the error also failed: {err!r}")
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_zero_strategies(cls, strategy_registry)
