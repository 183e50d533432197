"""Former callables whose signature changed: each builds what it built, through the current API, and warns
(``former.py`` names them; they are served only as former names)."""

from __future__ import annotations

from typing import Any


def optimizer_offload(config: Any, rank: int = 0, units: Any = None) -> Any:
    """``core.offload.store.OptimizerOffload(config, rank, units)``: the offloaded store of ``config``'s device."""
    from lightning_zero.core.offload.store import STORES

    if config.optimizer_device not in STORES:
        raise ValueError(f"optimizer_device must be 'cpu' or 'nvme', not {config.optimizer_device!r}.")
    return STORES[config.optimizer_device](config, rank, units)


def precision_plugin_args(ds: Any, default: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """``deepspeed.strategy_args.precision_plugin_args``: the JSON's precision as ``(mode, keyword arguments)``
    (now its node, ``DeepSpeedConfig.precision_settings``)."""
    node = ds.precision_settings(default)
    if node is None:
        return None
    kwargs = {k: v for k, v in (("loss_scaler", node.loss_scaler), ("reduce_dtype", node.reduce_dtype),
                                ("grad_accum_dtype", node.grad_accum_dtype)) if v is not None}
    return str(node.mode), kwargs


def build_precision_plugin(ds: Any, default: str | None = None) -> Any:
    """``deepspeed.strategy_args.build_precision_plugin``: the plugin of the JSON's precision node (``None``: none)."""
    from lightning_zero.lightning.precision import ZeroPrecision

    node = ds.precision_settings(default)
    return None if node is None else ZeroPrecision.of(node)
