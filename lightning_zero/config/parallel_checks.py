"""The parallel sizes against the world, the model, the data and the optimizer (the pipeline's layers, the heads
tensor and sequence parallelism split, the experts, the launched ranks), each with its fix. The rules across the
settings tree's nodes are ``core/settings/rules.py``'s; these are the checks that need the model or the world."""

from __future__ import annotations

from lightning_zero.config.model_zoo import gpt_config, preset_known
from lightning_zero.config.schema import (
    GPTModelSchema,
    HFCausalLMSchema,
    MLPModelSchema,
    OptimizerName,
    TextDataSchema,
    TrainConfig,
)
from lightning_zero.config.settings_schema import PipeSchedule
from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.mesh.dims import ParallelDims
from lightning_zero.project.targets import TargetNode


def data_parallel_size(cfg: TrainConfig) -> int:
    """Data-parallel replicas: what the world leaves over pipeline x tensor x sequence (the mesh's sizes,
    ``ParallelDims.data``: the one place the data dimension is derived); 1 when they do not divide it, or expert
    parallelism does not divide what is left (refused by :func:`world_problems`)."""
    try:
        return _dims(cfg).data
    except ValueError:
        return 1


def _dims(cfg: TrainConfig) -> ParallelDims:
    return ParallelDims(cfg.trainer.devices * cfg.trainer.num_nodes, pipeline=max(1, cfg.pipeline.stages),
                        tensor=max(1, cfg.tensor_parallel.size), sequence=max(1, cfg.sequence_parallel.size),
                        expert=max(1, cfg.expert_parallel.size))


def world_problems(cfg: TrainConfig) -> list[str]:
    """The launched ranks against the parallel sizes (the mesh's own check, ``core/mesh/dims.py``)."""
    try:
        _dims(cfg)
    except ValueError as err:
        return [f"{err}."]
    return []


def tensor_parallel_problems(cfg: TrainConfig) -> list[str]:
    """``tensor_parallel.size`` against the model, the optimizer and checkpointing, each with its fix."""
    size, out = cfg.tensor_parallel.size, []
    if size <= 1:
        return out
    if getattr(cfg.model, "optimizer", None) is OptimizerName.onebit_adam:
        out.append("tensor_parallel with model.optimizer=onebit_adam is not built yet. Fix: model.optimizer=adamw.")
    if cfg.pipeline.stages > 1 and not ZeroStage.of(cfg.zero.stage).shards_optimizer and cfg.trainer.checkpoint.enabled:
        out.append("checkpoints of pipeline x tensor_parallel at zero.stage=0 are not built yet (they are written "
                   "from the shards of ZeRO stage >= 1, in the sharded format). Fix: zero.stage=1 (or higher), or "
                   "trainer.checkpoint.enabled=false.")
    if getattr(cfg.model, "build_in_configure_model", False) and cfg.pipeline.stages == 1:
        out.append("tensor_parallel with a model built on the meta device (model.build_in_configure_model=true, "
                   "unpipelined) is not built yet: the plan slices whole layers (Note [slice after build]). Fix: "
                   "model.build_in_configure_model=false, or a pipeline (pipeline=pp2_gpipe builds each stage "
                   "alone), or tensor_parallel=none.")
    if isinstance(cfg.model, (TargetNode, HFCausalLMSchema)):
        pass  # your own module's plan is checked on the ranks at setup; a Hugging Face model's in hf/checks.py
    elif not isinstance(cfg.model, GPTModelSchema):
        out.append("tensor_parallel needs a model with a plan: model=mlp has none. Fix: a GPT model "
                   "(model=gpt_tiny ..).")
    elif preset_known(cfg.model):
        gpt = gpt_config(cfg.model)
        for what, count in (("model.n_head (attention heads)", gpt.n_head), ("model.vocab_size", gpt.vocab_size),
                            ("model.n_embd", gpt.n_embd)):
            if count % size:
                out.append(f"{what} = {count} does not split over tensor_parallel.size={size}. Fix: a size dividing "
                           f"{count}.")
    return out


