"""``ZeroStrategy``'s constructor arguments as the settings tree: the keyword route in (Note [one settings tree] in
``core/settings/tree.py``).

It translates and nothing more: each node checks its own values, :func:`~lightning_zero.core.settings.rules.
check_settings` the rules across nodes, named as the strategy's keywords (:data:`KEYWORDS`); what is left here
are the arguments' own shapes (a setting given twice, by a shortcut and by a node). Bad input is refused before
any process starts, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.plugins.precision import Precision

from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.offload import OffloadConfig, offload_from_args
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.precision import LossScalerConfig, PrecisionConfig
from lightning_zero.core.settings.rules import check_settings
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import ParallelSettings, Settings
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.lightning.precision import ZeroPrecision

# the settings tree's keys as ZeroStrategy's keywords write them (Note [one rule, many spellings])
KEYWORDS = {
    "zero.stage": "stage",
    "offload.optimizer_device": "offload_optimizer",
    "offload.param_device": "offload_param",
    "offload.nvme_path": "nvme_path",
    "parallel.pipeline": "PipelineConfig.stages",
    "parallel.tensor": "tensor_parallel",
    "parallel.sequence": "sequence_parallel",
    "parallel.expert": "expert_parallel",
    "pipeline.reduce_per_micro_batch": "PipelineConfig.reduce_per_micro_batch",
}


@dataclass(frozen=True)
class StrategyArguments:
    """What ``ZeroStrategy``'s arguments amount to: the settings tree and the precision plugin the strategy starts
    with (``None``: the Trainer's, converted at setup)."""

    settings: Settings
    precision_plugin: Precision | None


def strategy_arguments(
    stage: int,
    zero_options: dict[str, Any],
    *,
    settings: Settings | None,
    config: ZeroConfig | None,
    precision: str | ZeroPrecision | None,
    loss_scaler: LossScalerConfig | None,
    precision_plugin: Precision | None,
    checkpoint_format: str,
    pipeline: PipelineConfig | None,
    offload: OffloadConfig | None,
    offload_optimizer: str | None,
    offload_param: str | None,
    nvme_path: str | None,
    tensor_parallel: int | TensorParallelConfig | None,
    sequence_parallel: int,
    expert_parallel: int | ExpertParallelConfig | None = None,
) -> StrategyArguments:
    """The settings tree of ``ZeroStrategy``'s arguments (each as its constructor documents it), checked.

    Raises:
        ValueError: a bad value, a rule across nodes broken (every one, named as the keywords), or a setting given
            both in ``settings`` and as its own argument.
        TypeError: an unknown ``ZeroConfig`` keyword.
    """
    if settings is not None:
        given = {name for name, value in (
            ("config", config), ("precision", precision), ("loss_scaler", loss_scaler), ("pipeline", pipeline),
            ("offload", offload), ("offload_optimizer", offload_optimizer), ("offload_param", offload_param),
            ("nvme_path", nvme_path), ("tensor_parallel", tensor_parallel), ("expert_parallel", expert_parallel))
            if value is not None}
        given |= set(zero_options) | ({"sequence_parallel"} if sequence_parallel != 1 else set())
        given |= {"checkpoint_format"} if checkpoint_format != "auto" else set()
        if given:
            raise ValueError(f"Pass either `settings=` (the whole settings tree) or {sorted(given)}, not both.")
    else:
        settings = Settings(
            zero=config or ZeroConfig.from_kwargs(stage, zero_options),
            offload=offload_from_args(offload, offload_optimizer, offload_param, nvme_path),
            parallel=ParallelSettings(pipeline, TensorParallelConfig.coerce(tensor_parallel), sequence_parallel,
                                      ExpertParallelConfig.coerce(expert_parallel)),
            precision=_precision_settings(precision, loss_scaler, precision_plugin),
            checkpoint_format=checkpoint_format,
        )
    check_settings(settings, KEYWORDS)
    settings.offload.check_path()
    return StrategyArguments(settings, _plugin(precision, precision_plugin, settings.precision))


def _precision_settings(precision: str | ZeroPrecision | None, loss_scaler: LossScalerConfig | None,
                        plugin: Precision | None) -> PrecisionConfig | None:
    """``precision=`` / ``loss_scaler=`` / ``precision_plugin=`` as the precision node (``None``: the Trainer's)."""
    if isinstance(precision, ZeroPrecision):
        if loss_scaler is not None:
            raise ValueError("Pass `loss_scaler` to the ZeroPrecision instance, not to the strategy.")
        if plugin is not None:
            raise ValueError("pass the precision plugin once: `precision=` or `precision_plugin=`, not both.")
        return precision.settings
    if precision is not None:
        return PrecisionConfig(precision, loss_scaler)
    if loss_scaler is not None:
        raise ValueError("`loss_scaler` needs precision='16-mixed' on the strategy.")
    return plugin.settings if isinstance(plugin, ZeroPrecision) else None


def _plugin(precision: str | ZeroPrecision | None, plugin: Precision | None,
            node: PrecisionConfig | None) -> Precision | None:
    """The plugin the strategy starts with: the one given, else the precision node's (``None``: the Trainer's)."""
    if isinstance(precision, ZeroPrecision):
        return precision
    if plugin is not None:
        if isinstance(plugin, ZeroPrecision) and node is not None and plugin.settings != node:
            raise ValueError(f"the precision plugin ({plugin.settings}) differs from the settings' precision "
                             f"({node}): pass the precision once.")
        return plugin
    return ZeroPrecision.of(node) if node is not None else None
