"""Former home of ``lightning_zero.core.precision.loss_scaler`` (moved in 0.2): importing it from
here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.core.precision.loss_scaler import (
              LossScaler,
              LossScalerConfig,
              MinLossScaleError,
              any_rank,
              local_sum_of_squares,
              non_finite,
)

warnings.warn("lightning_zero.core.loss_scaler moved to lightning_zero.core.precision.loss_scaler"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['LossScaler', 'LossScalerConfig', 'MinLossScaleError', 'any_rank', 'local_sum_of_squares', 'non_finite']
