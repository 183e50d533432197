"""The fp16 loss scaler against hand-worked sequences of clean (C) and overflowing (O) steps.

Each row is ``(step kind, scale after the step, hysteresis credits after the step)``, worked out by
hand from the rule in ``docs/precision.md`` (DeepSpeed's): iterations count from 0, the
last overflow starts at -1, and a clean step doubles the scale when ``(iteration - last overflow)``
is a multiple of the window.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.loss_scaler import (
    DynamicLossScaler,
    LossScalerConfig,
    MinLossScaleError,
    any_rank,
    local_sum_of_squares,
)

# scale 16, window 3, 2 credits, floor 2
BASE = dict(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0)

REFILL_ON_GROWTH = [  # consecutive_hysteresis=False: credits come back only when the scale grows
    ("C", 16, 2),  # it 0: 0 - (-1) = 1
    ("C", 16, 2),  # it 1: 2
    ("C", 32, 2),  # it 2: 3 % 3 == 0 -> double
    ("O", 32, 1),  # it 3: spend a credit, last overflow = 3
    ("C", 32, 1),  # it 4: 1 since the overflow; no refill
    ("O", 16, 1),  # it 5: one credit left -> halve, last overflow = 5
    ("O", 8, 1),  # it 6: halve again, last overflow = 6
    ("C", 8, 1),  # it 7: 1
    ("C", 8, 1),  # it 8: 2
    ("C", 16, 2),  # it 9: 3 -> double and refill
    ("O", 16, 1),  # it 10: spend
]
REFILL_EVERY_CLEAN_STEP = [  # consecutive_hysteresis=True: any clean step refills the credits
    ("C", 16, 2),
    ("C", 16, 2),
    ("C", 32, 2),  # it 2: double
    ("O", 32, 1),  # it 3: spend, last overflow = 3
    ("C", 32, 2),  # it 4: refilled at once
    ("O", 32, 1),  # it 5: spend again (a credit was there)
    ("O", 16, 1),  # it 6: halve, last overflow = 6
    ("C", 16, 2),  # it 7: refill
    ("C", 16, 2),  # it 8
    ("C", 32, 2),  # it 9: 3 since the overflow -> double
    ("O", 32, 1),  # it 10
]


def _replay(scaler: DynamicLossScaler, rows: list[tuple[str, float, int]]) -> None:
    for i, (kind, scale, credits) in enumerate(rows):
        scaler.update(kind == "O")
        assert (scaler.scale, scaler.hysteresis_left) == (scale, credits), f"after step {i} ({kind})"


@pytest.mark.parametrize(("consecutive", "rows"), [(False, REFILL_ON_GROWTH), (True, REFILL_EVERY_CLEAN_STEP)])
def test_window_growth_and_hysteresis(consecutive: bool, rows: list[tuple[str, float, int]]) -> None:
    scaler = DynamicLossScaler(LossScalerConfig(**BASE, consecutive_hysteresis=consecutive))
    assert (scaler.scale, scaler.hysteresis_left) == (16.0, 2)
    _replay(scaler, rows)
    assert scaler.overflows == sum(kind == "O" for kind, _, _ in rows)
    assert scaler.iteration == len(rows)


def test_default_policy_is_deepspeeds() -> None:
    scaler = DynamicLossScaler()
    assert (scaler.scale, scaler.hysteresis_left, scaler.config.loss_scale_window) == (65536.0, 2, 1000)
    assert scaler.config.min_loss_scale == 1.0 and not scaler.config.consecutive_hysteresis


def test_window_of_one_doubles_on_every_clean_step() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=0, loss_scale_window=1))
    _replay(scaler, [("C", 2, 2), ("C", 4, 2), ("O", 4, 1), ("C", 8, 2)])


def test_minimum_scale_keeps_training_and_warns_once() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0))
    scaler.update(True)  # 4 -> 2
    assert scaler.scale == 2.0
    with pytest.warns(UserWarning, match="minimum 2.*Training goes on"):
        scaler.update(True)
    scaler.update(True)  # no second warning (pytest would not fail on one; the scale is what matters)
    assert scaler.scale == 2.0 and scaler.overflows == 3
    scaler.update(False)
    assert scaler.scale == 2.0


def test_minimum_scale_raises_with_what_to_try_after_the_credits_are_spent() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=1, hysteresis=2, min_loss_scale=1.0,
                                                raise_at_min_scale=True))
    _replay(scaler, [("O", 2, 1), ("O", 1, 1)])  # spend a credit, then halve onto the floor
    with pytest.raises(MinLossScaleError, match=r"minimum 1.*bf16-mixed.*learning rate.*float32"):
        scaler.update(True)
    fresh = DynamicLossScaler(LossScalerConfig(initial_scale_power=0, hysteresis=2, raise_at_min_scale=True))
    fresh.update(True)  # at the floor but a credit is left: spent, no error
    assert (fresh.scale, fresh.hysteresis_left) == (1.0, 1)


def test_static_scale_never_changes_but_counts_overflows() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(loss_scale=128.0, loss_scale_window=1, hysteresis=1))
    for overflow in (True, False, False, True, True, False):
        scaler.update(overflow)
        assert scaler.scale == 128.0
    assert scaler.overflows == 3 and scaler.iteration == 6 and not scaler.dynamic


def test_state_round_trips() -> None:
    config = LossScalerConfig(**BASE)
    scaler = DynamicLossScaler(config)
    for kind, _, _ in REFILL_ON_GROWTH[:6]:
        scaler.update(kind == "O")
    restored = DynamicLossScaler(config)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    _replay(restored, REFILL_ON_GROWTH[6:])


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(loss_scale=-1.0), "loss_scale"), (dict(loss_scale_window=0), "loss_scale_window"),
    (dict(hysteresis=0), "hysteresis"), (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(initial_scale_power=64), "initial_scale_power"),
])
def test_bad_policies_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossScalerConfig(**kwargs)


def test_overflow_detection_without_a_process_group() -> None:
    comm = DataParallelComm()
    assert not comm.active and any_rank(True, comm) and not any_rank(False, comm)
    finite = [torch.ones(3, dtype=torch.float16), torch.zeros(0)]
    assert local_sum_of_squares(finite) == 3.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.ones(4, dtype=torch.float16)
        t[2] = bad
        value = local_sum_of_squares([t])
        assert value != value or value == float("inf")
