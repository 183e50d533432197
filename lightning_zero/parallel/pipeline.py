"""The pipeline applied to a module (:func:`apply`), and what the strategy calls of it (:class:`StrategyPipeline`).

``parallelize`` (``parallelize.py``) applies it: this rank's stage (its groups from the strategy's one mesh, its
chunks, the schedules), tensor parallelism applied to the stage once its layers exist (``tensor.apply``, as
torchtitan's pipeline parallelizes each stage); the engine then partitions only the local chunks over the stage's
data-parallel group, and its constructor takes the coupling ``parallelize.py`` makes of the stage's
:meth:`StrategyPipeline.norm_weight` (and tensor parallel's) over the model-parallel group.
``training_step`` / evaluation steps run the schedules instead of the module's step methods and log
``<stage>_loss`` (or call the module's ``on_pipeline_loss(stage, loss, batch)`` when it has one); while a
``ZeroStatsMonitor`` runs, ``train_loss`` goes to ``callback_metrics`` only (the monitor logs the loss).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.mesh import ProcessMesh
from lightning_zero.core.mesh.dims import Axis
from lightning_zero.core.settings.pipeline import PipelineConfig, short_last_batch
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.loading import load_full_state_dict
from lightning_zero.observability.callbacks import ZeroStatsMonitor
from lightning_zero.parallel.tensor import StrategyTensorParallel, apply_tensor_parallel
from lightning_zero.pipeline.build import materialize_local, prepare_meta_module
from lightning_zero.pipeline.checkpoint import PipelineCheckpoint
from lightning_zero.pipeline.mesh import PipelineGroups, pipeline_groups
from lightning_zero.pipeline.model import LocalModel, hold_stage, reassemble, split_batch, split_module
from lightning_zero.pipeline.runner import PipelineRunner


class StrategyPipeline:
    """This rank's pipeline: groups, local chunks and runner.

    Args:
        config: the pipeline policy.
        module: the LightningModule (split in place: the other stages' weights become placeholders).
        device: this rank's device.
        mesh: the strategy's process mesh (pipeline x data), with its ZeRO and pipeline groups (and, made here,
            the groups of tied parameters).
        init_fn: ``param_init_fn`` of a module built on the meta device (``configure_model``): only
            this rank's layers are materialised (Note [local construction] in ``pipeline/build.py``).
        init_seed: the base seed of that initialisation (rank 0's is used everywhere).
        settings: the run's settings (its tensor parallelism is applied to ``module`` once this rank's layers
            exist, Note [TP composition order] in ``parallel/tensor.py``: ``tensor``; what the rank runs is read
            from the layers after it, Note [split once] in ``pipeline/model.py``).
        previous_tensor: the last setup's tensor parallelism (``apply_tensor_parallel``).
    """

    def __init__(self, config: PipelineConfig, module: pl.LightningModule, device: torch.device,
                 mesh: ProcessMesh, init_fn: ParamInitFn | None = None, init_seed: int = 0,
                 settings: Settings | None = None, previous_tensor: StrategyTensorParallel | None = None) -> None:
        if mesh.dims.pipeline != config.stages:
            raise ValueError(f"the process mesh has {mesh.dims.pipeline} pipeline stages, the PipelineConfig "
                             f"{config.stages}: build the mesh from ParallelDims(world, pipeline=config.stages)")
        self.config = config
        if config.stages > 1 and not dist.is_initialized():
            raise RuntimeError("A pipeline with stages > 1 needs one process per stage: devices x num_nodes >= stages.")
        self.built_on_meta = prepare_meta_module(module, torch.device("cpu"))  # configure_model: nothing real yet
        plan = hold_stage(module, config, mesh.index(Axis.PIPELINE))  # the protocol and layer count checked here
        self.tie_sets = plan.tie_sets
        self.groups: PipelineGroups = pipeline_groups(mesh, plan.tie_sets)  # the ties' groups: the mesh's
        if self.built_on_meta:
            seed = torch.tensor([init_seed], dtype=torch.int64)
            if dist.is_initialized():
                dist.broadcast(seed, src=0)  # every stage initialises its layers from the same base seed
            materialize_local(module, set(plan.local), init_fn, int(seed))
        # tensor parallelism on this stage: its layers by their slices, the others' by placeholders of them
        self.tensor = apply_tensor_parallel(module, mesh, settings, previous_tensor) if settings is not None else None
        # what this rank runs, read from the layers as the plan left them (Note [split once] in pipeline/model.py)
        self.local: LocalModel = split_module(module, config, config.activation_checkpoint_interval, plan)
        self.local.module.to(device)
        self.runner = PipelineRunner(config, self.local, self.groups, module.pipeline_loss, device)  # type: ignore[arg-type]
        self.checkpoint: PipelineCheckpoint | None = None  # set by restrict_optimizer (fit)

    # ------------------------------------------------------------------ setup
    def check_train_loader(self, trainer: pl.Trainer) -> None:
        """Before the first training step, on every rank: refuse a train DataLoader whose batch size, or
        whose short last batch (``drop_last=False``), does not split into ``micro_batches`` (what cannot be
        read from the loader, a custom batch sampler's, is checked at each step instead)."""
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            return
        batches = loader.batch_sampler
        size = loader.batch_size if loader.batch_size is not None else getattr(batches, "batch_size", None)
        if not isinstance(size, int):
            return
        self.config.check_batch(size)
        self.runner.full_batch_size = size
        try:
            samples, per_epoch = len(getattr(batches, "sampler", ())), len(loader)
        except TypeError:  # an iterable data set: no length
            return
        steps = trainer.max_steps * trainer.accumulate_grad_batches if trainer.max_steps >= 0 else float("inf")
        if min(trainer.num_training_batches, steps) < per_epoch or not samples:  # the last batch is never drawn
            return
        problem = short_last_batch(samples, size, bool(getattr(batches, "drop_last", loader.drop_last)),
                                   self.config.micro_batches)
        if problem is not None:
            raise ValueError(problem)

    def restrict_optimizer(self, optimizer: Optimizer) -> None:
        """Drop the other stages' (placeholder) parameters from the optimizer's param groups."""
        local = set(self.local.names)
        original = [list(g["params"]) for g in optimizer.param_groups]
        self.checkpoint = PipelineCheckpoint(self.local, self.groups, original)
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p in local]

    def check_engine(self) -> None:
        """Before the engine is built, on every rank: refuse a per-micro-batch reduction that cannot run with this
        model (its ZeRO stage is a rule of the settings: ``core/settings/rules.py``)."""
        if self.config.reduce_per_micro_batch and self.tie_sets:
            raise ValueError("PipelineConfig(reduce_per_micro_batch=True) with parameters tied across pipeline stages "
                             f"(stages {self.tie_sets}): their gradients are summed over the stages once per step. "
                             "Fix: untie them (e.g. GPT tie_weights=False), or reduce_per_micro_batch=False.")

    def norm_weight(self, param: nn.Parameter) -> float:
        """The share of ``param``'s gradient-norm terms this stage leaves out (a tie another stage owns)."""
        return self.runner.norm_weight(param)

    @torch.no_grad()
    def broadcast_local(self, comm: DataParallelComm) -> None:
        """Outside fit: make the local chunks identical over the data-parallel group."""
        for t in (*self.local.module.parameters(), *self.local.module.buffers()):
            comm.broadcast(t.data)

    def reassemble(self) -> None:
        """After fit: every rank gets the other stages' trained parameters back (a collective)."""
        if self.config.stages == 1:
            return

        def broadcast(t: Tensor, stage: int) -> None:
            dist.broadcast(t, src=self.groups.peer(stage), group=self.groups.pp)

        # the owners' dtypes: after a mixed-precision fit the engine leaves its parameters in the original
        # dtype, while the other stages' placeholders kept the converted one
        owned = {self.local.unsplit[p]: p.dtype for p in self.local.names
                 if self.local.owner_stage[p] == self.groups.stage}
        parts: list[Any] = [None] * self.config.stages
        dist.all_gather_object(parts, owned, group=self.groups.pp)
        dtypes = {name: dtype for part in parts for name, dtype in part.items()}
        reassemble(self.local, broadcast, lambda p: dtypes[self.local.unsplit[p]])

    @torch.no_grad()
    def load_local_state_dict(self, module: pl.LightningModule, engine: ZeroEngine | None,
                              state: Mapping[str, Tensor], strict: bool) -> None:
        """After setup (a module built on the meta device): this stage's layers from an unsplit state
        dict (a pipelined or unpipelined checkpoint), read by their unsplit names."""
        unsplit = {id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())}
        local = {name: state[unsplit[id(t)]] for name, t in self.local.module.state_dict(keep_vars=True).items()
                 if unsplit[id(t)] in state}
        missing = [unsplit[id(t)] for name, t in self.local.module.state_dict(keep_vars=True).items()
                   if name not in local]
        if strict and missing:
            raise ValueError(f"The checkpoint lacks {missing[:5]} of this pipeline stage's layers. Resume from a "
                             "checkpoint of the same model, or load weights with `strict=False`.")
        if engine is not None:
            load_full_state_dict(engine, local, strict=False)
        else:
            self.local.module.load_state_dict(local, strict=False)

    def whole_optimizer_state(self, engine: ZeroEngine, fits: bool) -> dict[str, Any] | None:
        """At the end of a successful fit, before the engine detaches: every stage's optimizer state,
        numbered as the unsplit optimizer numbers it, on every rank (a collective over the world).

        Args:
            engine: this stage's engine.
            fits: this rank may keep the whole optimizer state (``plan_teardown``, agreed over its
                data-parallel group); the stages agree too, else every rank gets ``None``.
        """
        if self.checkpoint is None:  # not a fit
            return None
        if self.config.stages > 1:
            agreed = torch.tensor([int(fits)], device=self.runner.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.groups.pp)
            fits = bool(agreed.item())
        return self.checkpoint.optimizer_state(engine) if fits else None

    def teardown(self, optimizers: list[Optimizer], whole_state: dict[str, Any] | None, failed: bool,
                 gather: bool) -> tuple[str, bool] | None:
        """After fit / evaluation: the other stages' parameters back on every rank and, after fit, the
        optimizer's param groups and state of the unsplit model (``whole_state``), so that
        ``trainer.save_checkpoint`` after fit writes what a save during fit writes.

        Args:
            optimizers: the strategy's optimizers.
            whole_state: :meth:`whole_optimizer_state` (``None``: it was not gathered).
            failed: the run failed (no collective is safe).
            gather: ``ZeroStrategy(gather_on_teardown)``.

        Returns:
            After fit, when a checkpoint saved now would be incomplete: why, and whether a weights-only
            save is still complete; else ``None``.
        """
        if not failed and gather:
            self.reassemble()  # the whole (trained) module on every rank again
            if self.checkpoint is not None:
                for optimizer in optimizers:
                    for group, params in zip(optimizer.param_groups, self.checkpoint.original_groups):
                        group["params"] = list(params)
                    if whole_state is not None:
                        optimizer.load_state_dict(whole_state)
        if self.checkpoint is None or (whole_state is not None and not failed and gather):
            return None
        if failed or not gather:
            return ("the pipelined fit " + ("failed" if failed else "ran with gather_on_teardown=False") + ", so "
                    "each rank holds only its own stage's parameters and optimizer state", False)
        return ("the pipelined fit's whole optimizer state did not fit in memory to be gathered at its end "
                "(the parameters did: `save_checkpoint(path, weights_only=True)` is complete)", True)

    # ------------------------------------------------------------------ steps
    def training_step(self, module: pl.LightningModule, engine: ZeroEngine, loss_scale: float, batch: Any,
                      accumulate: int = 1) -> Tensor:
        """Forward and backward of every micro-batch (gradients kept for :meth:`backward`); the batch-mean loss.

        Args:
            module: the LightningModule (its ``pipeline_batch`` / ``on_pipeline_loss``).
            engine: the ZeRO engine of this rank's stage.
            loss_scale: the fp16 loss scale (1.0 without one).
            batch: this data-parallel rank's batch.
            accumulate: ``Trainer(accumulate_grad_batches)``: the gradients are divided by it, as Lightning
                divides the loss of an unpipelined step (Note [loss scaling in the schedule] in runner.py).
        """
        inputs, target = split_batch(module, batch)
        self.runner.loss_factor = loss_scale / accumulate
        if self.config.reduce_per_micro_batch:
            loss = self._train_reducing_each_micro_batch(engine, inputs, target)
        else:
            with engine.deferred_reduction():
                loss = self.runner.train_step(inputs, target)
        self._report(module, "train", loss, batch, inputs)
        return loss

    def _train_reducing_each_micro_batch(self, engine: ZeroEngine, inputs: Any, target: Any) -> Tensor:
        """``reduce_per_micro_batch``: every micro-batch's backward is a backward of its own for the engine
        (its hooks reduce-scatter into the shards as the gradients arrive); stage 3 still gathers once."""
        runtime = engine.runtime
        if runtime is not None:
            runtime.hold_all()
        self.runner.around_backward = (engine.before_backward, engine.finish_backward)
        try:
            loss = self.runner.train_step(inputs, target)
        finally:
            self.runner.around_backward = None
            if runtime is not None:
                runtime.release_held()
        # the shards hold the step's gradients: Lightning's zero_grad, which runs before its backward, leaves
        # them alone while the engine's reduction is marked deferred (cleared in backward, nothing reduced then)
        engine.reducer.defer()
        return loss

    def backward(self, engine: ZeroEngine) -> None:
        """Where Lightning calls backward: sum tied gradients over stages, then reduce once over the
        data-parallel group (Note [deferred reduction] in core/zero/engine.py); with
        ``reduce_per_micro_batch`` everything was reduced during the schedule."""
        if self.config.reduce_per_micro_batch:
            engine.reducer.end_window()
            engine.link_master_grads()  # Lightning's zero_grad unlinked them from the reduced shards
            return
        self.runner.sync_tied_grads(engine.groups, engine.reducer.flat_grads, boundary=engine.reducer.sync)
        engine.reduce_deferred()

    def evaluation_step(self, module: pl.LightningModule, engine: ZeroEngine | None, stage: str, batch: Any) -> Any:
        """Forward-only schedule; validation / test return (and log) the loss, predict the output."""
        inputs, target = split_batch(module, batch) if stage != "predict" else (batch, None)
        if isinstance(inputs, (list, tuple)) and stage == "predict":
            inputs = inputs[0]
        runtime = engine.runtime if engine is not None else None
        if runtime is not None:
            runtime.hold_all()
        try:
            loss, output = self.runner.eval_step(inputs, target)
        finally:
            if runtime is not None:
                runtime.release_held()
        if stage == "predict":
            return output
        assert loss is not None
        self._report(module, stage, loss, batch, inputs)
        return loss

    @staticmethod
    def _report(module: pl.LightningModule, stage: str, loss: Tensor, batch: Any, inputs: Any) -> None:
        hook = getattr(module, "on_pipeline_loss", None)
        if callable(hook):
            hook(stage, loss, batch)
            return
        size = (inputs[0] if isinstance(inputs, (list, tuple)) else inputs).shape[0]
        # a ZeroStatsMonitor logs and shows the training loss already (`train/loss`, the bar's `loss`): then
        # `train_loss` goes to callback_metrics only, so the console and the dashboard show one training loss
        trainer = module._trainer
        shown = not (stage == "train" and trainer is not None
                     and any(isinstance(c, ZeroStatsMonitor) for c in trainer.callbacks))
        module.log(f"{stage}_loss", loss, prog_bar=shown, logger=shown, batch_size=size, sync_dist=stage != "train")


def apply_pipeline(module: pl.LightningModule, mesh: ProcessMesh, settings: Settings, device: torch.device,
          init_fn: ParamInitFn | None, init_seed: int,
          previous_tensor: StrategyTensorParallel | None = None) -> StrategyPipeline | None:
    """Split ``module`` into this rank's pipeline stage (``None``: ``settings`` has no pipeline), tensor parallelism
    applied to the stage (:attr:`StrategyPipeline.tensor`; see :class:`StrategyPipeline`)."""
    pipeline = settings.parallel.pipeline
    if pipeline is None:
        return None
    return StrategyPipeline(pipeline, module, device, mesh, init_fn, init_seed, settings, previous_tensor)
