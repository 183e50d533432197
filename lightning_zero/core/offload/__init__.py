"""Where optimizer and parameter shards live when not on the device: host memory or run-private swap files.

Public pieces: ``OffloadConfig`` (``config``), ``OptimizerOffload`` (``store``), stage 3's parameter offload
(``param_offload``), the swap file (``swap_file``) and the CUDA copy fence (``copy_fence``).
"""


def __getattr__(name: str) -> object:
    """``lightning_zero.core.offload`` was a module (``OffloadConfig``, ``nvme_path_problem``, ...) before it became
    this folder: its names still resolve for one release, with a warning saying where they moved."""
    import warnings

    from lightning_zero.core.offload import config

    if name.startswith("_") or not hasattr(config, name):
        raise AttributeError(f"module 'lightning_zero.core.offload' has no attribute {name!r}")
    warnings.warn(f"lightning_zero.core.offload.{name} moved to lightning_zero.core.offload.config.{name}; import "
                  "from there (this path goes away in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(config, name)
