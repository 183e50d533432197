"""A DeepSpeed JSON as :class:`~lightning_zero.ZeroStrategy`'s constructor arguments (its settings tree), with the
caller's keyword arguments: what ``DeepSpeedZeroStrategy.from_deepspeed_config`` passes on (``strategy.py``).

A setting given both in the JSON and as a keyword argument must be equal, else ``ValueError`` lists every conflict
(the precedence table is in ``docs/deepspeed_config.md``); what the Trainer decides is checked later, in the
strategy's ``setup``, with the same :func:`strategy_conflict` lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from lightning.pytorch.plugins.precision import Precision

from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.precision import PrecisionConfig
from lightning_zero.core.settings.rules import check_settings
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import ParallelSettings, Settings
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.deepspeed.config import DeepSpeedConfig, json_keys
from lightning_zero.deepspeed.pipeline import merged_pipeline
from lightning_zero.lightning.precision import ZeroPrecision


def _shown(value: Any) -> str:
    """A value for an error message: never an ``<... object at 0x...>`` repr."""
    if isinstance(value, Precision):
        return repr(str(getattr(value, "precision", type(value).__name__)))
    text = repr(value)
    return f"a {type(value).__name__}" if " object at 0x" in text else text


def strategy_conflict(ds: DeepSpeedConfig, setting: str, json_value: Any, other: str, other_value: Any) -> str:
    """The line of a ``conflicting settings`` error: the JSON's key and value, and the other place's."""
    key = ds.given.get(setting, setting)
    said = f"{key}=true (precision={json_value!r})" if setting == "precision.name" else f"{key}={json_value!r}"
    return f"the DeepSpeed config {ds.source} sets {said}, but {other}={_shown(other_value)}. Set it in one place."


def json_strategy_arguments(ds: DeepSpeedConfig, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``ZeroStrategy`` keyword arguments from the JSON and the caller's ``overrides``: the settings tree
    (``settings=``: the JSON's, with the caller's settings over it where the JSON sets nothing) and the
    caller's other arguments as they are.

    ``overrides`` are ``ZeroStrategy`` arguments: ``settings=`` (a whole tree: every value counts as set, as the
    Hydra route passes it), ``config=`` (a ``ZeroConfig``: every field counts as set), ``ZeroConfig`` fields
    (``stage=``, ``reduce_bucket_size=``, ...), ``precision=`` / ``precision_plugin=``, ``offload=``,
    ``pipeline=``, ``tensor_parallel=``, ``sequence_parallel=``, ``expert_parallel=``, ``checkpoint_format=``, and
    the rest
    (``check_step_errors``, ``process_group_backend``, ...) as is.

    Raises:
        ValueError: a setting given both here and in the JSON with different values (all listed), or a rule of the
            settings tree broken (named as the JSON's keys).
    """
    rest = dict(overrides)
    base: Settings | None = rest.pop("settings", None)
    names = [f.name for f in fields(ZeroConfig)]
    user: dict[str, Any] = {}
    config = rest.pop("config", None) or (base.zero if base is not None else None)
    if config is not None:
        user = {n: getattr(config, n) for n in names}
    for name in names:
        if name in rest:
            user[name] = rest.pop(name)
    problems = [strategy_conflict(ds, f"zero.{n}", getattr(ds.zero, n), n, v) for n, v in user.items()
                if f"zero.{n}" in ds.given and getattr(ds.zero, n) != v]
    precision, plugin = rest.pop("precision", None), rest.pop("precision_plugin", None)
    if isinstance(precision, Precision):  # ZeroStrategy(precision=ZeroPrecision(...)) passes the plugin itself
        if plugin is not None:
            raise ValueError("pass the precision plugin once: `precision=` or `precision_plugin=`, not both.")
        precision, plugin = None, precision
    mine = base.precision if base is not None else None  # the caller's precision node, if any
    wanted = getattr(plugin, "precision", None) if plugin is not None else (
        precision if precision is not None else (str(mine.mode) if mine is not None else None))
    if ds.precision is not None and wanted is not None and str(wanted) != ds.precision:
        problems.append(strategy_conflict(ds, "precision.name", ds.precision,
                                          "precision_plugin.precision" if plugin is not None else "precision", wanted))
    if problems:
        raise ValueError("conflicting settings:\n  - " + "\n  - ".join(problems))
    offload = rest.pop("offload", None) or (base.offload if base is not None else None)
    if offload is not None and ds.offload.enabled and offload != ds.offload:
        raise ValueError("conflicting settings:\n  - "
                         + strategy_conflict(ds, "offload", ds.offload, "offload", offload))
    if offload is None or not offload.enabled:
        offload = ds.offload
    user_pipeline = rest.pop("pipeline", None) or (base.parallel.pipeline if base is not None else None)
    pipeline = merged_pipeline(ds.pipeline, ds.batch, user_pipeline, ds.source)
    sequence = rest.pop("sequence_parallel", None) or (base.parallel.sequence if base is not None else None)
    if "sequence_parallel.size" in ds.given:
        if sequence not in (None, ds.sequence_parallel):
            raise ValueError("conflicting settings:\n  - " + strategy_conflict(
                ds, "sequence_parallel.size", ds.sequence_parallel, "sequence_parallel", sequence))
        sequence = ds.sequence_parallel
    user_tp = rest.pop("tensor_parallel", None) or (base.parallel.tensor if base is not None else None)
    tensor = TensorParallelConfig.coerce(user_tp)
    if "tensor_parallel.size" in ds.given:  # autotp_size; the user's TensorParallelConfig (plan) kept when it agrees
        if user_tp is not None and tensor.size not in (1, ds.tensor_parallel):
            raise ValueError("conflicting settings:\n  - " + strategy_conflict(
                ds, "tensor_parallel.size", ds.tensor_parallel, "tensor_parallel", user_tp))
        tensor = replace(tensor, size=ds.tensor_parallel)
    user_ep = rest.pop("expert_parallel", None) or (base.parallel.expert if base is not None else None)
    expert = ExpertParallelConfig.coerce(user_ep)
    if "expert_parallel.size" in ds.given:  # autoep_size
        if expert is not None and expert.size != ds.expert_parallel:
            raise ValueError("conflicting settings:\n  - " + strategy_conflict(
                ds, "expert_parallel.size", ds.expert_parallel, "expert_parallel", user_ep))
        expert = ExpertParallelConfig(ds.expert_parallel)
    scaler = rest.pop("loss_scaler", None)
    json_node = ds.precision_settings(default=precision if isinstance(precision, str) else (
        str(mine.mode) if mine is not None else None))
    if isinstance(plugin, ZeroPrecision):
        mine = plugin.settings  # the caller's plugin object is the strategy's precision
    elif json_node is not None:
        mine = json_node
    elif isinstance(precision, str):
        mine = PrecisionConfig(precision, scaler)
    settings = Settings(
        zero=replace(ds.zero, **{n: v for n, v in user.items() if f"zero.{n}" not in ds.given}),
        offload=offload,
        parallel=ParallelSettings(pipeline, tensor, sequence or 1, expert),
        precision=mine if plugin is None or isinstance(plugin, ZeroPrecision) else None,
        checkpoint_format=rest.pop("checkpoint_format", base.checkpoint_format if base is not None else "auto"),
    )
    check_settings(settings, json_keys(ds))
    return {**rest, "settings": settings, "precision_plugin": plugin}
