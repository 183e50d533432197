"""The precision and offload options the estimator and the advisor accept."""

from __future__ import annotations

from lightning_zero.core.common.memory import OFFLOAD_STAGES

# user spelling -> (formula precision of model_state_formula, Hydra `precision/` option)
PRECISIONS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "32-true": ("fp32", "fp32"),
    "mixed": ("mixed", "bf16"),
    "bf16-mixed": ("mixed", "bf16"),
    "bf16": ("mixed", "bf16"),
    "16-mixed": ("mixed", "fp16"),
    "fp16": ("mixed", "fp16"),
    "bf16-true": ("bf16-true", "bf16_true"),
    "bf16_true": ("bf16-true", "bf16_true"),
}
OFFLOADS: tuple[str, ...] = tuple(OFFLOAD_STAGES)


def formula_precision(precision: str) -> str:
    """The :func:`~lightning_zero.core.common.memory.model_state_formula` precision of a user spelling."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision][0]
