"""Cross-group checks of a composed config, run before any rank process starts.

:func:`validate_config` is the one gate: a combination that can never work raises ``ValueError``
listing every reason with its fix; a valid combination that needs a feature lightning_zero does
not have yet raises ``NotImplementedError`` naming the feature. It runs the settings tree's checks
(``settings.py``) and each concern's beside it (``value_checks.py``, ``parallel_checks.py``,
``model_checks.py``); models are only counted on the meta device (``describe.py``), never
materialised.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from lightning_zero.config.model_checks import BUILT_STAGES, epoch_problems, model_data_problems, offload_problems
from lightning_zero.config.model_zoo import dense_layout_warning, gpt_config, preset_known
from lightning_zero.config.multinode import node_device_problems
from lightning_zero.config.parallel_checks import (
    expert_parallel_problems,
    pipeline_problems,
    sequence_problems,
    tensor_parallel_problems,
    world_problems,
)
from lightning_zero.config.schema import GPTModelSchema, ModelSchema, OptimizerName, TrainConfig, to_train_config
from lightning_zero.config.settings import hydra_settings_problems
from lightning_zero.config.value_checks import value_problems
from lightning_zero.project.locate import static_problems
from lightning_zero.project.targets import user_nodes


def invalid_combinations(cfg: TrainConfig) -> list[str]:
    """Every reason ``cfg`` cannot work, each with its fix (empty when it is valid)."""
    problems: list[str] = []
    if isinstance(cfg.model, GPTModelSchema):
        from lightning_zero.sparse_attention import resolve_attention

        try:
            section = resolve_attention(cfg.model.attention, cfg.model.sparse_attention)
        except (ValueError, NotImplementedError) as err:
            problems.append(f"model.attention / model.sparse_attention: {err}")
        else:
            if section is not None and preset_known(cfg.model) and gpt_config(cfg.model).dropout:
                problems.append("sparse attention has no attention dropout: set model.dropout=0")
            try:
                dense_layout_warning(cfg)
            except ValueError as err:  # the pattern's own check, which the first forward would make on every rank
                problems.append(f"model.attention={cfg.model.attention} at data.seq_len={cfg.data.seq_len}: {err}.")
    if cfg.zero.stage not in BUILT_STAGES:  # the root problem: every stage-dependent check would follow from it
        stage = cfg.zero.stage
        return [f"zero.stage={stage}: ZeRO stage must be 0, 1, 2 or 3, got {stage}. Fix: zero=stage0, stage1, stage2 "
                "or stage3."]
    problems += hydra_settings_problems(cfg)  # each node's values, the rules across nodes (core/settings/)
    for node in user_nodes(cfg.model, cfg.data, cfg.logger, cfg.callbacks):  # as far as their source says
        problems += static_problems(node)
    problems += world_problems(cfg) + tensor_parallel_problems(cfg)
    problems += node_device_problems(str(cfg.trainer.accelerator), cfg.trainer.devices)
    for check in (value_problems, offload_problems, pipeline_problems, model_data_problems, sequence_problems,
                  expert_parallel_problems):
        problems += check(cfg)
    if not problems:  # sizes of a config that is otherwise valid (a corpus that exists, sizes >= 1)
        problems += epoch_problems(cfg)
    return problems


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Valid settings that will not do what they are for (printed once, before launch)."""
    out = []
    m, max_steps = cfg.model, cfg.trainer.max_steps
    onebit = isinstance(m, ModelSchema) and m.optimizer is OptimizerName.onebit_adam
    if onebit and max_steps is not None and 0 < max_steps <= m.freeze_step:
        out.append(f"model.freeze_step={m.freeze_step} >= trainer.max_steps={max_steps}: 1-bit Adam stays in its "
                   "AdamW warm-up for the whole run and never compresses. Fix: model.freeze_step="
                   f"{max(1, max_steps // 2)} (or more steps).")
    dense = dense_layout_warning(cfg)
    return [*out, dense] if dense else out


def unbuilt_features(cfg: TrainConfig) -> list[str]:
    """The features ``cfg`` asks for that lightning_zero does not implement yet (empty when all are built)."""
    out = []
    if cfg.zero.stage not in BUILT_STAGES:
        out.append(f"ZeRO stage {cfg.zero.stage} (zero=stage{cfg.zero.stage}, partitioned parameters); "
                   "use zero=stage0, stage1 or stage2")
    return out


def validate_config(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """Check a composed config across groups; return it typed.

    Raises:
        ValueError: a mandatory value is missing, or the combination is invalid (every reason and fix).
        NotImplementedError: the combination is valid but needs a feature not built yet (named).
    """
    if isinstance(cfg, DictConfig):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ValueError(f"missing mandatory value(s): {', '.join(missing)}. Set them on the command line, "
                             f"e.g. {missing[0]}=...")
        cfg = to_train_config(cfg)
    problems = invalid_combinations(cfg)
    if problems:
        raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))
    todo = unbuilt_features(cfg)
    if todo:
        raise NotImplementedError("not implemented in lightning_zero yet: " + "; ".join(todo) + ".")
    return cfg


# the value of each of run_choices' dimensions when it is off: the header line names the others


