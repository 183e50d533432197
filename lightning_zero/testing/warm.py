"""What a warm pool worker imports before its first task, imported once by the pool's fork server.

``GlooPool`` forks its workers from a server process that imported this module (multiprocessing's forkserver
with this module preloaded), so every worker starts with Lightning and every public name of lightning_zero
already imported instead of importing them itself (~5 s of CPU per rank, paid once per session instead).
Importing it runs no torch operation and starts no thread: what a fork would not carry over.
"""

from __future__ import annotations


def import_all() -> None:
    """Import Lightning and every public name of lightning_zero (the package imports them lazily: core/lazy.py)."""
    import lightning.pytorch  # noqa: F401 - the imports are the point

    import lightning_zero

    for name in lightning_zero.__all__:
        getattr(lightning_zero, name)


import_all()
