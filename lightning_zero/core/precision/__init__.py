"""16-bit training inside the core: the fp16 loss scale and the non-finite gradient search, torch only.

Public pieces: ``LossScaler``, ``LossScalerConfig``, ``MinLossScaleError`` (``loss_scaler``),
``first_nonfinite_parameter``, ``NonFiniteGradientError`` (``nonfinite``).
"""

from lightning_zero.core.precision.loss_scaler import LossScaler, MinLossScaleError
from lightning_zero.core.precision.nonfinite import NonFiniteGradientError, first_nonfinite_parameter
from lightning_zero.core.settings.precision import LossScalerConfig

__all__ = ["LossScaler", "LossScalerConfig", "MinLossScaleError", "NonFiniteGradientError",
           "first_nonfinite_parameter"]
