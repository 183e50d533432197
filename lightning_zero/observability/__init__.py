"""What a user watches: the stats callback, the profiler window, the TensorBoard dashboard, progress lines.

Public pieces: ``ZeroStatsMonitor``, ``ZeroModelSummary`` (``model_summary``), ``ProfilerWindow``, ``dashboard_layout``
(``monitoring``), ``ZeroTensorBoardLogger`` (``dashboard``), and the console progress, ``LineProgress``
(``progress``).
"""

from lightning_zero.observability.callbacks import ZeroStatsMonitor
from lightning_zero.observability.dashboard import ZeroTensorBoardLogger
from lightning_zero.observability.model_summary import ZeroModelSummary
from lightning_zero.observability.monitoring import ProfilerWindow, dashboard_layout
from lightning_zero.observability.progress import LineProgress

__all__ = ["LineProgress", "ProfilerWindow", "ZeroModelSummary", "ZeroStatsMonitor", "ZeroTensorBoardLogger",
           "dashboard_layout"]
