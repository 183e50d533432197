"""What a user watches: the stats callback, the profiler window, the TensorBoard dashboard, progress lines.

Public pieces: ``ZeroStatsMonitor``, ``ZeroModelSummary`` (``model_summary``), ``ProfilerWindow``, ``dashboard_layout``
(``monitoring``), ``ZeroTensorBoardLogger`` (``dashboard``), and the console progress, ``LineProgress``
(``progress``). They are imported on first use (Note [lazy package names] in ``core/lazy.py``): the config
schema reads ``ProfilerWindow`` without Lightning.
"""

from lightning_zero.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "lightning_zero.observability.callbacks": ("ZeroStatsMonitor",),
        "lightning_zero.observability.dashboard": ("ZeroTensorBoardLogger",),
        "lightning_zero.observability.model_summary": ("ZeroModelSummary",),
        "lightning_zero.observability.monitoring": ("ProfilerWindow", "dashboard_layout"),
        "lightning_zero.observability.progress": ("LineProgress",),
    },
)
