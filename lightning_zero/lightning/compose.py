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

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.mesh import Axis, ProcessMesh
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.materialize import ParamInitFn, has_meta_parameters, replace_meta_parameters
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.zero.engine import StageCoupling, ZeroEngine
from lightning_zero.core.zero.engine_step import weighted_norm_excess
from lightning_zero.core.zero.teardown import plan_teardown
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.pipeline.lightning import StrategyPipeline
from lightning_zero.sequence_parallel.lightning import StrategySequenceParallel
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
        pipeline.check_engine()
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
            coupling=model_parallel_coupling(mesh, pipeline, tp, plan.zero),
        )
    elif pipeline is not None:
        pipeline.broadcast_local(comm)
    else:
        _broadcast_module_states(module, comm)
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
def _broadcast_module_states(module: torch.nn.Module, comm: DataParallelComm) -> None:
    for t in (*module.parameters(), *module.buffers()):
        comm.broadcast(t.data)
