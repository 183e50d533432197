"""Lightning glue of the non-finite gradient policy (Note [non-finite policy] in core/precision/nonfinite.py):
skip the step and count it (logged as ``train/nonfinite_skipped_steps``), or raise on every rank."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_zero.core.common.choices import NonFinitePolicy
from lightning_zero.core.precision.nonfinite import NonFiniteGradientError
from lightning_zero.core.zero.engine import ZeroEngine


class NonFiniteGuard:
    """Applies ``ZeroConfig.nonfinite`` once per optimizer step, after the gradients were reduced.

    Args:
        policy: a :class:`NonFinitePolicy` or its string, ``"off"``, ``"skip"`` or ``"raise"``.
    """

    def __init__(self, policy: NonFinitePolicy | str) -> None:
        self.policy = NonFinitePolicy.of(policy, "nonfinite")
        self.skipped = 0  # steps skipped for non-finite gradients in this fit

    def check(self, engine: ZeroEngine, trainer: pl.Trainer | None, fp16: bool) -> bool:
        """Whether the step must be skipped (every rank gets the same answer; a collective unless off).
        fp16 is left to its loss scaler."""
        if self.policy is NonFinitePolicy.OFF or fp16:
            return False
        name = engine.first_nonfinite_gradient()
        if name is None:
            return False
        step = trainer.global_step if trainer is not None else -1
        if self.policy is NonFinitePolicy.RAISE:
            raise NonFiniteGradientError(
                f"Non-finite gradient at optimizer step {step}: the first parameter (module order) with a nan/inf "
                f"reduced gradient is {name!r}. Check the loss and inputs of this step (docs/reliability.md, "
                "'Loss is NaN'); zero.nonfinite=skip skips such steps instead."
            )
        engine.skip_step()
        self.skipped += 1
        rank_zero_warn(f"step {step}: non-finite gradient (first in {name!r}); optimizer step skipped "
                       f"({self.skipped} so far, zero.nonfinite=skip).")
        if trainer is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"train/nonfinite_skipped_steps": float(self.skipped)}, step=step)
        return True
