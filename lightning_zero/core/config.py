"""Former home of ``lightning_zero.core.zero.config`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.core.zero.config import DtypePolicy, ZeroConfig

warnings.warn("lightning_zero.core.config moved to lightning_zero.core.zero.config"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['DtypePolicy', 'ZeroConfig']
