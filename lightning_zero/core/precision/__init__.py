"""16-bit training inside the core: the fp16 loss scale and the non-finite gradient search, torch only.

Public pieces: ``LossScaler``, ``LossScalerConfig`` (``loss_scaler``),
``first_nonfinite_parameter``, ``NonFiniteGradientError`` (``nonfinite``).
"""
