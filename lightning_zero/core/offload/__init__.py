"""Where optimizer and parameter shards live when not on the device: host memory or run-private swap files.

Public pieces: ``OffloadConfig`` (``config``), ``OptimizerOffload`` (``store``), stage 3's parameter offload
(``param_offload``), the swap file (``swap_file``) and the CUDA copy fence (``copy_fence``).
"""
