"""A DeepSpeed JSON as :class:`~lightning_zero.ZeroStrategy`'s constructor arguments, with the caller's keyword
arguments: what ``DeepSpeedZeroStrategy.from_deepspeed_config`` passes on (``strategy.py``).

A setting given both in the JSON and as a keyword argument must be equal, else ``ValueError`` lists every conflict
(the precedence table is in ``docs/deepspeed_config.md``); what the Trainer decides is checked later, in the
strategy's ``setup``, with the same :func:`strategy_conflict` lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from lightning.pytorch.plugins.precision import Precision

from lightning_zero.core.precision.loss_scaler import LossScalerConfig
from lightning_zero.core.zero.config import ZeroConfig
from lightning_zero.deepspeed.config import DeepSpeedConfig
from lightning_zero.deepspeed.pipeline import merged_pipeline
from lightning_zero.lightning.precision import ZeroPrecision


def precision_plugin_args(ds: DeepSpeedConfig, default: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """``(precision, keyword arguments)`` of the :class:`ZeroPrecision` the JSON asks for (``None``: not set).

    Only what differs from the plugin's own defaults is passed (a default ``LossScalerConfig`` is not).
    ``default`` is the precision to use when the JSON sets only dtypes (else ``"32-true"``).
    """
    kwargs: dict[str, Any] = {}
    if ds.loss_scaler is not None and ds.loss_scaler != LossScalerConfig():
        kwargs["loss_scaler"] = ds.loss_scaler
    if ds.reduce_dtype is not None:
        kwargs["reduce_dtype"] = ds.reduce_dtype
    if ds.grad_accum_dtype is not None:
        kwargs["grad_accum_dtype"] = ds.grad_accum_dtype
    if ds.precision is None and not kwargs:
        return None
    return ds.precision or default or "32-true", kwargs


def build_precision_plugin(ds: DeepSpeedConfig, default: str | None = None) -> ZeroPrecision | None:
    """The one place a DeepSpeed config's precision plugin is built (``None``: the JSON sets no precision)."""
    args = precision_plugin_args(ds, default)
    return None if args is None else ZeroPrecision(args[0], **args[1])


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


def strategy_kwargs(ds: DeepSpeedConfig, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``ZeroStrategy`` keyword arguments from the JSON and the caller's ``overrides``.

    ``overrides`` are ``ZeroStrategy`` arguments: ``config=`` (a ``ZeroConfig``: every field counts as
    set), ``ZeroConfig`` fields (``stage=``, ``reduce_bucket_size=``, ...), ``precision=`` /
    ``precision_plugin=``, and the rest (``check_step_errors``, ``process_group_backend``, ...) as is.

    Raises:
        ValueError: a setting given both here and in the JSON with different values (all listed).
    """
    rest = dict(overrides)
    names = [f.name for f in fields(ZeroConfig)]
    user: dict[str, Any] = {}
    base = rest.pop("config", None)
    if base is not None:
        user = {n: getattr(base, n) for n in names}
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
    wanted = getattr(plugin, "precision", None) if plugin is not None else precision
    if ds.precision is not None and wanted is not None and str(wanted) != ds.precision:
        problems.append(strategy_conflict(ds, "precision.name", ds.precision,
                                  "precision_plugin.precision" if plugin is not None else "precision", wanted))
    if problems:
        raise ValueError("conflicting settings:\n  - " + "\n  - ".join(problems))
    offload = rest.pop("offload", None)
    if offload is not None and ds.offload.enabled and offload != ds.offload:
        raise ValueError("conflicting settings:\n  - "
                         + strategy_conflict(ds, "offload", ds.offload, "offload", offload))
    if offload is None or not offload.enabled:
        offload = ds.offload
    rest["pipeline"] = merged_pipeline(ds.pipeline, ds.batch, rest.get("pipeline"), ds.source)
    if "sequence_parallel.size" in ds.given:
        if rest.get("sequence_parallel", ds.sequence_parallel) != ds.sequence_parallel:
            raise ValueError("conflicting settings:\n  - " + strategy_conflict(
                ds, "sequence_parallel.size", ds.sequence_parallel, "sequence_parallel", rest["sequence_parallel"]))
        rest["sequence_parallel"] = ds.sequence_parallel
    if "tensor_parallel.size" in ds.given:  # autotp_size; the user's TensorParallelConfig (plan) kept when it agrees
        user_tp = rest.get("tensor_parallel")
        size = user_tp if isinstance(user_tp, int) or user_tp is None else user_tp.size
        if user_tp is not None and size != ds.tensor_parallel:
            raise ValueError("conflicting settings:\n  - " + strategy_conflict(
                ds, "tensor_parallel.size", ds.tensor_parallel, "tensor_parallel", user_tp))
        rest["tensor_parallel"] = user_tp if user_tp is not None else ds.tensor_parallel
    if "expert_parallel.size" in ds.given:  # autoep_size
        user_ep = rest.get("expert_parallel")
        if user_ep is not None and (user_ep if isinstance(user_ep, int) else user_ep.size) != ds.expert_parallel:
            raise ValueError("conflicting settings:\n  - " + strategy_conflict(
                ds, "expert_parallel.size", ds.expert_parallel, "expert_parallel", user_ep))
        rest["expert_parallel"] = user_ep if user_ep is not None else ds.expert_parallel
    zero = replace(ds.zero, **{n: v for n, v in user.items() if f"zero.{n}" not in ds.given})
    if plugin is None:
        plugin = build_precision_plugin(ds, default=precision)
    return {**rest, "config": zero, "precision": None if plugin is not None else precision,
            "precision_plugin": plugin, "offload": offload}
