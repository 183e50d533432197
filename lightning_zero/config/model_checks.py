"""The model against its data, its optimizer and the checkpoint a run resumes from (a Hugging Face model's through
``hf/checks.py``), the corpus against the run's sizes (:func:`epoch_problems`), and the model's offloaded state
against the swap directory's room (:func:`offload_problems`, with the estimator's formula), each with its fix."""

from __future__ import annotations

from pathlib import Path

from lightning_zero.config.describe import count_model_parameters, offload_name
from lightning_zero.config.model_zoo import epoch_batches, gpt_config, preset_known, resume_problems
from lightning_zero.config.multinode import resolve_node
from lightning_zero.config.parallel_checks import data_parallel_size
from lightning_zero.config.schema import (
    GPTModelSchema,
    HFCausalLMSchema,
    MLPModelSchema,
    ModelSchema,
    OptimizerName,
    TeacherDataSchema,
    TextDataSchema,
    TrainConfig,
)
from lightning_zero.config.value_checks import counts, val_check_batches
from lightning_zero.core.common.choices import OffloadDevice, ZeroStage
from lightning_zero.core.common.memory import OFFLOAD_STAGES
from lightning_zero.core.offload.swap_step import SwappedStep
from lightning_zero.core.settings.offload import nvme_path_problem
from lightning_zero.hf.checks import HFRun, hf_problems
from lightning_zero.project.targets import TargetNode

BUILT_STAGES = tuple(ZeroStage)

def model_data_problems(cfg: TrainConfig) -> list[str]:
    m, d, out = cfg.model, cfg.data, []
    if isinstance(m, GPTModelSchema):
        from lightning_zero.models.gpt_config import GPT_PRESETS

        if not isinstance(d, TextDataSchema):
            out.append(f"model.kind=gpt needs text data, got data.kind={d.kind}. Fix: data=stdlib, data=text_file "
                       "or data=synthetic.")
        if m.preset not in GPT_PRESETS:
            return out + [f"model.preset={m.preset!r} is not a GPT preset; choose from {', '.join(GPT_PRESETS)}."]
        shape = gpt_config(m)
        if shape.n_embd % shape.n_head:
            out.append(f"model n_embd={shape.n_embd} is not divisible by n_head={shape.n_head}.")
        if isinstance(d, TextDataSchema) and d.seq_len > shape.seq_len:
            out.append(f"data.seq_len={d.seq_len} exceeds the model's context {shape.seq_len} ({m.preset}). "
                       f"Fix: data.seq_len={shape.seq_len} or less, or model.seq_len={d.seq_len}.")
    if isinstance(m, HFCausalLMSchema):
        out += _hf_problems(cfg)
    elif isinstance(d, TextDataSchema) and d.tokenizer:
        out.append(f"data.tokenizer={d.tokenizer} with model.kind={getattr(m, 'kind', m)}: the package's GPT reads "
                   "bytes (vocabulary 256). Fix: data.tokenizer=null, or model=hf_causal_lm.")
    if isinstance(m, ModelSchema) and m.optimizer is OptimizerName.onebit_adam:
        if not isinstance(m, GPTModelSchema):
            out.append(f"model.optimizer=onebit_adam is built by the GPT experiment, not model.kind={m.kind}. "
                       "Fix: model.optimizer=adamw.")
        elif ZeroStage.of(cfg.zero.stage).shards_optimizer:
            out.append(f"model.optimizer=onebit_adam runs with ZeRO stage 0 (it compresses the all-reduce of every "
                       f"rank's whole momentum), got zero.stage={cfg.zero.stage}. Fix: zero=stage0.")
        elif m.freeze_step < 1:
            out.append(f"model.freeze_step must be >= 1 (AdamW warm-up steps), got {m.freeze_step}.")
    if isinstance(m, MLPModelSchema):
        if not isinstance(d, TeacherDataSchema):
            out.append(f"model.kind=mlp needs classification data, got data.kind={d.kind}. Fix: data=teacher.")
        elif (m.input_dim, m.num_classes) != (d.input_dim, d.num_classes):
            out.append(f"model.input_dim/num_classes ({m.input_dim}/{m.num_classes}) differ from data.input_dim/"
                       f"num_classes ({d.input_dim}/{d.num_classes}). Fix: set both to the same values.")
    if isinstance(d, TextDataSchema) and d.path and not d.synthetic and not Path(d.path).expanduser().exists():
        out.append(f"data.path={d.path} does not exist (relative paths are taken from the current directory, "
                   f"{Path.cwd()}). Fix: data.path=/path/to/corpus.txt.")
    if isinstance(d, TextDataSchema) and not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction must be in (0, 1) for a held-out validation split, got {d.val_fraction}.")
    out += resume_problems(cfg)
    try:  # multi-node: this node's rank and node 0's endpoint (config or environment)
        resolve_node(cfg.trainer.num_nodes, cfg.trainer.node_rank, cfg.trainer.rdzv_endpoint)
    except ValueError as err:
        out.append(str(err))
    return out


