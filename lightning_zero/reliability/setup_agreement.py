"""The settings ``ZeroStrategy`` asks the ranks to agree on at setup, besides the model itself
(compared by one hash before the first collective: Note [setup agreement] in core/comm/agreement.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

from lightning_zero.core.settings.tree import Settings

PER_NODE = frozenset({"trainer.node_rank", "trainer.rdzv_endpoint"})  # config keys that differ between nodes


def setup_settings(settings: Settings, precision: Precision, resolved_config: Mapping[str, Any] | None,
                   trainer: pl.Trainer) -> dict[str, str]:
    """What must agree across ranks besides the model (Note [setup agreement] in core/comm/agreement.py):
    the ZeRO node of ``settings``, the ``precision`` plugin's mode, the Trainer's step settings and the resolved
    config the CLI ran."""
    out = {f"zero.{k}": repr(v) for k, v in vars(settings.zero).items()}
    out["precision"] = str(precision.precision)
    for key in ("accumulate_grad_batches", "gradient_clip_val", "max_steps", "max_epochs"):
        out[f"trainer.{key}"] = repr(getattr(trainer, key, None))
    out.update({f"config.{k}": v for k, v in _flat(resolved_config or {}).items() if k not in PER_NODE})
    return out


def _flat(node: Any, prefix: str = "") -> dict[str, str]:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): repr(node)}
    return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
