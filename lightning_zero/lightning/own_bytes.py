"""Former path of ``own_bytes`` (now ``lightning_zero.checkpoint.tensor_file``), kept for one release: it warns.

It moved beside the checkpoint writers that use it, so that ``checkpoint/`` imports nothing from ``lightning/``
and ``lightning/__init__`` can name the strategy without an import cycle through it.
"""


def __getattr__(name: str) -> object:
    import warnings

    from lightning_zero.checkpoint import tensor_file as own_bytes

    if name.startswith("_") or not hasattr(own_bytes, name):
        raise AttributeError(f"module 'lightning_zero.lightning.own_bytes' has no attribute {name!r}")
    warnings.warn(f"lightning_zero.lightning.own_bytes.{name} moved to lightning_zero.checkpoint.tensor_file.{name}; "
                  "import from there (this path goes away in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(own_bytes, name)
