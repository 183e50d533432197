"""The one composition: every parallelism applied to a module, in a fixed order (:func:`parallelize`), and
undone in reverse (:func:`release`).

Each parallelism is an ``apply_*`` of its own module here, on the strategy's one mesh (``mesh.py``) with the settings
tree: the pipeline (``pipeline.py``, which applies tensor parallelism to its stage), tensor parallelism
(``tensor.py``), sequence parallelism (``sequence.py``), expert parallelism (``expert.py``) and ZeRO (``zero.py``,
last). Each step below states why
it comes where it does (as torchtitan's ``parallelize_*`` functions do). What was applied is one object,
:class:`Parallelized`, which the strategy's parts read from setup to teardown and :func:`release` takes back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.stage3.materialize import ParamInitFn, has_meta_parameters, replace_meta_parameters
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.teardown import plan_teardown
from lightning_zero.parallel.expert import StrategyExpertParallel, apply_expert_parallel
from lightning_zero.parallel.mesh import StrategyMesh
from lightning_zero.parallel.pipeline import StrategyPipeline, apply_pipeline
from lightning_zero.parallel.sequence import StrategySequenceParallel, apply_sequence_parallel
from lightning_zero.parallel.tensor import StrategyTensorParallel, apply_tensor_parallel
from lightning_zero.parallel.zero import PrecisionPlugin, apply_zero


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` applied to a module: the settings it applied, the mesh it applied them on, this rank's
    pipeline stage, tensor, sequence and expert parallelism (each ``None`` when off), the ZeRO engine (``None`` when
    neither fitting nor evaluating a model built sharded), and whether the model was built on the meta device for stage
    3 (``built_sharded``: it exists only as shards until :func:`release`)."""

    settings: Settings
    mesh: StrategyMesh
    pipeline: StrategyPipeline | None
    tensor: StrategyTensorParallel | None
    sequence: StrategySequenceParallel | None
    expert: StrategyExpertParallel | None
    engine: ZeroEngine | None
    built_sharded: bool


def parallelize(
    module: pl.LightningModule,
    mesh: StrategyMesh,
    settings: Settings,
    precision: PrecisionPlugin,
    device: torch.device,
    make_optimizer: Callable[[], Optimizer] | None,
    agreed: Mapping[str, str],
    param_init_fn: ParamInitFn | None = None,
    previous_tensor: StrategyTensorParallel | None = None,
    previous_expert: StrategyExpertParallel | None = None,
) -> Parallelized:
    """Apply precision, the pipeline split, tensor parallel, sequence parallel, expert parallel, ZeRO (with stage 3
    and offload) and the precision wiring to ``module``, in that order (the comment beside each step says why).

    Args:
        module: the LightningModule, converted and split in place.
        mesh: the strategy's mesh (its groups are made once per strategy) and ZeRO's collectives.
        settings: what to apply (its expert size resolved against the module: ``expert.expert_settings``).
        precision: the strategy's precision plugin.
        device: this rank's device.
        make_optimizer: fitting: makes the one optimizer (Lightning's ``configure_optimizers``); ``None`` when
            evaluating.
        agreed: settings that must agree on every rank (checked with the model's structure).
        param_init_fn: initialises the parameters of a model built on the meta device (the base seed is
            ``torch.initial_seed()`` where each step initialises, rank 0's everywhere).
        previous_tensor, previous_expert: the last setup's tensor and expert parallelism (each knows the module it
            split already).
    """
    # 1. Precision first: every later step takes the dtype the parameters have (the pipeline's placeholders,
    #    which a later cast would allocate whole; ZeRO's flat buffers); the plugin keeps the pre-cast weights
    #    the fp32 masters start from.
    precision.convert_module(module)  # in place
    # 2. The pipeline split: which layers this rank holds decides what every later step sees (the other
    #    stages' weights become storage-less placeholders; a meta-built model materialises only its layers).
    # 2a. Tensor parallel inside it, applied by the pipeline to its stage once the stage's layers exist: the plan
    #    replaces the planned layers by this rank's slices (the other stages' by storage-less slices) before
    #    anything records parameters (ZeRO's flat buffers, the optimizer); the precision plugin's pre-cast weights
    #    are sliced alike (Note [TP composition order] in parallel/tensor.py). Unpipelined, it slices the whole
    #    module here.
    pipeline = apply_pipeline(module, mesh.mesh, settings, device, param_init_fn,
                                       torch.initial_seed() % 2**63, previous_tensor)
    tp = pipeline.tensor if pipeline is not None else apply_tensor_parallel(module, mesh.mesh, settings,
                                                                            previous_tensor)
    if tp is not None:
        precision.replace_originals(tp.slice_originals)
        tp.agree_replicated(module, precision.master_init())  # TP rank 0's replicated weights, as DDP's rank 0's
        tp.agree_rng(device)  # replicated dropout masks agree across the TP group (Note [dropout streams])
    # 2b. Sequence parallel: the model takes its sequence group (its attention then runs between the all-to-alls
    #     over mesh.group(Axis.SEQUENCE)); after tensor parallel (whose heads it would split) and before ZeRO
    #     applies activation checkpointing to stage 3's units, so a recomputed forward runs the wrapper too.
    sequence = apply_sequence_parallel(module, mesh.mesh)
    # 2c. Expert parallel: each MoE layer keeps this rank's experts (their tokens travel to them through the
    #     all-to-alls over mesh.group(Axis.EXPERT)); like tensor parallel's slicing, before anything records
    #     parameters (the optimizer, ZeRO's flat buffers, which partition the experts over their expert-data
    #     group), and the precision plugin's pre-cast weights are cut alike (Note [expert parallel in the strategy]).
    expert = apply_expert_parallel(module, mesh.mesh, previous_expert)
    experts: frozenset[torch.nn.Parameter] = frozenset()
    if expert is not None:
        precision.replace_originals(expert.slice_originals)
        experts = expert.experts
    # 3. A model built on the meta device (configure_model under stage 3): storage-less stand-ins that ZeRO
    #    initialises one unit at a time; before the device move, which would refuse meta tensors.
    built_sharded = pipeline is None and has_meta_parameters(module)
    if built_sharded:
        if not settings.zero.stage.shards_parameters:
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
    if tp is not None and optimizer is not None:
        tp.check_optimizer(optimizer)
    # 6. ZeRO last: it flattens and shards what the rank holds after every rewrite above (stage 3 per unit,
    #    then activation checkpointing of the units), offloads the shards, and couples its norms and overflow
    #    checks to the other pipeline stages and TP ranks (zero.model_parallel_coupling). Outside fit it is needed
    #    only for a model that exists as shards; else the ranks start from rank 0's weights.
    engine = None
    if optimizer is not None or built_sharded:
        engine = apply_zero(module, optimizer, mesh, settings, precision, param_init_fn, agreed, pipeline, tp,
                            experts)
    elif pipeline is not None:
        pipeline.broadcast_local(mesh.comm)
    else:
        _broadcast_module_states(module, mesh.comm, experts)
    # 7. The precision plugin steps, clips and unscales through the engine; the pre-cast weights of the
    #    parameters the engine now holds masters of are no longer needed.
    if optimizer is not None and engine is not None:
        precision.release_originals({s.param for g in engine.groups for s in g.slots})
        precision.bind_engine(engine)
    return Parallelized(settings, mesh, pipeline, tp, sequence, expert, engine, built_sharded)


