"""Every former path of the package, in one table: where each name or module moved, and the release that drops it.

A former module is served by :mod:`~lightning_zero.compat.finder` as the module (or modules) it moved to; a former
name of a module that still exists is looked up on that module through the ``__getattr__`` the finder adds to it.
Either warns once per import or look-up, naming the new place. ``docs/design.md`` ("Former paths") lists the same
entries for readers; ``tests/unit/test_public_names.py`` checks that each still resolves and warns.
"""

from __future__ import annotations

from dataclasses import dataclass

REMOVED_IN = "0.2"  # the release after 0.1: every path below goes then


@dataclass(frozen=True)
class FormerModule:
    """A module path that no longer has a file: its names are those of ``new`` (the first that has the name)."""

    old: str
    new: tuple[str, ...]
    removed_in: str = REMOVED_IN


@dataclass(frozen=True)
class FormerName:
    """``module.name`` that moved to ``target`` (``"module:attribute"``); ``note`` replaces the warning's text."""

    module: str
    name: str
    target: str
    note: str = ""
    removed_in: str = REMOVED_IN


_CORE = "lightning_zero.core"
FORMER_MODULES: tuple[FormerModule, ...] = (
    # issue 20's move of the core into folders
    FormerModule(f"{_CORE}.engine", (f"{_CORE}.zero.engine",)),
    FormerModule(f"{_CORE}.config", (f"{_CORE}.settings.zero", f"{_CORE}.settings.precision")),
    FormerModule(f"{_CORE}.loss_scaler", (f"{_CORE}.precision.loss_scaler",)),
    FormerModule(f"{_CORE}.memory", (f"{_CORE}.common.memory",)),
    FormerModule("lightning_zero.advisor", ("lightning_zero.estimator.advisor",)),
    FormerModule("lightning_zero.callbacks", ("lightning_zero.observability.callbacks",
                                              "lightning_zero.observability.model_summary")),
    FormerModule("lightning_zero.monitoring", ("lightning_zero.observability.monitoring",)),
    FormerModule("lightning_zero.progress", ("lightning_zero.observability.progress",)),
    # issue 30's file-size split
    FormerModule("lightning_zero.lightning.own_bytes", ("lightning_zero.checkpoint.tensor_file",)),
    # issue 47's one order inside core/: the leaf (common/), the settings tree (settings/), the engine's on top
    FormerModule(f"{_CORE}.zero.config", (f"{_CORE}.settings.zero", f"{_CORE}.settings.precision",
                                          f"{_CORE}.common.choices")),
    FormerModule(f"{_CORE}.zero.flat_param", (f"{_CORE}.common.flat_param",)),
    FormerModule(f"{_CORE}.zero.memory", (f"{_CORE}.common.memory",)),
    FormerModule(f"{_CORE}.offload.config", (f"{_CORE}.settings.offload", f"{_CORE}.common.choices")),
    FormerModule(f"{_CORE}.reliability.agreement", (f"{_CORE}.comm.agreement",)),
    FormerModule(f"{_CORE}.stage3.teardown", (f"{_CORE}.zero.teardown",)),
    FormerModule(f"{_CORE}.stage3.loading", (f"{_CORE}.zero.loading",)),
    # issue 47's settings tree: its nodes in core/settings, the Hydra route's translation in config/settings.py
    FormerModule("lightning_zero.pipeline.config", (f"{_CORE}.settings.pipeline",)),
    FormerModule("lightning_zero.tensor_parallel.config", (f"{_CORE}.settings.tensor",)),
    # issue 47's parallel/: each parallelism an apply, one parallelize() / release()
    FormerModule("lightning_zero.pipeline.lightning", ("lightning_zero.parallel.pipeline",)),
    FormerModule("lightning_zero.tensor_parallel.lightning", ("lightning_zero.parallel.tensor",)),
    FormerModule("lightning_zero.sequence_parallel.lightning", ("lightning_zero.parallel.sequence",)),
    FormerModule("lightning_zero.lightning.compose", ("lightning_zero.parallel.parallelize",
                                                     "lightning_zero.parallel.zero")),
    FormerModule("lightning_zero.lightning.mesh_setup", ("lightning_zero.lightning.run",
                                                        "lightning_zero.parallel.mesh")),
    # issue 47's config/run/: the launch side on top of config/'s schemas, settings route and checks
    *(FormerModule(f"lightning_zero.config.{name}", (f"lightning_zero.config.run.{name}",))
      for name in ("launch", "worker", "console", "build", "deepspeed")),
    # issue 47: the swap directory's room, a check of the model's state, folded into model_checks
    FormerModule("lightning_zero.config.offload_checks", ("lightning_zero.config.model_checks",)),
    # issue 47's leaf: the usage error every layer raises (issue 42 put it at core/'s root)
    FormerModule(f"{_CORE}.errors", (f"{_CORE}.common.errors",)),
    # issue 47's order: the experts' reducers extend ZeRO's reducer, so they sit beside it (partition stays below)
    FormerModule(f"{_CORE}.experts.reducers", (f"{_CORE}.zero.partitioned_reducer",)),
    # issue 47's parallel/: expert parallelism an apply beside the others (issue 44 put it in moe/)
    FormerModule("lightning_zero.moe.lightning", ("lightning_zero.parallel.expert",)),
)

