"""``DeepSpeedZeroStrategy.from_deepspeed_config``: a ZeroStrategy driven by a DeepSpeed JSON config.

Precedence (the table is in ``docs/deepspeed_config.md``): a value set only in the JSON is used;
a value set both in the JSON and elsewhere (``from_deepspeed_config`` keyword arguments, the
``Trainer``, the ``DataLoader``, ``configure_optimizers``) must be equal, else ``ValueError`` names
both. Lightning defaults count as not set: ``Trainer(accumulate_grad_batches=1)``,
``gradient_clip_val=None`` (or 0) and ``precision="32-true"``.

What the JSON decides is applied when the world size is known, in the strategy's ``setup`` (on
every rank, before any collective), and the micro-batch size is checked against the training
DataLoader once it exists (``on_train_start``). The optimizer and scheduler sections are applied
where the strategy builds the optimizers, following ``optimizer_source``:

* ``"auto"`` (default): a section is used where ``configure_optimizers`` provides nothing:
  returning ``None`` (or not defining ``configure_optimizers`` at all) takes the JSON's optimizer and
  scheduler; returning only an optimizer adds the JSON's scheduler to it. Where both give an
  optimizer they must be the same class with the same hyper-parameters (the JSON's keys compared
  with ``optimizer.defaults``); where both give a scheduler it is an error.
* ``"config"``: the JSON's sections replace what ``configure_optimizers`` returns (its optimizer is
  not even built when the JSON has one). ``lightning-zero train`` uses this: there the module's
  optimizer comes from the model group's YAML defaults.

The JSON's optimizer is built over the module's trainable parameters in one param group, as
DeepSpeed builds it over ``model.parameters()``.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities.core.apply_func import apply_to_collection
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_zero.deepspeed.batch import GAS, MICRO, TBS, ResolvedBatch
from lightning_zero.deepspeed.config import DeepSpeedConfig, parse_deepspeed_config
from lightning_zero.deepspeed.optim import optimizer_recipe
from lightning_zero.deepspeed.pipeline import pipeline_for_batch
from lightning_zero.deepspeed.report import DeepSpeedReport
from lightning_zero.deepspeed.schedulers import NEEDS_TOTAL_STEPS, build_scheduler
from lightning_zero.deepspeed.strategy_args import json_strategy_arguments, strategy_conflict
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.lightning.strategy import ZeroStrategy
from lightning_zero.parallel.mesh import parallel_dims
from lightning_zero.sparse_attention import SparseSelfAttention, make_sparsity_config

OptimizerSource = Literal["auto", "config"]


def _no_optimizer(module: pl.LightningModule) -> None:
    """Installed as ``configure_optimizers`` on a module without one: the JSON's optimizer is used."""
    return None


