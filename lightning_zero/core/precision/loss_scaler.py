"""fp16 loss scaling with DeepSpeed's semantics and config names.

Note [loss-scale semantics]
    DeepSpeed 0.19's ``DynamicLossScaler.update_scale`` rule, step by step. The scaler counts
    every optimizer step it is told about (``iteration``, from 0, clean or not; the last overflow
    starts at -1). On an overflowing step the step is skipped by the caller; here either one
    hysteresis credit is spent (scale kept) or, when the credits are down to one, the scale halves
    (never below ``min_loss_scale``; at the minimum, raise when ``raise_at_min_scale``). On a clean
    step the credits refill at once with ``consecutive_hysteresis``; and when
    ``stable = iteration - last_overflow - 1`` (the clean steps before this one since the last
    overflow) is positive and a multiple of ``loss_scale_window`` the scale doubles (and, without
    ``consecutive_hysteresis``, the credits refill then): with a window of 2 the scale first
    doubles on the third clean step. A static scale (``loss_scale > 0``) never changes and ignores
    the dynamic knobs, but overflowing steps are still skipped: stepping on inf would destroy the
    weights.

The scaler itself does no communication; :func:`any_rank` is how callers agree on an overflow.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.precision import LossScalerConfig


class MinLossScaleError(RuntimeError):
    """fp16 gradients overflowed although the loss scale is already at its minimum."""


class LossScaler:
    """The loss scale of fp16 training, static or dynamic, and its update rule (Note [loss-scale semantics]).

    Usage per optimizer step: multiply the loss by :attr:`scale` before backward, divide the
    gradients by it, agree on ``overflow`` across ranks, skip the step when it is true, and call
    :meth:`update` once with it.

    Args:
        config: the policy; ``config.loss_scale > 0`` makes the scale static.
    """

    def __init__(self, config: LossScalerConfig | None = None) -> None:
        self.config = config or LossScalerConfig()
        c = self.config
        self.scale: float = float(c.loss_scale) if not c.dynamic else float(2.0**c.initial_scale_power)
        self.hysteresis_left: int = c.hysteresis  # overflows still tolerated before the scale halves
        self.iteration: int = 0  # steps seen (clean or overflowing)
        self.last_overflow_iteration: int = -1
        self.overflows: int = 0  # steps skipped because of an overflow
        self._warned_at_min = False

    @property
    def dynamic(self) -> bool:
        return self.config.dynamic

    def update(self, overflow: bool) -> None:
        """Advance by one optimizer step, clean (``overflow`` false) or skipped."""
        c = self.config
        if overflow:
            self.overflows += 1
            if c.dynamic:
                self._on_overflow()
        elif c.dynamic:
            if c.consecutive_hysteresis:
                self.hysteresis_left = c.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1  # clean steps before this one
            if stable > 0 and stable % c.loss_scale_window == 0:
                if not c.consecutive_hysteresis:
                    self.hysteresis_left = c.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def _on_overflow(self) -> None:
        c = self.config
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
        else:
            at_min = self.scale <= c.min_loss_scale
            if at_min and c.raise_at_min_scale:
                raise MinLossScaleError(self._min_scale_message())
            if at_min and not self._warned_at_min:
                self._warned_at_min = True
                warnings.warn(self._min_scale_message() + " Training goes on, skipping such steps.", stacklevel=3)
            self.scale = max(self.scale / 2.0, c.min_loss_scale)
        self.last_overflow_iteration = self.iteration

    def _min_scale_message(self) -> str:
        return (
            f"fp16 gradients overflowed (inf/nan) at step {self.iteration} although the loss scale is already at "
            f"its minimum {self.config.min_loss_scale:g}: these gradients do not fit float16. Try "
            "precision='bf16-mixed' (float32's range, no loss scaling), a lower learning rate or gradient clipping, "
            "computing the loss in float32 (e.g. `logits.float()`), or a smaller `min_loss_scale`; with "
            "`raise_at_min_scale=False` such steps are skipped and training goes on."
        )

    def state_dict(self) -> dict[str, Any]:
        """The mutable state (the policy is not saved: it comes from the constructor)."""
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"]) if self.dynamic else float(self.config.loss_scale)
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.overflows = int(state.get("overflows", 0))


def any_rank(flag: bool, comm: DataParallelComm) -> bool:
    """Whether ``flag`` is true on any rank of ``comm`` (an all-reduce MAX; no call at world size 1)."""
    if not comm.active:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=comm.device)
    comm.all_reduce_max(value)
    return bool(value.item() > 0)


def local_sum_of_squares(tensors: Iterable[torch.Tensor]) -> float:
    """Sum of squares (in fp32) of this rank's elements; inf / nan when any element is."""
    parts = [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors if t.numel()]
    return float(torch.stack(parts).square().sum()) if parts else 0.0  # one device sync


def non_finite(value: float) -> bool:
    return not math.isfinite(value)