@dataclass(frozen=True)
class Released:
    """What :func:`release` leaves the strategy: the last fit's stage-3 runtime (its peak counters; ``None``: no
    fit) and a pipelined fit's reason why a save after it is incomplete (``None``: none)."""

    last_runtime: Stage3Runtime | None
    pipeline_refusal: tuple[str, bool] | None


def release(parallelized: Parallelized | None, module: pl.LightningModule | None, optimizers: list[Optimizer],
            precision: PrecisionPlugin, failed: bool, gather_on_teardown: bool) -> Released:
    """:func:`parallelize` undone at teardown, in reverse: ZeRO gives back whole parameters (and optimizer state)
    where they fit (Note [teardown gather]), then the pipeline its unsplit module, then ``module`` loses its sequence
    group and the fit's scheduler guard and gets its dtype back (also after a ``parallelize`` that raised part-way:
    ``parallelized`` is ``None``). After an error (``failed``) another rank may be gone: no collective runs, the
    shard state is dropped."""
    engine = parallelized.engine if parallelized is not None else None
    pipeline = parallelized.pipeline if parallelized is not None else None
    gather = gather_on_teardown
    whole_state, last_runtime, refusal = None, None, None  # whole_state: a pipeline's optimizer state of all stages
    if engine is not None:
        if engine.optimizer is not None:
            last_runtime = engine.runtime
        plan = plan_teardown(engine, failed, gather)
        if pipeline is not None and not failed:
            whole_state = pipeline.whole_optimizer_state(engine, plan.keep_optimizer_state)
        engine.detach(keep_optimizer_state=plan.keep_optimizer_state, gather_params=plan.gather_params)
        precision.bind_engine(None)
    if pipeline is not None:  # the unsplit module (and, after fit, optimizer) on every rank again
        why = pipeline.teardown(optimizers, whole_state, failed, gather)
        refusal = why if pipeline.checkpoint is not None else None
    if module is not None:
        if parallelized is None or parallelized.sequence is not None:
            StrategySequenceParallel.detach(module)
        module.__dict__.pop("lr_scheduler_step", None)  # Note [skipped steps and schedulers] in steps.py
        precision.restore_module(module)
    return Released(last_runtime, refusal)


@torch.no_grad()
def _broadcast_module_states(module: torch.nn.Module, comm: DataParallelComm,
                             experts: frozenset[torch.nn.Parameter]) -> None:
    """Rank 0's parameters and buffers on every data rank; a rank's experts from its expert-data group's first rank
    (the other expert-parallel ranks hold other experts)."""
    for p in module.parameters():
        comm.of(p in experts).broadcast(p.data)
    for b in module.buffers():
        comm.broadcast(b)
