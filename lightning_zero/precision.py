"""Precision plugins of :class:`~lightning_zero.ZeroStrategy`.

Gradient clipping has to see every shard, so the plugin hands clipping to the ZeRO engine
(global norm across ranks) instead of clipping the module's parameters locally.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.engine import ZeroEngine

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true"]
_NOT_YET = ("16-mixed", "bf16-mixed", "bf16-true", "16-true")


class ZeroPrecision(Precision):
    """Full fp32 training under ZeRO.

    Args:
        precision: ``"32-true"``. The 16-bit modes are not implemented yet and raise.
    """

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision in ("32", "32-true"):
            precision = "32-true"
        elif precision in _NOT_YET or precision in ("16", "bf16"):
            raise NotImplementedError(
                f"precision={precision!r} is not implemented in lightning_zero yet (16-bit weights with fp32 "
                "master shards and fp16 loss scaling are planned). Use precision='32-true'."
            )
        else:
            raise ValueError(
                f"Unknown precision {precision!r} for ZeroStrategy. Use one of '32-true', '16-mixed', "
                "'bf16-mixed', 'bf16-true'."
            )
        self.precision: str = precision
        self.engine: ZeroEngine | None = None  # set by the strategy when fitting

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.engine.clip_grad_norm_(float(clip_val))
        return None

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.engine is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        self.engine.clip_grad_value_(float(clip_val))
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}


def to_zero_precision(plugin: Precision | None) -> ZeroPrecision:
    """Convert a stock Lightning precision plugin (as the Trainer selects it) to ours."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin or ZeroPrecision()
    name = getattr(plugin, "precision", None)
    if name is None or type(plugin) not in _stock_plugins():
        raise ValueError(
            f"ZeroStrategy cannot use the precision plugin {type(plugin).__name__}. Pass `precision=` to the Trainer "
            "or a `lightning_zero.ZeroPrecision` instance."
        )
    return ZeroPrecision(name)


def _stock_plugins() -> tuple[type, ...]:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    return (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
