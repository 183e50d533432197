"""The precision node of the settings tree: the mode, fp16's loss-scaler policy and the gradient dtypes
(``PrecisionConfig``), and the dtypes of the engine's flat buffers that a mode amounts to (``DtypePolicy``).

The Lightning plugin, :class:`~lightning_zero.ZeroPrecision`, is built from a ``PrecisionConfig``; the Hydra
``precision/`` group and DeepSpeed's ``fp16`` / ``bf16`` / ``data_types`` sections translate into one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_zero.core.common.choices import PrecisionMode

_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
COMPUTE_DTYPE = {PrecisionMode.FP32: torch.float32, PrecisionMode.FP16_MIXED: torch.float16,
                 PrecisionMode.BF16_MIXED: torch.bfloat16, PrecisionMode.BF16_TRUE: torch.bfloat16}


def as_float_dtype(value: torch.dtype | str | None, what: str) -> torch.dtype | None:
    """``value`` as a floating ``torch.dtype`` (``None`` stays ``None``), or a ValueError naming the fix."""
    if value is None:
        return None
    dtype = _DTYPE_NAMES.get(value.removeprefix("torch.")) if isinstance(value, str) else value
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"`{what}` must be a floating dtype: 'float32', 'float16' or 'bfloat16' (or torch.float32, "
                         f"torch.float16, torch.bfloat16), got {value!r}.")
    return dtype


@dataclass(frozen=True)
class LossScalerConfig:
    """DeepSpeed's ``fp16`` loss-scaler keys (docs/precision.md).

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
        # DeepSpeed's checks: the scale must be a finite number >= 0 and min_loss_scale finite, always;
        # the dynamic-only knobs are checked only when the scale is dynamic (a static scale ignores them).
        if isinstance(self.loss_scale, bool) or not math.isfinite(self.loss_scale) or self.loss_scale < 0:
            raise ValueError(f"`loss_scale` must be a finite number: 0 (dynamic) or a positive fixed scale, got "
                             f"{self.loss_scale!r}.")
        if not math.isfinite(self.min_loss_scale):
            raise ValueError(f"`min_loss_scale` must be a finite number, got {self.min_loss_scale!r}.")
        if not self.dynamic:
            return
        if not 0 <= self.initial_scale_power <= 63:
            raise ValueError(f"`initial_scale_power` must be in [0, 63], got {self.initial_scale_power!r}.")
        if self.loss_scale_window < 1:
            raise ValueError(f"`loss_scale_window` must be >= 1 step with dynamic loss scaling (loss_scale=0), "
                             f"got {self.loss_scale_window!r}.")
        if self.hysteresis < 1:
            raise ValueError(f"`hysteresis` must be >= 1 with dynamic loss scaling (loss_scale=0), got "
                             f"{self.hysteresis!r}.")
        if not self.min_loss_scale > 0:
            raise ValueError(f"`min_loss_scale` must be positive with dynamic loss scaling (loss_scale=0), got "
                             f"{self.min_loss_scale!r}.")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class PrecisionConfig:
    """The training precision (docs/precision.md).

    Args:
        mode: ``"32-true"``, ``"16-mixed"`` (fp16 with loss scaling), ``"bf16-mixed"`` or ``"bf16-true"`` (a
            :class:`PrecisionMode`; Lightning's short names ``"32"``, ``"16"``, ``"bf16"`` too).
        loss_scaler: fp16's loss-scaler policy (DeepSpeed's keys); ``None``: the default, dynamic from 2**16.
            Only for ``"16-mixed"``.
        reduce_dtype: dtype gradients are reduced in (``None``: the compute dtype).
        grad_accum_dtype: dtype gradients are accumulated in across micro-steps (``None``: the reduce dtype).
    """

    mode: PrecisionMode = PrecisionMode.FP32
    loss_scaler: LossScalerConfig | None = None
    reduce_dtype: torch.dtype | None = None
    grad_accum_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", PrecisionMode.of(self.mode))  # users pass strings
        if self.loss_scaler is not None and not isinstance(self.loss_scaler, LossScalerConfig):
            raise ValueError(f"`loss_scaler` must be a LossScalerConfig, got {type(self.loss_scaler).__name__}.")
        if self.loss_scaler is not None and self.mode is not PrecisionMode.FP16_MIXED:
            raise ValueError(f"A loss scaler (loss_scale, initial_scale_power, hysteresis, ...) applies to fp16 "
                             f"('16-mixed') only, got precision={str(self.mode)!r}: bf16 has fp32's range and needs "
                             "no loss scaling. Fix: drop `loss_scaler`, or use precision='16-mixed'.")
        for name in ("reduce_dtype", "grad_accum_dtype"):  # users pass names
            object.__setattr__(self, name, as_float_dtype(getattr(self, name), name))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the parameters and of forward / backward."""
        return COMPUTE_DTYPE[self.mode]  # type: ignore[index]

    @property
    def scaled(self) -> bool:
        """Whether losses are scaled (fp16)."""
        return self.mode is PrecisionMode.FP16_MIXED


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class DtypePolicy:
    """Dtypes of the flat buffers (see Note [flat shard layout] in ``flat_param.py``).

    Args:
        param_dtype: dtype of the module's parameters and of forward / backward.
        reduce_dtype: dtype gradients are reduced in (``None``: ``param_dtype``).
        master_dtype: dtype of the optimizer's master shard. When equal to ``param_dtype`` the
            master shard is a view of the parameter buffer, never a second copy.
        accum_dtype: dtype the reduced gradients are kept and accumulated in across micro-steps
            (DeepSpeed's ``grad_accum_dtype``; ``None``: the reduce dtype).

    Note [gradient dtypes]
        Autograd produces gradients in ``param_dtype``; they are added into buffers of
        ``grad_accum_dtype`` and reduced in ``grad_dtype`` (a bucket is cast for the collective
        when the two differ). The optimizer sees them in ``master_dtype``: when that differs from
        ``grad_accum_dtype`` (mixed precision) the master's gradient is a transient copy made by
        ``ZeroEngine.prepare_step`` and freed by the step.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    accum_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "master_dtype", "accum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(f"`{name}` must be a floating dtype (torch.float32, torch.float16 or "
                                 f"torch.bfloat16), got {value!r}.")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in."""
        return self.reduce_dtype or self.param_dtype

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        """The dtype the reduced gradient buffers (whole or shard) are kept in."""
        return self.accum_dtype or self.grad_dtype

    @property
    def master_is_param_view(self) -> bool:
        return self.master_dtype == self.param_dtype

    @property
    def master_grad_is_view(self) -> bool:
        """Whether the optimizer can step on the reduced gradient buffers without a cast copy."""
        return self.master_dtype == self.grad_accum_dtype
