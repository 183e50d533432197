"""Former home of ``lightning_zero.core.zero.engine`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.core.zero.engine import SelfReducingOptimizer, ZeroEngine

warnings.warn("lightning_zero.core.engine moved to lightning_zero.core.zero.engine"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['SelfReducingOptimizer', 'ZeroEngine']
