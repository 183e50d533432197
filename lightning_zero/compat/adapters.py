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
