"""The configuration checks of the parallel dimensions beyond data: pipeline, sequence and tensor parallelism's sizes
and the combinations not built yet, each with its fix (run by ``validate.py`` before any rank starts)."""

from __future__ import annotations

from lightning_zero.config.model_zoo import gpt_config, preset_known
from lightning_zero.config.schema import (
    GPTModelSchema,
    MLPModelSchema,
    OptimizerName,
    PipeSchedule,
    TextDataSchema,
    TrainConfig,
)
from lightning_zero.core.common.choices import ZeroStage


def data_parallel_size(cfg: TrainConfig) -> int:
    """Data-parallel replicas: the world over pipeline x tensor x sequence (the ranks of one replica share its
    samples; ``ParallelDims.data``)."""
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    return max(1, world // (cfg.pipeline.stages * cfg.tensor_parallel.size * cfg.sequence_parallel.size))


def tensor_parallel_problems(cfg: TrainConfig) -> list[str]:
    """``tensor_parallel.size``: the sizes and the combinations not built yet, each with its fix."""
    size, out = cfg.tensor_parallel.size, []
    if size < 1:
        return [f"tensor_parallel.size must be >= 1, got {size}. Fix: tensor_parallel=none or tp2."]
    if size == 1:
        return out
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if world % (size * cfg.pipeline.stages):
        out.append(f"trainer.devices x num_nodes = {world} is not a multiple of pipeline.stages x "
                   f"tensor_parallel.size = {cfg.pipeline.stages} x {size}. Fix: trainer.devices="
                   f"{size * cfg.pipeline.stages} (or a multiple).")
    if cfg.model.optimizer is OptimizerName.onebit_adam:
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
    if not isinstance(cfg.model, GPTModelSchema):
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
    """``pipeline``: the sizes, the schedule, the micro-batches and the model's layers, each with its fix."""
    pp, out = cfg.pipeline, []
    if pp.stages < 1 or pp.micro_batches < 1 or pp.virtual_stages < 1:
        return [f"pipeline.stages, micro_batches and virtual_stages must be >= 1, got {pp.stages}, "
                f"{pp.micro_batches}, {pp.virtual_stages}."]
    if (pp.stages == 1) != (pp.schedule is PipeSchedule.none):
        out.append(f"pipeline.stages={pp.stages} with pipeline.schedule={pp.schedule.value}: a schedule needs "
                   "stages > 1 and stages > 1 needs a schedule. Fix: pipeline=none or a pipeline/ preset.")
    batch = getattr(cfg.data, "micro_batch_size", None)
    if pp.stages > 1 and batch is not None and batch % pp.micro_batches:
        out.append(f"data.micro_batch_size={batch} (the batch per data-parallel rank) does not split into "
                   f"pipeline.micro_batches={pp.micro_batches} equal micro-batches. Fix: a multiple of "
                   f"{pp.micro_batches}, or other micro_batches.")
    if cfg.trainer.devices % pp.stages:
        out.append(f"pipeline.stages={pp.stages} must divide trainer.devices={cfg.trainer.devices} "
                   "(data-parallel size = devices / stages).")
    interleaved = pp.schedule is PipeSchedule.interleaved_1f1b
    if interleaved and (pp.virtual_stages < 2 or pp.micro_batches % pp.stages):
        out.append("pipeline.schedule=interleaved_1f1b needs pipeline.virtual_stages >= 2 and micro_batches a "
                   "multiple of stages.")
    if pp.schedule is PipeSchedule.one_f_one_b and pp.micro_batches < pp.stages:
        out.append(f"pipeline.schedule=one_f_one_b needs pipeline.micro_batches >= stages ({pp.micro_batches} < "
                   f"{pp.stages}). Fix: more micro_batches, or pipeline=pp2_gpipe.")
    if not interleaved and pp.virtual_stages != 1:
        out.append("pipeline.virtual_stages > 1 needs pipeline.schedule=interleaved_1f1b.")
    if pp.stages > 1 and pp.reduce_per_micro_batch and not ZeroStage.of(cfg.zero.stage).shards_gradients:
        out.append(f"pipeline.reduce_per_micro_batch=true with zero.stage={cfg.zero.stage}: it saves memory only at "
                   "ZeRO stages 2-3. Fix: zero=stage2 or zero=stage3, or drop it.")
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
    if pp.stages > 1 and layers < pp.stages * pp.virtual_stages:
        out.append(f"the model has {layers} pipeline layers, fewer than pipeline.stages x virtual_stages = "
                   f"{pp.stages * pp.virtual_stages} chunks.")
    return out


def sequence_problems(cfg: TrainConfig) -> list[str]:
    """``sequence_parallel.size`` against the world, the model's heads, the data's length, the pipeline."""
    from lightning_zero.sequence_parallel import check_sequence_parallel

    size, m, d = cfg.sequence_parallel.size, cfg.model, cfg.data
    if size == 1:
        return []
    if not isinstance(m, GPTModelSchema):
        return [f"sequence_parallel.size={size} with model.kind={m.kind}: only the GPT experiment splits its "
                "sequences. Fix: sequence_parallel=none, or a GPT model."]
    checks = [dict(world_size=cfg.trainer.devices * cfg.trainer.num_nodes), dict(pipeline=cfg.pipeline.stages),
              dict(tensor=cfg.tensor_parallel.size),
              dict(heads=gpt_config(m).n_head if preset_known(m) else None),
              dict(seq_len=d.seq_len if isinstance(d, TextDataSchema) else None)]
    out = []
    for known in checks:
        try:
            check_sequence_parallel(size, **known)
        except ValueError as err:
            out.append(f"{err}.")
    return out


def _layers(cfg: TrainConfig) -> int:
    if isinstance(cfg.model, GPTModelSchema):
        return gpt_config(cfg.model).n_layer if preset_known(cfg.model) else 0
    return cfg.model.num_layers if isinstance(cfg.model, MLPModelSchema) else 0
