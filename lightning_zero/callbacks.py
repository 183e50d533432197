"""Former home of ``lightning_zero.observability.callbacks`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.observability.callbacks import ZeroStatsMonitor, add_monitor
from lightning_zero.observability.model_summary import ZeroModelSummary

warnings.warn("lightning_zero.callbacks moved to lightning_zero.observability.callbacks"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['ZeroModelSummary', 'ZeroStatsMonitor', 'add_monitor']
