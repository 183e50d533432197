"""Former home of ``lightning_zero.observability.monitoring`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.observability.monitoring import (
    MEMORY_KEYS,
    TIME_KEYS,
    ProfilerWindow,
    batch_counts,
    dashboard_layout,
    flatten_hparams,
    log_hyperparams,
    peak_memory_bytes,
    rank_tag,
)

warnings.warn("lightning_zero.monitoring moved to lightning_zero.observability.monitoring"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = [
    'MEMORY_KEYS',
    'TIME_KEYS',
    'ProfilerWindow',
    'batch_counts',
    'dashboard_layout',
    'flatten_hparams',
    'log_hyperparams',
    'peak_memory_bytes',
    'rank_tag',
]
