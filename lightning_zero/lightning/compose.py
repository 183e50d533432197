"""The one composition function: every parallelism and wrapper applied to the module, in a fixed order.

``ZeroStrategy.setup`` builds the process mesh, then calls :func:`apply_parallelisms`; each step
below states why it comes where it does (as torchtitan's ``parallelize_*`` functions do): precision, the
pipeline split, tensor parallel, sequence parallel, then ZeRO (coupled to the other pipeline stages and TP
ranks by :func:`model_parallel_coupling`); :func:`release_parallelisms` undoes it. What is composed is
chosen at construction: :func:`strategy_options` checks ``ZeroStrategy``'s arguments, before any process
starts, into one typed :class:`StrategyOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.mesh import Axis, ProcessMesh
from lightning_zero.core.offload.config import OffloadConfig, offload_from_args
from lightning_zero.core.precision.loss_scaler import LossScalerConfig
from lightning_zero.core.stage3.materialize import ParamInitFn, has_meta_parameters, replace_meta_parameters
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.teardown import plan_teardown
from lightning_zero.core.zero.config import ZeroConfig
from lightning_zero.core.zero.engine import StageCoupling, ZeroEngine
from lightning_zero.core.zero.engine_step import weighted_norm_excess
from lightning_zero.lightning.precision import ZeroPrecision, strategy_precision
from lightning_zero.moe.config import ExpertParallelConfig
from lightning_zero.moe.lightning import StrategyExpertParallel, check_expert_parallel
from lightning_zero.observability.monitoring import ProfilerWindow
from lightning_zero.pipeline.config import PipelineConfig
from lightning_zero.pipeline.lightning import StrategyPipeline
from lightning_zero.sequence_parallel.checks import check_sequence_parallel
from lightning_zero.sequence_parallel.lightning import StrategySequenceParallel
from lightning_zero.tensor_parallel.config import TensorParallelConfig
from lightning_zero.tensor_parallel.lightning import StrategyTensorParallel


@dataclass(frozen=True)
class ParallelPlan:
    """What the strategy applies: the ZeRO and offload policies, the pipeline (``None``: no split), and how
    parameters built on the meta device are initialised (``param_init_fn``; the base seed is
    ``torch.initial_seed()`` where each step initialises, rank 0's everywhere)."""

    zero: ZeroConfig
    offload: OffloadConfig
    pipeline: PipelineConfig | None = None
    param_init_fn: ParamInitFn | None = None
    tensor_parallel: StrategyTensorParallel | None = None
    sequence_parallel: StrategySequenceParallel | None = None
    expert_parallel: StrategyExpertParallel | None = None


@dataclass(frozen=True)
class StrategyOptions:
    """``ZeroStrategy``'s constructor arguments as the typed settings it keeps (one attribute of the same name
    each), checked by :func:`strategy_options` before any process starts.

    Args:
        zero_config: the ZeRO settings (``config``, or ``stage`` and the ``ZeroConfig`` keywords).
        offload: where shards live (``offload``, or the three shortcuts), checked against the stage.
        tensor_parallel: the tensor-parallel size and plan (size 1: off).
        sequence_parallel: ranks per sequence group (1: off).
        expert_parallel: the expert-parallel size (``None``: the MoE layers' ``ep_size``, else off).
        pipeline_config: the pipeline (``None``: no split; a one-stage pipeline is none).
        precision_plugin: the strategy's own precision (``None``: the Trainer's, converted at setup).
        checkpoint_format: ``"auto"``, ``"sharded"`` or ``"consolidated"``.
        monitor: whether a fit adds a ``ZeroStatsMonitor``.
        profiler: the monitor's profiler window (``None``: none).
    """

    zero_config: ZeroConfig
    offload: OffloadConfig
    tensor_parallel: TensorParallelConfig
    sequence_parallel: int
    expert_parallel: ExpertParallelConfig | None
    pipeline_config: PipelineConfig | None
    precision_plugin: Precision | None
    checkpoint_format: str
    monitor: bool
    profiler: ProfilerWindow | None


def strategy_options(
    stage: int,
    zero_options: dict[str, Any],
    *,
    config: ZeroConfig | None,
    precision: str | ZeroPrecision | None,
    loss_scaler: LossScalerConfig | None,
    precision_plugin: Precision | None,
    checkpoint_format: str,
    monitor: bool,
    profiler: ProfilerWindow | bool | None,
    pipeline: PipelineConfig | None,
    offload: OffloadConfig | None,
    offload_optimizer: str | None,
    offload_param: str | None,
    nvme_path: str | None,
    tensor_parallel: int | TensorParallelConfig | None,
    sequence_parallel: int,
    expert_parallel: int | ExpertParallelConfig | None = None,
) -> StrategyOptions:
    """Check ``ZeroStrategy``'s arguments (each as its constructor documents it) and resolve them into
    :class:`StrategyOptions`; bad input is refused here, before any process starts, with the fix in the error.
    The combinations of parallel sizes not built are refused with the reason (tensor parallel composes with
    pipelines and offload)."""
    zero = config or ZeroConfig.from_kwargs(stage, zero_options)
    where = offload_from_args(offload, offload_optimizer, offload_param, nvme_path)
    where.check(zero.stage)
    where.check_path()
    tensor = TensorParallelConfig.coerce(tensor_parallel)
    check_sequence_parallel(
        sequence_parallel, pipeline=pipeline.stages if pipeline is not None else 1, tensor=tensor.size
    )
    experts = ExpertParallelConfig.coerce(expert_parallel)
    check_expert_parallel(experts, pipeline=pipeline.stages if pipeline is not None else 1, tensor=tensor.size,
                          sequence=sequence_parallel)
    plugin = strategy_precision(precision, loss_scaler, precision_plugin)
    if checkpoint_format not in ("auto", "sharded", "consolidated"):
        raise ValueError(f"checkpoint_format must be 'auto', 'sharded' or 'consolidated', got {checkpoint_format!r}.")
    if profiler and not monitor:
        raise ValueError("`profiler` runs inside the monitor: drop `monitor=False`, or the profiler.")
    return StrategyOptions(
        zero_config=zero,
        offload=where,
        tensor_parallel=tensor,
        sequence_parallel=sequence_parallel,
        expert_parallel=experts,
        pipeline_config=pipeline if pipeline is not None and pipeline.stages > 1 else None,
        precision_plugin=plugin,
        checkpoint_format=checkpoint_format,
        monitor=monitor,
        profiler=ProfilerWindow() if profiler is True else (profiler or None),
    )


def only_optimizer(optimizers: list[Optimizer]) -> Optimizer:
    """The one optimizer of Lightning's ``configure_optimizers``, refused unless it made exactly one (ZeRO shards
    one optimizer's state)."""
    if len(optimizers) != 1:
        raise NotImplementedError(
            f"ZeroStrategy supports exactly one optimizer, got {len(optimizers)}. Put several "
            "parameter sets in param groups of one optimizer."
        )
    return optimizers[0]


@dataclass(frozen=True)
class Composed:
    """What :func:`apply_parallelisms` made: this rank's pipeline stage (``None`` unpipelined), the ZeRO engine
    (``None`` when neither fitting nor evaluating a model built sharded), and whether the model was built on
    the meta device for stage 3 (``built_sharded``: it exists only as shards until teardown)."""

    pipeline: StrategyPipeline | None
    engine: ZeroEngine | None
    built_sharded: bool


def apply_parallelisms(
    module: pl.LightningModule,
    mesh: ProcessMesh,
    comm: DataParallelComm,
    plan: ParallelPlan,
    precision: ZeroPrecision,
    device: torch.device,
    make_optimizer: Callable[[], Optimizer] | None,
    setup_settings: Mapping[str, str],
) -> Composed:
    """Apply precision, the pipeline split, tensor parallel, sequence parallel, ZeRO (with stage 3 and offload)
    and the precision wiring to ``module``, in that order (the comment beside each step says why).

    Args:
        module: the LightningModule, converted and split in place.
        mesh: the strategy's process mesh (its groups are made once per strategy).
        comm: ZeRO's collectives over ``mesh.group(*mesh.dims.zero_axes)``.
        plan: what to apply.
        precision: the strategy's precision plugin.
        device: this rank's device.
        make_optimizer: fitting: makes the one optimizer (Lightning's ``configure_optimizers``); ``None`` when
            evaluating.
        setup_settings: settings that must agree on every rank (checked with the model's structure).
    """
    # 1. Precision first: every later step takes the dtype the parameters have (the pipeline's placeholders,
    #    which a later cast would allocate whole; ZeRO's flat buffers); the plugin keeps the pre-cast weights
    #    the fp32 masters start from.
    precision.convert_module(module)  # in place
    # 2. The pipeline split: which layers this rank holds decides what every later step sees (the other
    #    stages' weights become storage-less placeholders; a meta-built model materialises only its layers).
    # 2a. Tensor parallel inside it, once the stage's layers exist: the plan replaces the planned layers by this
    #    rank's slices (the other stages' by storage-less slices) before anything records parameters (ZeRO's
    #    flat buffers, the optimizer); the precision plugin's pre-cast weights are sliced alike (Note [TP
    #    composition order] in tensor_parallel/lightning.py). Unpipelined, it slices the whole module here.
    tp = plan.tensor_parallel
    pipeline = None
    if plan.pipeline is not None:
        pipeline = StrategyPipeline(plan.pipeline, module, device, mesh, plan.zero.timeout_s, plan.param_init_fn,
                                    torch.initial_seed() % 2**63, slice_layers=tp.apply if tp is not None else None)
    elif tp is not None:
        tp.apply(module)
    if tp is not None:
        precision.replace_originals(tp.slice_originals)
        tp.agree_replicated(module, precision.master_init())  # TP rank 0's replicated weights, as DDP's rank 0's
        tp.agree_rng(device)  # replicated dropout masks agree across the TP group (Note [dropout streams])
    # 2b. Sequence parallel: the model takes its sequence group (its attention then runs between the all-to-alls
    #     over mesh.group(Axis.SEQUENCE)); after tensor parallel (whose heads it would split) and before ZeRO
    #     applies activation checkpointing to stage 3's units, so a recomputed forward runs the wrapper too.
    if plan.sequence_parallel is not None:
        plan.sequence_parallel.attach(module)
    # 2c. Expert parallel: each MoE layer keeps this rank's experts (their tokens travel to them through the
    #     all-to-alls over mesh.group(Axis.EXPERT)); like tensor parallel's slicing, before anything records
    #     parameters (the optimizer, ZeRO's flat buffers, which partition the experts over their expert-data
    #     group), and the precision plugin's pre-cast weights are cut alike (Note [expert parallel in the strategy]).
    experts: frozenset[torch.nn.Parameter] = frozenset()
    if plan.expert_parallel is not None:
        plan.expert_parallel.apply(module)
        precision.replace_originals(plan.expert_parallel.slice_originals)
        experts = plan.expert_parallel.experts
    # 3. A model built on the meta device (configure_model under stage 3): storage-less stand-ins that ZeRO
    #    initialises one unit at a time; before the device move, which would refuse meta tensors.
    built_sharded = pipeline is None and has_meta_parameters(module)
    if built_sharded:
        if not plan.zero.stage.shards_parameters:
            raise NotImplementedError(
                "The model has parameters on the meta device. lightning_zero initialises meta-built models only "
                "with ZeRO stage 3 (unit by unit, sharded). Use stage=3, or build the model with real tensors."
            )
        replace_meta_parameters(module, device)
    # 4. The device move, after the split (a pipeline moves only its stage's layers itself) and before the
    #    optimizer and ZeRO, which keep references to the parameters where they then are.
    if pipeline is None:
        module.to(device)
    # 5. The optimizer, once the parameters have their final dtype and device; a pipeline stage keeps only its
    #    own parameters in it and refuses what cannot run there before the engine exists.
    optimizer = make_optimizer() if make_optimizer is not None else None
    if pipeline is not None and optimizer is not None:
        pipeline.restrict_optimizer(optimizer)
        pipeline.check_engine(plan.zero)
    if plan.tensor_parallel is not None and optimizer is not None:
        plan.tensor_parallel.check_optimizer(optimizer)
    # 6. ZeRO last: it flattens and shards what the rank holds after every rewrite above (stage 3 per unit,
    #    then activation checkpointing of the units), offloads the shards, and couples its norms and overflow
    #    checks to the other pipeline stages and TP ranks (model_parallel_coupling). Outside fit it is needed
    #    only for a model that exists as shards; else the ranks start from rank 0's weights.
    engine = None
    if optimizer is not None or built_sharded:
        engine = ZeroEngine(
            pipeline.local.module if pipeline is not None else module, optimizer, plan.zero, comm,
            dtypes=precision.dtype_policy(module),
            master_init=precision.master_init() if optimizer is not None else None,
            param_init_fn=plan.param_init_fn, init_seed=torch.initial_seed() % 2**63, setup_settings=setup_settings,
            offload=plan.offload,
            coupling=model_parallel_coupling(mesh, pipeline, tp, plan.zero), experts=experts,
        )
    elif pipeline is not None:
        pipeline.broadcast_local(comm)
    else:
        _broadcast_module_states(module, comm, experts)
    # 7. The precision plugin steps, clips and unscales through the engine; the pre-cast weights of the
    #    parameters the engine now holds masters of are no longer needed.
    if optimizer is not None and engine is not None:
        precision.release_originals({s.param for g in engine.groups for s in g.slots})
        precision.bind_engine(engine)
    return Composed(pipeline, engine, built_sharded)


def model_parallel_coupling(mesh: ProcessMesh, pipeline: StrategyPipeline | None,
                            tensor: StrategyTensorParallel | None, zero: ZeroConfig) -> StageCoupling | None:
    """The engine's one :class:`StageCoupling`: the gradient norm and the fp16 overflow flag are combined over
    the ranks holding the rest of the model (``mesh.group`` along the pipeline and tensor axes that are on: one
    all-reduce after the data group's; Note [rank order]); each rank leaves out the share of a parameter that
    another holder counts too, the largest of the pipeline's (a tie another stage owns: all) and tensor
    parallel's (a replicated parameter: ``1 - 1/tp``) (Note [counting a parameter once])."""
    axes = tuple(a for a, on in ((Axis.PIPELINE, pipeline is not None and mesh.dims.pipeline_enabled),
                                 (Axis.TENSOR, tensor is not None)) if on)
    weights = [w for w in (pipeline.norm_weight if pipeline is not None else None,
                           tensor.norm_weight if tensor is not None else None) if w is not None]
    if not weights:
        return None
    comm = DataParallelComm(mesh.group(*axes), zero.collective) if axes else None
    return StageCoupling(comm, weighted_norm_excess(lambda p: max(w(p) for w in weights)))


@dataclass(frozen=True)
class Released:
    """What :func:`release_parallelisms` leaves the strategy: the last fit's stage-3 runtime (its peak counters;
    ``None``: no fit) and a pipelined fit's reason why a save after it is incomplete (``None``: none)."""

    last_runtime: Stage3Runtime | None
    pipeline_refusal: tuple[str, bool] | None


def release_parallelisms(
    module: pl.LightningModule | None,
    engine: ZeroEngine | None,
    pipeline: StrategyPipeline | None,
    sequence: StrategySequenceParallel | None,
    optimizers: list[Optimizer],
    precision: ZeroPrecision,
    failed: bool,
    gather_on_teardown: bool,
) -> Released:
    """:func:`apply_parallelisms` undone at teardown, in reverse: ZeRO gives back whole parameters (and optimizer
    state) where they fit (Note [teardown gather]), then the pipeline its unsplit module, then ``module`` loses
    its sequence group and the fit's scheduler guard and gets its dtype back. After an error (``failed``) another
    rank may be gone: no collective runs, the shard state is dropped."""
    whole_state, last_runtime, refusal = None, None, None  # whole_state: a pipeline's optimizer state of all stages
    if engine is not None:
        if engine.optimizer is not None:
            last_runtime = engine.runtime
        plan = plan_teardown(engine, failed, gather_on_teardown)
        if pipeline is not None and not failed:
            whole_state = pipeline.whole_optimizer_state(engine, plan.keep_optimizer_state)
        engine.detach(keep_optimizer_state=plan.keep_optimizer_state, gather_params=plan.gather_params)
        precision.bind_engine(None)
    if pipeline is not None:  # the unsplit module (and, after fit, optimizer) on every rank again
        why = pipeline.teardown(optimizers, whole_state, failed, gather_on_teardown)
        refusal = why if pipeline.checkpoint is not None else None
    if module is not None:
        if sequence is not None:
            sequence.detach(module)
        module.__dict__.pop("lr_scheduler_step", None)  # Note [skipped steps and schedulers] in steps.py
        precision.restore_module(module)
    return Released(last_runtime, refusal)


@torch.no_grad()
def _broadcast_module_states(module: torch.nn.Module, comm: DataParallelComm,
                             experts: frozenset[torch.nn.Parameter] = frozenset()) -> None:
    """Rank 0's parameters and buffers on every data rank; a rank's experts from its expert-data group's first rank
    (the other expert-parallel ranks hold other experts)."""
    for p in module.parameters():
        comm.of(p in experts).broadcast(p.data)
    for b in module.buffers():
        comm.broadcast(b)