_LOSS_SCALER = f"{_CORE}.precision.loss_scaler:LossScaler"
_SCALER_NOTE = "DynamicLossScaler is now LossScaler (it does the static scale too): import LossScaler."
FORMER_NAMES: tuple[FormerName, ...] = (
    FormerName("lightning_zero", "DynamicLossScaler", _LOSS_SCALER, _SCALER_NOTE),
    FormerName(f"{_CORE}.precision.loss_scaler", "DynamicLossScaler", _LOSS_SCALER, _SCALER_NOTE),
    FormerName(f"{_CORE}.offload.store", "OptimizerOffload", "lightning_zero.compat.adapters:optimizer_offload",
               "lightning_zero.core.offload.store.OptimizerOffload is now HostStore ('cpu') / FileStore ('nvme'); "
               "use lightning_zero.core.offload.open_shard_store(config, rank, units, groups, master_dtype)"),
    *(FormerName(f"{_CORE}.offload", name, f"{_CORE}.settings.offload:{name}")
      for name in ("OffloadConfig", "nvme_path_problem", "offload_from_args", "DEFAULT_BUFFER_COUNT",
                   "DEFAULT_MAX_IN_CPU")),
    FormerName("lightning_zero.moe.config", "ExpertParallelConfig", f"{_CORE}.settings.expert:ExpertParallelConfig"),
    *(FormerName(f"{_CORE}.experts", name, f"{_CORE}.zero.partitioned_reducer:{name}")
      for name in ("PartitionedReducer", "make_reducer")),
    FormerName(f"{_CORE}.offload", "OffloadDevice", f"{_CORE}.common.choices:OffloadDevice"),
    *(FormerName(f"{_CORE}.zero", name, f"{_CORE}.{where}:{name}") for name, where in (
        ("DtypePolicy", "settings.precision"), ("ZeroConfig", "settings.zero"), ("NonFinitePolicy", "common.choices"),
        ("StrChoice", "common.choices"), ("ZeroStage", "common.choices"), ("FlatParamGroup", "common.flat_param"),
        ("ModelStateBytes", "common.memory"), ("format_bytes", "common.memory"),
        ("model_state_formula", "common.memory"))),
    *(FormerName("lightning_zero.config.validate", old, f"lightning_zero.config.settings:{new}")
      for old, new in (("zero_config", "zero_settings"), ("offload_config", "offload_settings"),
                       ("import_object", "import_object"))),
    # issue 47's split of config/validate.py (over 500 lines), one concern per module beside it
    *(FormerName("lightning_zero.config.validate", name, f"lightning_zero.config.{where}:{name}")
      for name, where in (("counts", "value_checks"), ("val_check_batches", "value_checks"),
                          ("epoch_problems", "model_checks"), ("nvme_bytes_per_node", "model_checks"),
                          ("offload_name", "describe"), ("count_model_parameters", "describe"),
                          ("run_choices", "describe"), ("describe", "describe"), ("DEFAULT_CHOICES", "describe"),
                          ("gpt_config", "model_zoo"))),
    # issue 47's config/settings_schema.py: the settings groups' schemas and their option enums beside them
    *(FormerName("lightning_zero.config.schema", name, f"lightning_zero.config.settings_schema:{name}")
      for name in ("Collective", "PrecisionName", "PipeSchedule", "LIGHTNING_PRECISION")),
    FormerName("lightning_zero.config.build", "strategy_kwargs", "lightning_zero.config.build:strategy_arguments"),
    FormerName("lightning_zero.config.build", "pipeline_config", "lightning_zero.config.settings:pipeline_settings"),
    FormerName("lightning_zero.deepspeed.strategy_args", "strategy_kwargs",
               "lightning_zero.deepspeed.strategy_args:json_strategy_arguments"),
    FormerName("lightning_zero.sequence_parallel", "StrategySequenceParallel",
               "lightning_zero.parallel.sequence:StrategySequenceParallel"),
    *(FormerName("lightning_zero.lightning", name, f"lightning_zero.parallel.parallelize:{new}")
      for name, new in (("apply_parallelisms", "parallelize"), ("release_parallelisms", "release"))),
    FormerName("lightning_zero.tensor_parallel.vocab", "VocabParallelEmbedding",
               "lightning_zero.tensor_parallel.layers:VocabParallelEmbedding"),
    FormerName("lightning_zero.observability.callbacks", "ZeroModelSummary",
               "lightning_zero.observability.model_summary:ZeroModelSummary"),
    *(FormerName(module, name, f"lightning_zero.compat.adapters:{name}",
                 f"lightning_zero.deepspeed.strategy.{name} is now DeepSpeedConfig.precision_settings(default), the "
                 "JSON's precision node (ZeroPrecision.of(node) builds its plugin)")
      for name in ("precision_plugin_args", "build_precision_plugin")
      for module in ("lightning_zero.deepspeed.strategy", "lightning_zero.deepspeed.strategy_args")),
)

# a method that moved to another class: (module, class, method) -> (the new "module:Class", warning); it warns when
# called (a class attribute cannot warn on look-up)
FORMER_METHODS: dict[tuple[str, str, str], tuple[str, str]] = {
    ("lightning_zero.lightning.strategy", "ZeroStrategy", "from_deepspeed_config"): (
        "lightning_zero.deepspeed.strategy:DeepSpeedZeroStrategy",
        "ZeroStrategy.from_deepspeed_config is deprecated and will be removed in the next release: use "
        "lightning_zero.DeepSpeedZeroStrategy.from_deepspeed_config (same arguments).",
    ),
}
