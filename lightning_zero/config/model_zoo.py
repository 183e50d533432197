"""The ``model=`` / ``data=`` options of a config as the LightningModule and DataModule they name, and what is
known of them before anything is built: a text corpus's training batches per epoch (from its files' sizes),
whether ``trainer.resume_from`` holds a checkpoint of this model (its metadata and file headers, no tensor read),
whether a sparse-attention layout is sparse at the run's sequence length.

GPT options are a preset of :data:`lightning_zero.models.gpt.GPT_PRESETS` plus shape overrides
(:func:`gpt_config`); ``model=hf_causal_lm`` is :class:`lightning_zero.hf.HFCausalLM`; a ``_target_`` node is the
user's own class (Note [user targets] in ``lightning_zero/project/targets.py``). The models are imported when
built, so that validating a config stays cheap (and without Lightning: the launcher validates, the ranks build).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from lightning_zero.config.schema import (
    GPTModelSchema,
    HFCausalLMSchema,
    MLPModelSchema,
    TeacherDataSchema,
    TextDataSchema,
    TrainConfig,
)
from lightning_zero.project.targets import TargetNode

if TYPE_CHECKING:
    import lightning.pytorch as pl


def preset_known(m: GPTModelSchema) -> bool:
    """Whether ``m.preset`` names a GPT preset."""
    from lightning_zero.models.gpt_config import GPT_PRESETS

    return m.preset in GPT_PRESETS


def gpt_config(m: GPTModelSchema) -> Any:
    """The ``lightning_zero.models.gpt.GPTConfig`` of a GPT model option (preset + non-null shape overrides)."""
    from lightning_zero.models.gpt_config import resolve_config

    return resolve_config(m.preset, gpt_overrides(m))


def gpt_overrides(m: GPTModelSchema) -> dict[str, Any]:
    """The shape fields of ``m`` that are set (they replace the preset's)."""
    from lightning_zero.sparse_attention import resolve_attention

    keys = ("seq_len", "n_layer", "n_head", "n_embd", "dropout", "tie_weights")
    out = {k: getattr(m, k) for k in keys if getattr(m, k) is not None}
    section = resolve_attention(m.attention, m.sparse_attention)
    if section is not None:
        out["sparse_attention"] = section
    if m.moe.num_experts > 0:
        out["moe"] = {k: getattr(m.moe, k) for k in m.moe.__dataclass_fields__}
    return out


def param_init_fn(cfg: TrainConfig, module: pl.LightningModule | None = None) -> Any:
    """The strategy's ``param_init_fn``: a GPT built on the meta device (pipelined, or ``build_in_configure_model``
    at stage 3) is initialised by each stage / unit with GPT's own initialisation, the values a whole build gets;
    a Hugging Face model (``module``, built by :func:`build_module`) reads its weights from the checkpoint into
    each unit (Note [loading a Hugging Face checkpoint sharded]); ``None`` for other models: ``reset_parameters``."""
    if isinstance(cfg.model, GPTModelSchema):
        from lightning_zero.models.gpt_model import gpt_param_init

        return gpt_param_init(gpt_config(cfg.model))
    if isinstance(cfg.model, HFCausalLMSchema) and module is not None:
        return module.init_parameters  # type: ignore[attr-defined]
    return None


def hf_tokenizer(cfg: TrainConfig) -> str | None:
    """The tokenizer directory text data is tokenized with: ``data.tokenizer``, else a Hugging Face model's own
    (``model.tokenizer``, else ``model.path``); ``None``: bytes."""
    d, m = cfg.data, cfg.model
    if isinstance(d, TextDataSchema) and d.tokenizer:
        return d.tokenizer
    if isinstance(m, HFCausalLMSchema):
        return m.tokenizer or m.path
    return None


def build_module(cfg: TrainConfig) -> pl.LightningModule:
    """The LightningModule of ``cfg.model`` (built in the current default device, e.g. meta)."""
    m = cfg.model
    if isinstance(m, TargetNode):
        from lightning_zero.project.instantiate import instantiate_target

        return instantiate_target(m)
    if isinstance(m, HFCausalLMSchema):
        from lightning_zero.hf.module import HFCausalLM
        from lightning_zero.sparse_attention import resolve_attention

        return HFCausalLM(pretrained=m.path, config=m.config, lr=m.lr, weight_decay=m.weight_decay, betas=list(m.betas),
                          warmup_steps=m.warmup_steps, optimizer=m.optimizer.value,
                          attn_implementation=m.attn_implementation,
                          sparse_attention=resolve_attention(m.attention, m.sparse_attention))
    if isinstance(m, GPTModelSchema):
        from lightning_zero.models.gpt import GPTLightningModule

        return GPTLightningModule(
            model=m.preset, lr=m.lr, weight_decay=m.weight_decay, betas=list(m.betas), warmup_steps=m.warmup_steps,
            optimizer=m.optimizer.value, scheduler=m.scheduler.value, lr_decay_steps=m.lr_decay_steps,
            min_lr_ratio=m.min_lr_ratio, model_overrides=gpt_overrides(m) or None,
            # a pipeline builds only each rank's stage (docs/pipeline.md): in configure_model, on meta
            build_in_configure_model=m.build_in_configure_model or cfg.pipeline.stages > 1, freeze_step=m.freeze_step,
            fused=m.fused,
        )
    if isinstance(m, MLPModelSchema):
        from lightning_zero.models.mlp import MLPClassifier

        return MLPClassifier(input_dim=m.input_dim, hidden_dim=m.hidden_dim, num_layers=m.num_layers,
                             num_classes=m.num_classes, lr=m.lr, weight_decay=m.weight_decay,
                             optimizer=m.optimizer.value)
    raise ValueError(f"no builder for model.kind={m.kind!r}")


def build_datamodule(cfg: TrainConfig) -> pl.LightningDataModule:
    """The LightningDataModule of ``cfg.data``."""
    d = cfg.data
    if isinstance(d, TargetNode):
        from lightning_zero.project.instantiate import instantiate_target

        return instantiate_target(d)
    if isinstance(d, TextDataSchema):
        from lightning_zero.models.data import TextDataModule

        return TextDataModule(seq_len=d.seq_len, micro_batch_size=d.micro_batch_size, num_workers=d.num_workers,
                              max_bytes=d.max_bytes, path=d.path, val_fraction=d.val_fraction, seed=d.seed,
                              deterministic_order=d.deterministic_order, max_val_samples=d.max_val_samples,
                              synthetic=d.synthetic, pattern=d.pattern, tokenizer=hf_tokenizer(cfg))
    if isinstance(d, TeacherDataSchema):
        from lightning_zero.models.mlp import TeacherDataModule

        return TeacherDataModule(**{name: getattr(d, name) for name in inspect.signature(TeacherDataModule).parameters})
    raise ValueError(f"no builder for data.kind={d.kind!r}")


def resume_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with ``trainer.resume_from``, found without reading its tensors: no checkpoint there, an
    incomplete or truncated one (``checkpoint.reader.open_to_resume``), or one of another model's shapes."""
    from lightning_zero.checkpoint.plain import CheckpointError
    from lightning_zero.checkpoint.reader import open_to_resume, resume_path, shape_mismatches

    resume = cfg.trainer.resume_from
    if not resume:
        return []
    try:
        checkpoint = open_to_resume(resume_path(resume))
    except (CheckpointError, OSError) as err:
        return [f"trainer.resume_from={resume}: {err}"]
    if checkpoint is None or not isinstance(cfg.model, GPTModelSchema) or not preset_known(cfg.model):
        return []
    from lightning_zero.models.gpt_model import state_shapes

    wrong = shape_mismatches(checkpoint, state_shapes(gpt_config(cfg.model)))
    if not wrong:
        return []
    hparams = checkpoint.meta.get("lightning", {}).get("hyper_parameters", {})
    writer = hparams.get("model") if isinstance(hparams, dict) else None
    more = f"; and {len(wrong) - 2} more" if len(wrong) > 2 else ""
    return [f"trainer.resume_from={resume} holds another model than model={cfg.model.preset}: "
            f"{'; '.join(wrong[:2])}{more}. Fix: resume with the model that wrote it"
            f"{f' (model={writer})' if isinstance(writer, str) else ''}, or drop trainer.resume_from."]


def epoch_batches(cfg: TrainConfig, replicas: int) -> tuple[int, int, int] | None:
    """``(bytes, training samples, batches per rank)`` of one epoch of a text corpus on ``replicas`` data-parallel
    ranks, counted from its files' sizes as :class:`~lightning_zero.models.data.TextDataModule` splits and chunks
    them (the last ``val_fraction`` of the bytes held out, samples of ``seq_len + 1`` bytes at stride ``seq_len``)
    and its loaders batch them (Lightning's sampler pads to whole replicas, ``deterministic_order``'s drops the
    rest; whole micro-batches); ``None`` for other data, text a tokenizer reads (its token count is not known
    without tokenizing it), or a corpus that is not there (refused apart)."""
    from lightning_zero.models.corpus import chunk_count, corpus_bytes, split_sizes

    d = cfg.data
    if not isinstance(d, TextDataSchema) or hf_tokenizer(cfg) is not None:
        return None
    try:
        size = (d.max_bytes or 1_000_000) if d.synthetic else corpus_bytes(d.path, d.max_bytes, d.pattern)
    except FileNotFoundError:
        return None
    samples = chunk_count(split_sizes(size, d.val_fraction)[0], d.seq_len)
    per_rank = samples // replicas if d.deterministic_order else -(-samples // replicas)
    return size, samples, per_rank // d.micro_batch_size


def dense_layout_warning(cfg: TrainConfig) -> str | None:
    """The warning for a sparse-attention layout that keeps, at ``data.seq_len``, every block a causal query sees
    (it computes dense attention's result through the slower sparse path), with the length it is sparse from;
    ``None`` otherwise (dense attention, ``mode: dense`` on purpose, a layout that is sparse).

    Raises:
        ValueError: the layout does not fit ``data.seq_len`` (a window of more blocks than the sequence has).
    """
    from lightning_zero.sparse_attention.section import dense_at, resolve_attention, sparse_from

    m, d = cfg.model, cfg.data
    if not isinstance(m, GPTModelSchema) or not isinstance(d, TextDataSchema) or not preset_known(m):
        return None
    section = resolve_attention(m.attention, m.sparse_attention)
    heads = gpt_config(m).n_head
    if section is None or section.get("mode") == "dense" or not dense_at(section, heads, d.seq_len):
        return None
    block = int(section.get("block", 16))
    start = sparse_from(section, heads, limit=64 * block)
    name = m.attention if m.attention != "dense" else f"sparse_attention mode {section.get('mode', 'fixed')}"
    longer = (f" It is sparse from {start} tokens: data.seq_len={start} or more (and model.seq_len, the model's "
              f"context, at least that)." if start else "")
    return (f"model.attention={name} is dense at data.seq_len={d.seq_len} ({-(-d.seq_len // block)} blocks of "
            f"{block}): its layout keeps every block a causal query sees, so it computes dense attention's result, "
            f"slower.{longer} Or model.attention=dense.")
