"""What a user watches: the stats callback, the profiler window, the TensorBoard dashboard, progress lines.

Public pieces: ``ZeroStatsMonitor`` (``callbacks``), ``ProfilerWindow`` (``monitoring``), ``ZeroTensorBoardLogger``
(``dashboard``), and the console progress (``progress``).
"""
