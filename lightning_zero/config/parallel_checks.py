"""The configuration checks of the model-parallel dimensions beside the pipeline's: tensor parallelism's
sizes and the combinations not built yet, each with its fix (run by ``validate.py`` before any rank starts)."""

from __future__ import annotations

from lightning_zero.config.model_zoo import gpt_config, preset_known
from lightning_zero.config.schema import GPTModelSchema, OffloadDevice, OptimizerName, TrainConfig


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
    if OffloadDevice.none is not cfg.offload.optimizer_device or cfg.offload.param_device is not OffloadDevice.none:
        out.append("tensor_parallel with offload is not built yet. Fix: offload=none or tensor_parallel=none.")
    if cfg.model.optimizer is OptimizerName.onebit_adam:
        out.append("tensor_parallel with model.optimizer=onebit_adam is not built yet. Fix: model.optimizer=adamw.")
    if cfg.trainer.checkpoint.enabled or cfg.trainer.resume_from:
        out.append("checkpoints with tensor_parallel are not built yet (the sharded format does not record TP "
                   "slices). Fix: trainer.checkpoint.enabled=false (and no trainer.resume_from), or "
                   "tensor_parallel=none.")
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