class DeepSpeedZeroStrategy(ZeroStrategy):
    """A :class:`ZeroStrategy` that also applies a DeepSpeed config's batch, clipping, optimizer and
    scheduler settings (built by :meth:`from_deepspeed_config`)."""

    def __init__(self, *args: Any, deepspeed_config: DeepSpeedConfig, optimizer_source: OptimizerSource = "auto",
                 pipeline_from_json: bool = False, **kwargs: Any) -> None:
        self.deepspeed_config = deepspeed_config
        self.optimizer_source = optimizer_source
        self.resolved_batch: ResolvedBatch | None = None  # set in setup(), when the world size is known
        self.pipeline_from_json = pipeline_from_json  # the JSON's pipeline section made the pipeline (it takes its GAS)
        self._trainer_precision: str | None = None  # what Trainer(precision=...) asked for
        self._patched: pl.LightningModule | None = None
        super().__init__(*args, **kwargs)

    @classmethod
    def from_deepspeed_config(cls, source: str | Path | Mapping[str, Any] | DeepSpeedConfig, /, *,
                              strict: bool = False, optimizer_source: OptimizerSource = "auto",
                              **overrides: Any) -> DeepSpeedZeroStrategy:
        """A strategy configured by a DeepSpeed JSON config (a path, a dict, or a parsed ``DeepSpeedConfig``).

        The JSON's ``zero_optimization``, ``fp16`` / ``bf16`` go into the strategy; its batch-size triple,
        ``gradient_clipping``, ``optimizer`` and ``scheduler`` are applied to the Trainer and the module at
        setup, when the world size is known. ``overrides`` are :class:`ZeroStrategy`'s keyword arguments.
        A setting given both here (or on the Trainer / DataLoader / ``configure_optimizers``) and in the
        JSON with different values raises ``ValueError`` naming both. Precedence and the supported keys:
        ``docs/deepspeed_config.md``.

        Args:
            source: the JSON file, its dict, or a parsed :class:`DeepSpeedConfig`.
            strict: unsupported JSON keys raise instead of warning.
            optimizer_source: ``"auto"`` or ``"config"`` (see the module docstring).
            **overrides: :class:`ZeroStrategy` arguments.
        """
        if optimizer_source not in ("auto", "config"):
            raise ValueError(f"optimizer_source must be 'auto' or 'config', got {optimizer_source!r}.")
        if isinstance(source, DeepSpeedConfig):
            ds = source
            if strict and ds.unsupported:
                raise ValueError(ds.unsupported_message())
        else:
            ds = parse_deepspeed_config(source, strict=strict, warn=False)
            if ds.unsupported:
                rank_zero_warn(ds.unsupported_message())
        base = overrides.get("settings")  # the Hydra route's whole tree
        callers = overrides.get("pipeline") or (base.parallel.pipeline if base is not None else None)
        return cls(deepspeed_config=ds, optimizer_source=optimizer_source, pipeline_from_json=callers is None,
                   **json_strategy_arguments(ds, overrides))

    @property  # type: ignore[override]
    def precision_plugin(self) -> ZeroPrecision:
        return ZeroStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            self._trainer_precision = str(getattr(plugin, "precision", "32-true"))
        ZeroStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]

    @override
    def connect(self, model: pl.LightningModule) -> None:
        if self.deepspeed_config.optimizer is not None and not is_overridden("configure_optimizers", model):
            model.configure_optimizers = types.MethodType(_no_optimizer, model)  # type: ignore[method-assign]
            self._patched = model
        super().connect(model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._apply_to_trainer(trainer)
        super().setup(trainer)
        if self.deepspeed_config.sparse_attention is not None:
            _check_sparse_attention(self.deepspeed_config.sparse_attention, trainer.lightning_module,
                                    str(self.deepspeed_config.source))

    def _apply_to_trainer(self, trainer: pl.Trainer) -> None:
        ds, problems = self.deepspeed_config, []
        asked = self._trainer_precision
        if ds.precision is not None and asked not in (None, "32-true", "32", ds.precision):
            problems.append(strategy_conflict(ds, "precision.name", ds.precision, "Trainer(precision)", asked) +
                            " (Lightning turns precision='16-mixed' into 'bf16-mixed' on CPU: leave the Trainer's "
                            "precision unset when the DeepSpeed config chooses it.)")
        pipe = self.pipeline_config
        try:  # pipelined: over the data-parallel ranks of a stage (Note [DeepSpeed pipeline batches])
            # ... and over data only with sequence / tensor parallel: such a group shares its samples
            self.resolved_batch = ds.batch.resolve(parallel_dims(self.world_size, self.settings.parallel).data)
        except ValueError as err:
            raise ValueError(f"DeepSpeed config {ds.source}: {err}") from err
        manual = not self.lightning_module.automatic_optimization
        batch = self.resolved_batch
        if batch is not None and pipe is not None:  # GAS are the pipeline's micro-batches: nothing to accumulate
            if ds.batch.gives_accumulation:  # this strategy's settings tree, with the batch's pipeline
                pipeline = pipeline_for_batch(pipe, batch, self.pipeline_from_json, ds.source)
                self.settings = replace(self.settings, parallel=replace(self.settings.parallel, pipeline=pipeline))
            if trainer.accumulate_grad_batches != 1:
                problems.append(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with a pipeline "
                                f"and the DeepSpeed config {ds.source}: its {GAS} are the pipeline's micro-batches.")
        elif batch is not None:
            acc = trainer.accumulate_grad_batches
            if acc != 1 and acc != batch.accumulation_steps:
                problems.append(f"the DeepSpeed config {ds.source} gives {GAS}={batch.accumulation_steps} "
                                f"({_batch_text(batch)}), but Trainer(accumulate_grad_batches={acc}). Set it in one "
                                "place (or to the same value).")
            elif manual and batch.accumulation_steps > 1:
                problems.append(f"{GAS}={batch.accumulation_steps} with manual optimization: Lightning does not "
                                "accumulate for manual optimization. Accumulate in training_step and drop the key.")
            else:
                trainer.accumulate_grad_batches = batch.accumulation_steps
        if ds.gradient_clipping:
            clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
            if clip and float(clip) != ds.gradient_clipping:
                problems.append(strategy_conflict(ds, "trainer.gradient_clip_val", ds.gradient_clipping,
                                          "Trainer(gradient_clip_val)", clip))
            elif algorithm == GradClipAlgorithmType.VALUE:
                problems.append(f"the DeepSpeed config {ds.source} clips by global norm (gradient_clipping="
                                f"{ds.gradient_clipping}), but Trainer(gradient_clip_algorithm='value').")
            elif manual:
                problems.append("gradient_clipping with manual optimization: call self.clip_gradients(...) in "
                                "training_step and drop the key.")
            else:
                trainer.gradient_clip_val = ds.gradient_clipping
                trainer.gradient_clip_algorithm = GradClipAlgorithmType.NORM
        if problems:
            raise ValueError("conflicting settings:\n  - " + "\n  - ".join(problems))
        if (ds.steps_per_print or ds.wall_clock_breakdown) and not any(
                isinstance(c, DeepSpeedReport) for c in trainer.callbacks):
            trainer.callbacks.append(DeepSpeedReport(ds.steps_per_print or 10, ds.wall_clock_breakdown))

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self.optimizers, self.lr_scheduler_configs = configure_optimizers(self, trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        batch = self.resolved_batch
        if batch is None or self.lightning_module is None:
            return
        found: list[DataLoader] = []
        apply_to_collection(self.lightning_module.trainer.train_dataloader, DataLoader, found.append)
        pipe = self.pipeline_config  # pipelined: one batch of all micro-batches per step
        wanted = batch.micro_batch_size * (pipe.micro_batches if pipe is not None else 1)
        for loader in found:
            size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
            if size is not None and size != wanted:
                raise ValueError(
                    f"the training DataLoader's batch_size={size}, but the DeepSpeed config "
                    f"{self.deepspeed_config.source} gives {MICRO}={batch.micro_batch_size} ({_batch_text(batch)})"
                    f"{f' x {pipe.micro_batches} pipeline micro-batches' if pipe is not None else ''}. "
                    f"Fix: DataLoader(batch_size={wanted}), or change the config.")

    @override
    def teardown(self) -> None:
        if self._patched is not None:
            self._patched.__dict__.pop("configure_optimizers", None)
            self._patched = None
        super().teardown()


def _check_sparse_attention(section: Mapping[str, Any], module: pl.LightningModule, source: str) -> None:
    """An accepted ``sparse_attention`` section must be what the model runs (docs/sparse_attention.md): the model
    has sparse attention (a pipeline stage's blocks keep their attention modules), and each one's layout is the
    one the section makes for its heads."""
    layers = [m for m in module.modules() if isinstance(m, SparseSelfAttention)]
    if not layers:
        raise ValueError(
            f"the DeepSpeed config {source} has a `sparse_attention` section, but {type(module).__name__} has no "
            "sparse attention: build the model with it (GPTConfig(sparse_attention=...), or SparseAttentionUtils."
            "replace_model_self_attention_with_sparse_self_attention), or drop the section")
    for layer in layers:
        expected = make_sparsity_config(section, layer.sparsity_config.num_heads)
        actual = layer.sparsity_config  # (a TP or sequence-parallel rank's copy narrows the heads: not compared)
        keys = set(vars(expected)) - {"num_heads", "num_layout_heads"}
        if type(expected) is not type(actual) or any(getattr(actual, k, None) != getattr(expected, k) for k in keys):
            raise ValueError(
                f"the DeepSpeed config {source}'s `sparse_attention` section ({dict(section)}) is not the sparse "
                f"attention {type(module).__name__} was built with ({type(layer.sparsity_config).__name__}"
                f"{vars(layer.sparsity_config)}): build the model from the section (the CLI does), or make the "
                "two agree")


def _batch_text(batch: ResolvedBatch) -> str:
    return (f"{TBS}={batch.train_batch_size} = {MICRO}={batch.micro_batch_size} x {GAS}={batch.accumulation_steps}"
            f" x {batch.world_size} data-parallel rank(s)")


def _total_steps(trainer: pl.Trainer) -> int | None:
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    estimated = trainer.estimated_stepping_batches
    return int(estimated) if estimated != float("inf") else None


def configure_optimizers(strategy: DeepSpeedZeroStrategy,
                         trainer: pl.Trainer) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """The strategy's optimizers and LR scheduler configs: ``configure_optimizers`` merged with the JSON."""
    ds, module = strategy.deepspeed_config, strategy.lightning_module
    assert module is not None

    def json_optimizer() -> Optimizer:
        assert ds.optimizer is not None
        return optimizer_recipe(ds.optimizer.type, ds.optimizer.params).build(
            p for p in module.parameters() if p.requires_grad)

    def json_schedulers(optimizer: Optimizer) -> list[LRSchedulerConfig]:
        if ds.scheduler is None:
            return []
        total = _total_steps(trainer) if ds.scheduler.type in NEEDS_TOTAL_STEPS else None
        scheduler = build_scheduler(ds.scheduler.type, ds.scheduler.params, optimizer, total)
        return [LRSchedulerConfig(scheduler=scheduler, interval="step")]

    if strategy.optimizer_source == "config" and ds.optimizer is not None:
        optimizer = json_optimizer()
        return [optimizer], json_schedulers(optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*configure_optimizers` returned `None`")
        optimizers, configs = _init_optimizers_and_lr_schedulers(module)
    if len(optimizers) == 1 and isinstance(optimizers[0], _MockOptimizer):
        if ds.optimizer is None:
            raise ValueError(f"configure_optimizers returned None and the DeepSpeed config {ds.source} has no "
                             "`optimizer` section: nothing to train with. Add one of them.")
        optimizer = json_optimizer()
        return [optimizer], json_schedulers(optimizer)
    if ds.optimizer is None and ds.scheduler is None:
        return optimizers, configs
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers; the DeepSpeed config's "
                         "optimizer/scheduler sections apply to one optimizer.")
    if ds.optimizer is not None:
        recipe = optimizer_recipe(ds.optimizer.type, ds.optimizer.params)
        diff = recipe.differences(optimizers[0])
        if diff:
            raise ValueError(
                f"the DeepSpeed config {ds.source} sets optimizer {recipe.describe()}, but configure_optimizers "
                f"returned {type(optimizers[0]).__name__} ({'; '.join(diff)}). Set it in one place: return None "
                "from configure_optimizers, remove the `optimizer` section, or pass optimizer_source='config'.")
    if ds.scheduler is not None:
        if configs and strategy.optimizer_source == "auto":
            raise ValueError(
                f"both the DeepSpeed config {ds.source} (scheduler {ds.scheduler.type}) and configure_optimizers "
                f"({type(configs[0].scheduler).__name__}) define an LR scheduler. Set it in one place, or pass "
                "optimizer_source='config' to use the config's.")
        configs = json_schedulers(optimizers[0])
    return optimizers, configs
