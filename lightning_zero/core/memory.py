"""Former home of ``lightning_zero.core.zero.memory`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.core.zero.memory import (
    ModelStateBytes,
    StorageCounter,
    format_bytes,
    model_state_formula,
    offloaded_model_state,
)

warnings.warn("lightning_zero.core.memory moved to lightning_zero.core.zero.memory"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['ModelStateBytes', 'StorageCounter', 'format_bytes', 'model_state_formula', 'offloaded_model_state']
