"""Former home of ``lightning_zero.observability.progress`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.observability.progress import (
    LineProgress,
)

warnings.warn("lightning_zero.progress moved to lightning_zero.observability.progress"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['LineProgress']
