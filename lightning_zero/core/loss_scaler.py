"""fp16 loss scaling with DeepSpeed's semantics and config names.

Only the policy lives here so far; the scaler itself is built with the precision plugins.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossScalerConfig:
    """DeepSpeed's ``fp16`` loss-scaler keys (``../shared/design-notes.md``).

    Args:
        loss_scale: 0 = dynamic loss scaling; > 0 = this fixed scale.
        initial_scale_power: the dynamic scale starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps (counted from the last overflow) before the scale doubles.
        hysteresis: overflows tolerated (credits) before the scale halves.
        consecutive_hysteresis: refill the credits on every clean step (else when the scale grows).
        min_loss_scale: the dynamic scale never goes below this.
        raise_at_min_scale: when an overflow happens at ``min_loss_scale`` raise (with what to try)
            instead of skipping the step and training on.
    """

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_at_min_scale: bool = False

    def __post_init__(self) -> None:
        if self.loss_scale < 0:
            raise ValueError(f"`loss_scale` must be 0 (dynamic) or a positive fixed scale, got {self.loss_scale!r}.")
        if self.loss_scale_window < 1:
            raise ValueError(f"`loss_scale_window` must be >= 1 step, got {self.loss_scale_window!r}.")
        if self.hysteresis < 1:
            raise ValueError(f"`hysteresis` must be >= 1, got {self.hysteresis!r}.")
        if not self.min_loss_scale > 0:
            raise ValueError(f"`min_loss_scale` must be positive, got {self.min_loss_scale!r}.")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0
