"""The rules across the settings tree's nodes, each written once, and how each route names the keys in them.

Note [one rule, many spellings]
    A rule that ties two nodes together (parameter offload needs ZeRO stage 3, sequence parallel is not built
    with pipeline stages, ...) is one :class:`Rule` here and nowhere else: its ``phrase`` is in no other module
    (``tests/unit/test_settings.py`` checks it). What differs between the routes in is only how a user writes a
    key: ``offload_param`` as a keyword of ``ZeroStrategy``, ``offload.param_device`` in a Hydra config,
    ``zero_optimization.offload_param.device`` in a DeepSpeed JSON. So a rule's message names the keys through the
    route's ``spelling`` (canonical key -> the user's key), and the fix it states is in the user's own terms.
    Every route checks all of them (:func:`settings_problems` lists every broken one; :func:`check_settings` raises
    them together), as does the engine for the nodes it receives (``ZeroEngine``: ZeRO and offload).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lightning_zero.core.common.choices import CheckpointFormat, OffloadDevice
from lightning_zero.core.settings.tree import Settings

Key = Callable[[str], str]  # canonical key -> the key as the route's users write it

# the canonical keys a rule may name, spelled as they are in the tree (the Hydra groups write them so too)
CANONICAL: Mapping[str, str] = {
    "zero.stage": "zero.stage",
    "offload.optimizer_device": "offload.optimizer_device",
    "offload.param_device": "offload.param_device",
    "offload.nvme_path": "offload.nvme_path",
    "parallel.pipeline": "pipeline.stages",
    "parallel.tensor": "tensor_parallel.size",
    "parallel.sequence": "sequence_parallel.size",
    "parallel.expert": "expert_parallel.size",
    "pipeline.reduce_per_micro_batch": "pipeline.reduce_per_micro_batch",
    "checkpoint_format": "checkpoint_format",  # ZeroStrategy's keyword; the Hydra groups and the JSON set none
}


@dataclass(frozen=True)
class Rule:
    """One rule across nodes: when ``broken(settings)``, ``message(settings, key)`` says why and the fix, and
    contains ``phrase``, which no other module writes."""

    phrase: str
    broken: Callable[[Settings], bool]
    message: Callable[[Settings, Key], str]


def _param_needs_stage_3(s: Settings, k: Key) -> str:
    return (f"{k('offload.param_device')}={s.offload.param_device!r} {PARAM_NEEDS_STAGE_3}, got "
            f"{k('zero.stage')}={s.zero.stage}. Fix: {k('zero.stage')}=3, or {k('offload.param_device')}='none'.")


def _param_needs_optimizer_offload(s: Settings, k: Key) -> str:
    return (f"{k('offload.param_device')}={s.offload.param_device!r} {PARAM_MOVES_OPTIMIZER}. Fix: also set "
            f"{k('offload.optimizer_device')}={s.offload.param_device!r}.")


def _optimizer_offload_needs_stage_1(s: Settings, k: Key) -> str:
    return (f"{k('offload.optimizer_device')}={s.offload.optimizer_device!r} {OPTIMIZER_NEEDS_SHARDS}, got "
            f"{k('zero.stage')}={s.zero.stage}. Fix: {k('zero.stage')}=1 (or higher), or "
            f"{k('offload.optimizer_device')}='none'.")


def _nvme_needs_path(s: Settings, k: Key) -> str:
    which = k("offload.param_device" if s.offload.param_device is OffloadDevice.nvme else "offload.optimizer_device")
    return (f"{which}='nvme' {NVME_NEEDS_PATH} {k('offload.nvme_path')}: an existing, writable directory on a local "
            f"disk. Fix: {k('offload.nvme_path')}=<a writable directory on a local disk>.")


def _sequence_with_pipeline(s: Settings, k: Key) -> str:
    return (f"{k('parallel.sequence')}={s.parallel.sequence} with {k('parallel.pipeline')}={s.parallel.stages}: "
            f"{SEQUENCE_IN_PIPELINE} (the stages would pass sequence slices between them and the schedule's loss is "
            f"not the token-weighted one). Fix: {k('parallel.pipeline')}=1 with {k('parallel.sequence')}, or "
            f"{k('parallel.sequence')}=1 with pipeline stages.")


def _sequence_with_tensor(s: Settings, k: Key) -> str:
    return (f"{k('parallel.sequence')}={s.parallel.sequence} with {k('parallel.tensor')}={s.parallel.tensor.size}: "
            f"{SEQUENCE_WITH_TENSOR} (both split the heads: the all-to-all would have to run inside each "
            f"tensor-parallel group). Fix: one of them, {k('parallel.sequence')}=1 or {k('parallel.tensor')}=1.")


def _expert_with_model_parallel(s: Settings, k: Key) -> str:
    sizes = {"parallel.pipeline": s.parallel.stages, "parallel.tensor": s.parallel.tensor.size,
             "parallel.sequence": s.parallel.sequence}
    others = [key for key, size in sizes.items() if size > 1]
    named = " and ".join(f"{k(key)}={sizes[key]}" for key in others)
    return (f"{k('parallel.expert')}={s.parallel.experts} with {named}: {EXPERT_ALONE} (the MoE layers' all-to-alls "
            f"and the experts' expert-data partition are composed with data parallelism and ZeRO 0-3 only). Fix: "
            f"{k('parallel.expert')}=1, or " + " and ".join(f"{k(key)}=1" for key in others) + ".")


def _expert_sharded_checkpoints(s: Settings, k: Key) -> str:
    return (f"{k('checkpoint_format')}='sharded' with {k('parallel.expert')}={s.parallel.experts}: "
            f"{EXPERT_SHARDED_CHECKPOINTS} (each rank's shards would hold its own experts). Fix: "
            f"{k('checkpoint_format')}='consolidated' or 'auto', whose files hold the unsplit experts and resume at "
            "any expert-parallel size.")


def _micro_batch_reduction_needs_stage_2(s: Settings, k: Key) -> str:
    return (f"{k('pipeline.reduce_per_micro_batch')}=True with {k('zero.stage')}={s.zero.stage}: "
            f"{MICRO_BATCH_REDUCTION_NEEDS_SHARDS}. Fix: {k('zero.stage')}=2 or 3, or "
            f"{k('pipeline.reduce_per_micro_batch')}=False.")


PARAM_NEEDS_STAGE_3 = "needs ZeRO stage 3 (partitioned parameters)"
PARAM_MOVES_OPTIMIZER = "moves the optimizer state with the parameters, so the optimizer must be offloaded too"
OPTIMIZER_NEEDS_SHARDS = "offloads this rank's optimizer shard and needs ZeRO stage 1, 2 or 3 (a partitioned optimizer)"
NVME_NEEDS_PATH = "keeps its swap files under"
SEQUENCE_IN_PIPELINE = "sequence parallel inside pipeline stages is not built"
SEQUENCE_WITH_TENSOR = "sequence parallel with tensor parallel is not built"
EXPERT_ALONE = "expert parallel with pipeline, tensor or sequence parallel is not built yet"
EXPERT_SHARDED_CHECKPOINTS = "sharded checkpoints with expert parallelism are not built yet"
MICRO_BATCH_REDUCTION_NEEDS_SHARDS = "reducing per micro-batch saves memory only at ZeRO stages 2-3"

_NONE = OffloadDevice.none
RULES: tuple[Rule, ...] = (
    Rule(PARAM_NEEDS_STAGE_3, lambda s: s.offload.param_device is not _NONE and not s.zero.stage.shards_parameters,
         _param_needs_stage_3),
    Rule(PARAM_MOVES_OPTIMIZER,
         lambda s: s.offload.param_device is not _NONE and s.offload.optimizer_device is _NONE,
         _param_needs_optimizer_offload),
    Rule(OPTIMIZER_NEEDS_SHARDS,
         lambda s: s.offload.optimizer_device is not _NONE and not s.zero.stage.shards_optimizer,
         _optimizer_offload_needs_stage_1),
    Rule(NVME_NEEDS_PATH, lambda s: s.offload.uses_nvme and not s.offload.nvme_path, _nvme_needs_path),
    Rule(SEQUENCE_IN_PIPELINE, lambda s: s.parallel.sequence > 1 and s.parallel.stages > 1, _sequence_with_pipeline),
    Rule(SEQUENCE_WITH_TENSOR, lambda s: s.parallel.sequence > 1 and s.parallel.tensor.size > 1, _sequence_with_tensor),
    Rule(EXPERT_ALONE,
         lambda s: s.parallel.experts > 1 and max(s.parallel.stages, s.parallel.tensor.size, s.parallel.sequence) > 1,
         _expert_with_model_parallel),
    Rule(EXPERT_SHARDED_CHECKPOINTS,
         lambda s: s.parallel.experts > 1 and s.checkpoint_format is CheckpointFormat.SHARDED,
         _expert_sharded_checkpoints),
    Rule(MICRO_BATCH_REDUCTION_NEEDS_SHARDS,
         lambda s: (s.parallel.pipeline is not None and s.parallel.pipeline.reduce_per_micro_batch
                    and not s.zero.stage.shards_gradients),
         _micro_batch_reduction_needs_stage_2),
)


def settings_problems(settings: Settings, spelling: Mapping[str, str] = CANONICAL) -> list[str]:
    """Every rule ``settings`` breaks, each as one line naming the keys as ``spelling`` writes them (with the fix)."""
    key = {**CANONICAL, **spelling}.__getitem__
    return [rule.message(settings, key) for rule in RULES if rule.broken(settings)]


def check_settings(settings: Settings, spelling: Mapping[str, str] = CANONICAL) -> Settings:
    """``settings`` unchanged, or a ``ValueError`` with every broken rule (Note [one rule, many spellings])."""
    problems = settings_problems(settings, spelling)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError("invalid settings:\n  - " + "\n  - ".join(problems))
    return settings