def pipeline_problems(cfg: TrainConfig) -> list[str]:
    """``pipeline`` against the data's batch and the model's layers, each with its fix (its own values are the
    pipeline node's checks)."""
    pp, out = cfg.pipeline, []
    if pp.stages < 1 or pp.micro_batches < 1 or pp.virtual_stages < 1:
        return []  # the node refuses them
    if (pp.stages == 1) != (pp.schedule is PipeSchedule.none):
        out.append(f"pipeline.stages={pp.stages} with pipeline.schedule={pp.schedule.value}: a schedule needs "
                   "stages > 1 and stages > 1 needs a schedule. Fix: pipeline=none or a pipeline/ preset.")
    batch = getattr(cfg.data, "micro_batch_size", None)
    if pp.stages > 1 and batch is not None and batch % pp.micro_batches:
        out.append(f"data.micro_batch_size={batch} (the batch per data-parallel rank) does not split into "
                   f"pipeline.micro_batches={pp.micro_batches} equal micro-batches. Fix: a multiple of "
                   f"{pp.micro_batches}, or other micro_batches.")
    if (pp.stages > 1 and pp.reduce_per_micro_batch and isinstance(cfg.model, GPTModelSchema)
            and preset_known(cfg.model) and gpt_config(cfg.model).tie_weights):
        out.append("pipeline.reduce_per_micro_batch=true with a GPT whose token embedding and head are tied across "
                   "the first and last stage (their gradients are summed once per step). Fix: model.tie_weights=false.")
    layers = _layers(cfg)
    if pp.stages > 1 and isinstance(cfg.model, MLPModelSchema):
        out.append("pipeline.stages > 1 with model=mlp: the MLP classifier does not follow the pipeline protocol "
                   "(pipeline_layers / pipeline_loss, docs/pipeline.md). Fix: a GPT model, or pipeline=none.")
    if isinstance(cfg.model, GPTModelSchema) and layers:
        layers += 2  # pipeline_layers(): the embedding, the blocks, the head
    known = isinstance(cfg.model, (GPTModelSchema, MLPModelSchema))  # your own module's split points: at setup
    if pp.stages > 1 and known and layers < pp.stages * pp.virtual_stages:
        out.append(f"the model has {layers} pipeline layers, fewer than pipeline.stages x virtual_stages = "
                   f"{pp.stages * pp.virtual_stages} chunks.")
    return out


def sequence_problems(cfg: TrainConfig) -> list[str]:
    """``sequence_parallel.size`` against the world, the model's heads, the data's length, the pipeline."""
    from lightning_zero.sequence_parallel import check_sequence_parallel

    size, m, d = cfg.sequence_parallel.size, cfg.model, cfg.data
    if size == 1 or isinstance(m, HFCausalLMSchema):  # a Hugging Face model: refused in hf/checks.py
        return []
    if not isinstance(m, (TargetNode, GPTModelSchema)):  # your own module: configure_sequence_parallel, at setup
        return [f"sequence_parallel.size={size} with model.kind={m.kind}: only the GPT experiment splits its "
                "sequences. Fix: sequence_parallel=none, or a GPT model."]
    checks = [dict(world_size=cfg.trainer.devices * cfg.trainer.num_nodes),
              dict(heads=None if isinstance(m, TargetNode) else gpt_config(m).n_head if preset_known(m) else None),
              dict(seq_len=d.seq_len if isinstance(d, TextDataSchema) else None)]
    out = []
    for known in checks:
        try:
            check_sequence_parallel(size, **known)
        except ValueError as err:
            out.append(f"{err}.")
    return out


def expert_parallel_problems(cfg: TrainConfig) -> list[str]:
    """``expert_parallel.size`` against the model's experts and the combinations not built yet (its size against
    the data ranks is the mesh's check, :func:`world_problems`; with the other parallelisms, the settings tree's
    rule)."""
    size, m = cfg.expert_parallel.size, cfg.model
    if size <= 1:
        return []  # below 1: the node refuses it
    out = []
    if getattr(m, "optimizer", None) is OptimizerName.onebit_adam:
        out.append("expert_parallel with model.optimizer=onebit_adam is not built. Fix: model.optimizer=adamw.")
    if isinstance(m, TargetNode):  # your own module: its MoE layers are found (or refused) at setup
        return out
    if isinstance(m, HFCausalLMSchema):  # a Hugging Face MoE: its base_model_ep_plan is found at setup
        if ZeroStage.of(cfg.zero.stage).shards_parameters:
            out.append("expert_parallel with model=hf_causal_lm at zero.stage=3 is not built yet (the model is built "
                       "on the meta device and streamed into shards; expert parallelism splits a whole model). Fix: "
                       "zero=stage2, or expert_parallel=none.")
        return out
    if not isinstance(m, GPTModelSchema) or m.moe.num_experts == 0:
        out.append("expert_parallel needs MoE layers: set model.moe.num_experts (a GPT model), or a Hugging Face "
                   "MoE (model=hf_causal_lm). Fix: model.moe.num_experts=8, or expert_parallel=none.")
    elif m.moe.num_experts % size:
        out.append(f"model.moe.num_experts={m.moe.num_experts} does not split over expert_parallel.size={size}. Fix: "
                   f"a multiple of {size} experts.")
    if getattr(m, "build_in_configure_model", False):
        out.append("expert_parallel with model.build_in_configure_model=true is not built yet (every rank builds the "
                   "whole model and keeps its experts). Fix: model.build_in_configure_model=false.")
    return out


def _layers(cfg: TrainConfig) -> int:
    if isinstance(cfg.model, GPTModelSchema):
        return gpt_config(cfg.model).n_layer if preset_known(cfg.model) else 0
    return cfg.model.num_layers if isinstance(cfg.model, MLPModelSchema) else 0
