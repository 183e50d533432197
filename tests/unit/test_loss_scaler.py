"""The fp16 loss scaler against DeepSpeed 0.19's ``DynamicLossScaler.update_scale`` rule.

The rule, as the issue states it: steps are numbered from 0 and the last overflow starts at -1. On
a clean step ``i`` let ``stable = i - last_overflow - 1``; the scale doubles when ``stable > 0`` and
``stable % window == 0``. With ``consecutive_hysteresis`` the credits refill on every clean step,
without it when the scale doubles. On an overflow (which sets ``last_overflow = i``): with one
credit left (or ``hysteresis == 1``) the scale halves, never below ``min_loss_scale``; else one
credit is spent and the scale kept.

The expectations come from two independent places: sequences worked by hand from that text, and
:func:`reference` below -- the rule rewritten in terms of "clean steps since the last overflow"
(no iteration numbers), replayed over a table of sequences (hysteresis 1-3, window 1-4,
consecutive on / off).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.precision.loss_scaler import LossScaler, MinLossScaleError, any_rank, local_sum_of_squares
from lightning_zero.core.settings.precision import LossScalerConfig

# scale 16, window 2, 2 credits, floor 2
BASE = dict(initial_scale_power=4, loss_scale_window=2, hysteresis=2, min_loss_scale=2.0)

REFILL_ON_GROWTH = [  # consecutive_hysteresis=False: credits come back only when the scale grows
    ("C", 16, 2),  # it 0: stable = 0 - (-1) - 1 = 0 -> no growth
    ("C", 16, 2),  # it 1: stable 1, odd
    ("C", 32, 2),  # it 2: stable 2 -> double (and refill)
    ("O", 32, 1),  # it 3: two credits -> spend one, last overflow = 3
    ("C", 32, 1),  # it 4: stable 0; no refill without consecutive
    ("C", 32, 1),  # it 5: stable 1
    ("C", 64, 2),  # it 6: stable 2 -> double and refill
    ("O", 64, 1),  # it 7: spend, last = 7
    ("O", 32, 1),  # it 8: one credit -> halve, last = 8
    ("O", 16, 1),  # it 9: halve, last = 9
    ("C", 16, 1),  # it 10: stable 0
    ("C", 16, 1),  # it 11: stable 1
    ("C", 32, 2),  # it 12: stable 2 -> double and refill
]
# scale 16, window 3, 3 credits, floor 2, consecutive_hysteresis=True: any clean step refills
CONSECUTIVE = dict(initial_scale_power=4, loss_scale_window=3, hysteresis=3, min_loss_scale=2.0,
                   consecutive_hysteresis=True)
REFILL_EVERY_CLEAN_STEP = [
    ("C", 16, 3),  # it 0: stable 0
    ("C", 16, 3),  # it 1: stable 1
    ("C", 16, 3),  # it 2: stable 2
    ("C", 32, 3),  # it 3: stable 3 -> double
    ("O", 32, 2),  # it 4: spend, last = 4
    ("O", 32, 1),  # it 5: spend, last = 5
    ("C", 32, 3),  # it 6: refilled at once; stable 0
    ("O", 32, 2),  # it 7: spend, last = 7
    ("O", 32, 1),  # it 8: spend, last = 8
    ("O", 16, 1),  # it 9: one credit -> halve, last = 9
    ("O", 8, 1),  # it 10: halve, last = 10
    ("C", 8, 3),  # it 11: refill; stable 0
    ("C", 8, 3),  # it 12: stable 1
    ("C", 8, 3),  # it 13: stable 2
    ("C", 16, 3),  # it 14: stable 3 -> double
]


def _replay(scaler: LossScaler, rows: list[tuple[str, float, int]]) -> None:
    for i, (kind, scale, credits) in enumerate(rows):
        scaler.update(kind == "O")
        assert (scaler.scale, scaler.hysteresis_left) == (scale, credits), f"after step {i} ({kind})"


def reference(kinds: str, *, power: int, window: int, hysteresis: int, consecutive: bool,
              floor: float) -> list[tuple[float, int]]:
    """The rule of the module docstring, counting the clean steps since the last overflow."""
    scale, credits, clean_run, out = 2.0**power, hysteresis, 0, []
    for kind in kinds:
        if kind == "O":
            if credits <= 1 or hysteresis == 1:
                scale = max(scale / 2, floor)
            else:
                credits -= 1
            clean_run = 0
        else:
            if consecutive:
                credits = hysteresis
            if clean_run > 0 and clean_run % window == 0:  # clean_run == stable: the clean steps before this one
                scale *= 2
                if not consecutive:
                    credits = hysteresis
            clean_run += 1
        out.append((scale, credits))
    return out


def test_deepspeed_example_from_the_issue() -> None:
    """initial_scale_power=8, window 2, three clean steps: 256, 256, 512 (DeepSpeed 0.19.8)."""
    scaler = LossScaler(LossScalerConfig(initial_scale_power=8, loss_scale_window=2))
    scales = []
    for _ in range(3):
        scaler.update(False)
        scales.append(scaler.scale)
    assert scales == [256.0, 256.0, 512.0]


@pytest.mark.parametrize(("config", "rows"), [(BASE, REFILL_ON_GROWTH), (CONSECUTIVE, REFILL_EVERY_CLEAN_STEP)])
def test_hand_worked_sequences(config: dict, rows: list[tuple[str, float, int]]) -> None:
    scaler = LossScaler(LossScalerConfig(**config))
    assert (scaler.scale, scaler.hysteresis_left) == (16.0, config["hysteresis"])
    _replay(scaler, rows)
    assert scaler.overflows == sum(kind == "O" for kind, _, _ in rows)
    assert scaler.iteration == len(rows)
    # the reference agrees with the hand-worked rows (so the table below checks against a rule that is right)
    kinds = "".join(kind for kind, _, _ in rows)
    expected = reference(kinds, power=4, window=config["loss_scale_window"], hysteresis=config["hysteresis"],
                         consecutive=config.get("consecutive_hysteresis", False), floor=2.0)
    assert expected == [(float(scale), credits) for _, scale, credits in rows]


def _sequences() -> list[str]:
    rng = random.Random(1234)
    fixed = ["CCCCCCCCC", "OCCCCCCCC", "OOOCCCCCCCC", "COCOCOCOCO", "CCCOCCCOOCCCCCCOOOOCCCCCCCCC"]
    return fixed + ["".join(rng.choice("CCCO" if i % 2 else "CO") for _ in range(24)) for i in range(6)]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 2, 3, 4])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_table_of_sequences(hysteresis: int, window: int, consecutive: bool) -> None:
    for kinds in _sequences():
        scaler = LossScaler(LossScalerConfig(initial_scale_power=5, loss_scale_window=window,
                                                    hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                                                    min_loss_scale=1.0))
        expected = reference(kinds, power=5, window=window, hysteresis=hysteresis, consecutive=consecutive, floor=1.0)
        with warnings.catch_warnings():  # a sequence may reach the floor: warned about (tested below), trains on
            warnings.simplefilter("ignore")
            got = []
            for kind in kinds:
                scaler.update(kind == "O")
                got.append((scaler.scale, scaler.hysteresis_left))
        assert got == expected, f"{kinds} (hysteresis {hysteresis}, window {window}, consecutive {consecutive})"


def test_default_policy_is_deepspeeds() -> None:
    scaler = LossScaler()
    assert (scaler.scale, scaler.hysteresis_left, scaler.config.loss_scale_window) == (65536.0, 2, 1000)
    assert scaler.config.min_loss_scale == 1.0 and not scaler.config.consecutive_hysteresis


def test_window_of_one_doubles_on_every_clean_step_after_the_first() -> None:
    scaler = LossScaler(LossScalerConfig(initial_scale_power=0, loss_scale_window=1))
    # stable 0, 1, 2; overflow; stable 0 (no refill), 1 (double and refill)
    _replay(scaler, [("C", 1, 2), ("C", 2, 2), ("C", 4, 2), ("O", 4, 1), ("C", 4, 1), ("C", 8, 2)])


def test_minimum_scale_keeps_training_and_warns_once() -> None:
    scaler = LossScaler(LossScalerConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0))
    scaler.update(True)  # 4 -> 2
    assert scaler.scale == 2.0
    with pytest.warns(UserWarning, match="minimum 2.*Training goes on"):
        scaler.update(True)
    scaler.update(True)  # no second warning (pytest would not fail on one; the scale is what matters)
    assert scaler.scale == 2.0 and scaler.overflows == 3
    scaler.update(False)
    assert scaler.scale == 2.0


def test_minimum_scale_raises_with_what_to_try_after_the_credits_are_spent() -> None:
    scaler = LossScaler(LossScalerConfig(initial_scale_power=1, hysteresis=2, min_loss_scale=1.0,
                                                raise_at_min_scale=True))
    _replay(scaler, [("O", 2, 1), ("O", 1, 1)])  # spend a credit, then halve onto the floor
    with pytest.raises(MinLossScaleError, match=r"minimum 1.*bf16-mixed.*learning rate.*float32"):
        scaler.update(True)
    fresh = LossScaler(LossScalerConfig(initial_scale_power=0, hysteresis=2, raise_at_min_scale=True))
    fresh.update(True)  # at the floor but a credit is left: spent, no error
    assert (fresh.scale, fresh.hysteresis_left) == (1.0, 1)


def test_static_scale_never_changes_but_counts_overflows() -> None:
    scaler = LossScaler(LossScalerConfig(loss_scale=128.0, loss_scale_window=1, hysteresis=1))
    for overflow in (True, False, False, True, True, False):
        scaler.update(overflow)
        assert scaler.scale == 128.0
    assert scaler.overflows == 3 and scaler.iteration == 6 and not scaler.dynamic


def test_state_round_trips() -> None:
    config = LossScalerConfig(**BASE)
    scaler = LossScaler(config)
    for kind, _, _ in REFILL_ON_GROWTH[:5]:
        scaler.update(kind == "O")
    restored = LossScaler(config)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    _replay(restored, REFILL_ON_GROWTH[5:])


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(loss_scale=-1.0), "loss_scale"), (dict(loss_scale_window=0), "loss_scale_window"),
    (dict(hysteresis=0), "hysteresis"), (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(initial_scale_power=64), "initial_scale_power"), (dict(loss_scale=float("inf")), "finite"),
    (dict(loss_scale=float("nan")), "finite"), (dict(min_loss_scale=float("inf")), "finite"),
    (dict(loss_scale=128.0, min_loss_scale=float("inf")), "finite"),
])
def test_bad_policies_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossScalerConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(loss_scale_window=0), dict(loss_scale_window=-1), dict(min_loss_scale=0),
                                    dict(min_loss_scale=-1), dict(hysteresis=0)])
def test_a_static_scale_ignores_the_dynamic_knobs(kwargs: dict) -> None:
    scaler = LossScaler(LossScalerConfig(loss_scale=128.0, **kwargs))  # DeepSpeed accepts these too
    for overflow in (True, False, False):
        scaler.update(overflow)
    assert scaler.scale == 128.0


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


def test_the_former_name_dynamic_loss_scaler_still_works_and_says_the_new_one() -> None:
    import lightning_zero
    from lightning_zero.core.precision import loss_scaler

    for module in (lightning_zero, loss_scaler):
        with pytest.warns(DeprecationWarning, match="import LossScaler"):
            assert module.DynamicLossScaler is LossScaler
    with pytest.raises(AttributeError):
        _ = lightning_zero.NoSuchName