def _hf_problems(cfg: TrainConfig) -> list[str]:
    m, d = cfg.model, cfg.data
    text = isinstance(d, TextDataSchema)
    if not text and not isinstance(d, TargetNode):
        return [f"model=hf_causal_lm needs text data, got data.kind={d.kind}. Fix: data=text_file data.path=... "
                "(tokenized with the model's tokenizer), or your own data module."]
    run = HFRun(path=m.path, config=m.config, tokenizer=(d.tokenizer if text else None) or m.tokenizer,
                text_data=text, seq_len=d.seq_len if text else None,
                shards_parameters=ZeroStage.of(cfg.zero.stage).shards_parameters if cfg.zero.stage in BUILT_STAGES
                else False, tensor=cfg.tensor_parallel.size, sequence=cfg.sequence_parallel.size,
                pipeline=cfg.pipeline.stages, sparse=m.attention != "dense" or bool(m.sparse_attention))
    return hf_problems(run)


def epoch_problems(cfg: TrainConfig) -> list[str]:
    """A text corpus too small for the run, known from its files' sizes (``model_zoo.epoch_batches``): no training
    batch at all, or fewer per epoch than ``trainer.val_check_interval`` (which Lightning refuses once the ranks
    have started)."""
    replicas, t, d = data_parallel_size(cfg), cfg.trainer, cfg.data
    counted = epoch_batches(cfg, replicas)
    if counted is None or not isinstance(d, TextDataSchema):
        return []
    size, samples, batches = counted
    limit = t.limit_train_batches
    if limit is not None:
        batches = min(batches, int(limit)) if counts(limit) else int(batches * limit)
    where = "data.synthetic=true" if d.synthetic else f"data.path={d.path}" if d.path else "the standard library"
    size_text = (f"{where} holds {size:,} bytes: {samples} training samples of data.seq_len={d.seq_len} (the last "
                 f"{d.val_fraction:.0%} held out), {batches} batch(es) of data.micro_batch_size={d.micro_batch_size} "
                 f"per epoch on each of {replicas} data-parallel rank(s)")
    if batches < 1:
        return [f"{size_text}: no training batch. Fix: more data, or a smaller data.seq_len / data.micro_batch_size."]
    interval = val_check_batches(cfg)
    if isinstance(interval, int) and interval > batches and t.check_val_every_n_epoch is not None:
        return [f"trainer.val_check_interval={t.val_check_interval} steps is more than one epoch: {size_text}. "
                f"Fix: trainer.val_check_interval={batches // t.accumulate_grad_batches} or less, "
                f"trainer.check_val_every_n_epoch=null (validation every {t.val_check_interval} steps across "
                "epochs), or more data."]
    return []


def offload_problems(cfg: TrainConfig) -> list[str]:
    """The swap directory of ``"nvme"`` offload, checked here before any rank starts, with the room the estimator
    counts (the offload node's values and its rules with the stage are checked with the settings tree)."""
    o = cfg.offload
    out = []
    if o.buffer_count is not None and o.optimizer_device is OffloadDevice.nvme:  # Note [swapped step]
        state = {"adamw": 2, "adam": 2, "sgd": 1}.get(cfg.model.optimizer.value)
        try:
            SwappedStep(None, int(o.buffer_count), bool(o.pipeline_read), bool(o.pipeline_write)).check(
                2 + (state or 0), f"the master, its gradient and the optimizer's {state} state tensor(s)")
        except ValueError as err:
            out.append(str(err).replace("offload buffer_count", "offload.buffer_count", 1))
    if OffloadDevice.nvme not in (o.optimizer_device, o.param_device) or not o.nvme_path:
        return out
    problem = nvme_path_problem(str(o.nvme_path), nvme_bytes_per_node(cfg), "offload.nvme_path")
    return out + ([problem] if problem else [])  # the check the ranks repeat, here before any of them starts


def nvme_bytes_per_node(cfg: TrainConfig) -> float:
    """The estimator's bytes of offloaded state under ``offload.nvme_path`` on one node (its ranks share the
    path); 0 when it cannot be counted yet (a stage the offload cannot run, an unknown model: refused apart).

    Args:
        cfg: a composed config with ``"nvme"`` offload.
    """
    from lightning_zero.estimator import ModelSpec, estimate_config, make_cluster

    name, t = offload_name(cfg), cfg.trainer
    gpt = isinstance(cfg.model, GPTModelSchema)
    if (cfg.zero.stage not in OFFLOAD_STAGES.get(name, ()) or (gpt and not preset_known(cfg.model))
            or t.devices < 1 or t.num_nodes < 1):
        return 0.0
    params = count_model_parameters(cfg)
    if params is None:  # not counted before launch: the ranks check the space they need
        return 0.0
    cluster = make_cluster(t.devices * t.num_nodes, t.num_nodes, t.devices)
    estimate = estimate_config(cfg.zero.stage, name, ModelSpec(float(params)), cluster,
                               cfg.precision.name.value)
    return estimate.nvme_bytes * t.devices
