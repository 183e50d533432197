"""The ``optimizer`` and ``scheduler`` sections: torch optimizers built as DeepSpeed builds them, and LR
schedulers whose curves equal DeepSpeed's formulas (hand-computed values below) at every step, as the
optimizer sees them: optimizer step k runs with DeepSpeed's LR of iteration t = k - 1."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from lightning_zero.deepspeed import build_scheduler, optimizer_recipe
from lightning_zero.deepspeed.optim import OptimizerRecipe


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(2, 2))]


# ---------------------------------------------------------------------------- optimizers
@pytest.mark.parametrize(("type_name", "params", "cls", "expected"), [
    # DeepSpeed's "Adam" is AdamW (adam_w_mode defaults to true), weight_decay 0 as in its fused Adam
    ("Adam", {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-8}, torch.optim.AdamW,
     {"lr": 1e-3, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.0}),
    ("adam", {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}, torch.optim.Adam,
     {"lr": 1e-3, "weight_decay": 0.1}),
    ("AdamW", {"lr": 2e-3, "adam_w_mode": False}, torch.optim.AdamW, {"lr": 2e-3, "weight_decay": 0.0}),
    # torch_adam: torch's own optimizer with torch's defaults (AdamW: weight_decay 0.01)
    ("Adam", {"lr": 1e-3, "torch_adam": True}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    ("Adam", {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}, torch.optim.Adam,
     {"lr": 1e-3, "weight_decay": 0.0}),
    ("Adam", {"lr": 1e-3, "bias_correction": True, "amsgrad": True}, torch.optim.AdamW, {"amsgrad": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                                                             "nesterov": True}),
    ("sgd", {"lr": 0.1}, torch.optim.SGD, {"lr": 0.1, "momentum": 0}),
    ("Adagrad", {"lr": 0.01}, torch.optim.Adagrad, {"lr": 0.01}),
    ("RMSprop", {"lr": 0.01, "alpha": 0.9}, torch.optim.RMSprop, {"alpha": 0.9}),  # any torch.optim class
])
def test_optimizer_section_builds_the_torch_optimizer(type_name: str, params: dict, cls: type, expected: dict) -> None:
    recipe = optimizer_recipe(type_name, params)
    optimizer = recipe.build(_params())
    assert type(optimizer) is cls
    for key, value in expected.items():
        assert optimizer.defaults[key] == value, key
    assert "torch_adam" not in optimizer.defaults and "adam_w_mode" not in optimizer.defaults
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2
    assert recipe.differences(optimizer) == []
    assert recipe.describe().startswith(cls.__name__ + "(")


def test_optimizer_differences_name_the_class_and_values() -> None:
    recipe = optimizer_recipe("Adam", {"lr": 1e-3, "betas": [0.9, 0.95]})
    assert recipe.differences(torch.optim.SGD(_params(), lr=1e-3)) == ["class SGD vs AdamW"]
    other = torch.optim.AdamW(_params(), lr=3e-4, betas=(0.9, 0.95))  # torch's weight_decay default 0.01
    assert recipe.differences(other) == ["lr=0.0003 vs 0.001", "weight_decay=0.01 vs 0.0"]
    assert recipe.differences(torch.optim.AdamW(_params(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)) == []


def test_fused_adam_path_only_on_cuda() -> None:
    recipe = optimizer_recipe("Adam", {"lr": 1e-3})
    assert recipe.fused_on_cuda and not recipe.build(_params()).defaults.get("fused")
    assert not optimizer_recipe("Adam", {"torch_adam": True}).fused_on_cuda


@pytest.mark.parametrize(("type_name", "params", "message"), [
    ("Lamb", {"lr": 1e-3}, r"Lamb is not part of torch.*pip install torch-optimizer.*ZeRO stage 0 only"),
    ("ZeroOneAdam", {}, "DeepSpeed-only optimizer"),
    ("ZeroOneAdam", {}, "DeepSpeed-only optimizer"),
    ("Sophia", {}, "neither a DeepSpeed optimizer lightning_zero supports"),
    ("Adam", {"bias_correction": False}, "bias_correction=false"),
    ("SGD", {"lr": 0.1, "betas": [0.9, 0.99]}, r"\['betas'\] not accepted by torch.optim.sgd.SGD"),
])
def test_unavailable_optimizers_and_params_are_refused_clearly(type_name: str, params: dict, message: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_optimizer" else
                        real(name, *a))
    with pytest.raises(ValueError, match=message):
        optimizer_recipe(type_name, params)


def test_lamb_is_built_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    class Lamb(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0):
            super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    monkeypatch.setattr(torch.optim, "Lamb", Lamb, raising=False)
    recipe = optimizer_recipe("Lamb", {"lr": 0.01, "weight_decay": 0.1})
    assert recipe == OptimizerRecipe(Lamb, {"lr": 0.01, "weight_decay": 0.1})
    assert type(recipe.build(_params())) is Lamb


# ---------------------------------------------------------------------------- schedulers
def _lrs_seen_by_each_step(name: str, params: dict, steps: int, lr: float = 0.02,
                           total: int | None = None) -> tuple[list[float], object]:
    """The LR each optimizer step runs with, driving the scheduler as Lightning does (step after each step)."""
    optimizer = torch.optim.SGD(_params(), lr=lr)
    scheduler = build_scheduler(name, params, optimizer, total)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen, scheduler


def _check(name: str, params: dict, expected: dict[int, float], lr: float = 0.02, total: int | None = None) -> None:
    """``expected``: DeepSpeed iteration t -> LR (t = -1: before the first step())."""
    steps = max(expected) + 2
    seen, scheduler = _lrs_seen_by_each_step(name, params, steps, lr, total)
    for t, value in expected.items():
        assert seen[t + 1] == pytest.approx(value, rel=1e-9, abs=1e-15), f"{name} at t={t}"
        assert scheduler.lr_at(t)[0] == pytest.approx(value, rel=1e-9, abs=1e-15), f"{name}.lr_at({t})"


def test_warmup_lr_log_and_linear() -> None:
    # log warmup over W=10 from 0 to 0.01: 0.01 * log(t + 1) / log(10) = 0.01 * log10(t + 1)
    _check("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10},
           {-1: 0.0, 0: 0.0, 1: 0.0030102999566, 3: 0.0060205999133, 8: 0.0095424250944, 9: 0.01, 10: 0.01,
            25: 0.01})
    # linear warmup over W=4 from 0.001 to 0.005: 0.001 + 0.004 * t / 4
    _check("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.005, "warmup_num_steps": 4,
                        "warmup_type": "linear"},
           {-1: 0.001, 0: 0.001, 1: 0.002, 2: 0.003, 3: 0.004, 4: 0.005, 9: 0.005})
    # warmup_num_steps below 2 is raised to 2, as in DeepSpeed: t=0 -> min, t>=2 -> max
    _check("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 1, "warmup_type": "linear"},
           {0: 0.0, 1: 0.05, 2: 0.1})


def test_warmup_decay_lr() -> None:
    # linear warmup W=4, then 0.01 * (10 - t) / (10 - 4), never below 0 (min_lr 0)
    _check("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                             "warmup_type": "linear"},
           {-1: 0.0, 1: 0.0025, 3: 0.0075, 4: 0.01, 5: 0.0083333333333, 7: 0.005, 9: 0.0016666666667, 10: 0.0,
            12: 0.0})
    # decays to warmup_min_lr: 0.002 + 0.008 * (10 - t) / 6
    _check("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 0.002, "warmup_max_lr": 0.01,
                             "warmup_num_steps": 4, "warmup_type": "linear"}, {7: 0.006, 10: 0.002, 11: 0.002})


def test_warmup_cosine_lr() -> None:
    # optimizer lr 0.02; ratio 0 before the first step (DeepSpeed's get_lr at t < 0), then warms linearly
    # 0.1 -> 1 over W=4, then c + (1-c)(1 + cos(pi (t-3)/6))/2
    _check("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                              "cos_min_ratio": 0.0, "warmup_type": "linear"},
           {-1: 0.0, 0: 0.002, 2: 0.011, 3: 0.0155, 4: 0.0186602540378, 6: 0.01, 8: 0.0013397459622, 9: 0.0, 12: 0.0})
    _check("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4, "cos_min_ratio": 0.1,
                              "warmup_type": "linear"}, {6: 0.011, 9: 0.002})
    # log warmup (default): ratio log(t + 1) / log(4)
    _check("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 4}, {1: 0.01, 3: 0.02}, lr=0.02)


def test_total_num_steps_comes_from_the_trainer_when_missing() -> None:
    seen, scheduler = _lrs_seen_by_each_step("WarmupDecayLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                                               "warmup_type": "linear"}, 12, total=10)
    assert scheduler.total_num_steps == 10 and seen[11] == 0.0
    with pytest.raises(ValueError, match=r"needs scheduler\.params\.total_num_steps"):
        build_scheduler("WarmupCosineLR", {}, torch.optim.SGD(_params(), lr=0.1))
    with pytest.warns(UserWarning, match="does not exceed the warmup length"):
        short = build_scheduler("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 5,
                                                   "warmup_type": "linear"}, torch.optim.SGD(_params(), lr=0.1))
    assert short.lr_at(4) == pytest.approx([0.08]) and short.lr_at(5) == pytest.approx([1e-5])


def test_one_cycle_lr_and_momentum() -> None:
    # cycle 4 up + 4 down between 0.01 and 0.1, evaluated at t + 1; then 0.01 / (1 + 0.5 * (t - 7) / 2)
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "decay_lr_rate": 0.5,
              "decay_step_size": 2, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}
    expected = {-1: 0.01, 0: 0.0325, 1: 0.055, 3: 0.1, 5: 0.055, 6: 0.0325, 7: 0.01, 8: 0.008, 11: 0.005}
    optimizer = torch.optim.AdamW(_params(), lr=1.0, betas=(0.5, 0.98))
    scheduler = build_scheduler("OneCycle", params, optimizer)
    momentum = {-1: 0.8, 0: 0.875, 3: 0.8, 5: 0.85, 7: 0.9, 11: 0.9}
    for k in range(13):
        t = k - 1
        if t in expected:
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected[t]), t
        if t in momentum:
            assert optimizer.param_groups[0]["betas"] == (pytest.approx(momentum[t]), 0.98), t
        optimizer.step()
        scheduler.step()
    # without betas (SGD) DeepSpeed does not cycle momentum; the LR still cycles
    _check("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                        "cycle_second_step_size": 2}, {0: 0.0325, 3: 0.1, 4: 0.055, 5: 0.01, 9: 0.01})


def test_lr_range_test() -> None:
    # DeepSpeed's interval is (last_batch_iteration + 1) / step_size: 0.001 * (1 + 2 * (t + 1) / 10)
    _check("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 10,
                           "lr_range_test_step_rate": 2.0}, {-1: 0.001, 0: 0.0012, 4: 0.002, 24: 0.006})
    # staircase: floor((t + 1) / 10)
    _check("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 10,
                           "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True},
           {5: 0.001, 8: 0.001, 9: 0.003, 24: 0.005})


def test_per_group_values_and_state_round_trip() -> None:
    optimizer = torch.optim.SGD([{"params": [_params()[0]]}, {"params": [_params()[1]]}], lr=0.1)
    scheduler = build_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [0.01, 0.2],
                                             "warmup_num_steps": 2, "warmup_type": "linear"}, optimizer)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.005, 0.15])
    state = scheduler.state_dict()
    fresh = build_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [0.01, 0.2],
                                         "warmup_num_steps": 2, "warmup_type": "linear"}, optimizer)
    fresh.load_state_dict(state)
    assert fresh.iteration == scheduler.iteration == 1
    with pytest.raises(ValueError, match="lists 3 values for 2 param groups"):
        build_scheduler("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, optimizer)
    assert math.isclose(scheduler.lr_at(5)[1], 0.2)


# Every parameter DeepSpeed's five schedules take (deepspeed/runtime/lr_schedules.py, their __init__s).
DEEPSPEED_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"},
    "OneCycle": {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"},
    "LRRangeTest": {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"},
}


@pytest.mark.parametrize("name", list(DEEPSPEED_PARAMS))
def test_every_deepspeed_parameter_is_accepted(name: str) -> None:
    from lightning_zero.deepspeed import parse_deepspeed_config
    from lightning_zero.deepspeed.schedulers import scheduler_class

    signature = inspect.signature(scheduler_class(name).__init__)
    assert set(signature.parameters) - {"self", "optimizer", "last_epoch"} == DEEPSPEED_PARAMS[name]
    needed = {"OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}.get(name, {})
    ds = parse_deepspeed_config({"scheduler": {"type": name, "params": {**needed, "last_batch_iteration": -1}}})
    assert ds.scheduler is not None and ds.scheduler.params["last_batch_iteration"] == -1


@pytest.mark.parametrize(("name", "params"), [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.005, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 10}),
])
def test_last_batch_iteration_resumes_the_curve(name: str, params: dict) -> None:
    """Starting at last_batch_iteration=k, step j runs with the LR of DeepSpeed iteration k + j."""
    fresh, _ = _lrs_seen_by_each_step(name, params, 12)  # fresh[j] = lr at iteration j - 1
    for k in (0, 3):
        resumed, scheduler = _lrs_seen_by_each_step(name, {**params, "last_batch_iteration": k}, 6)
        assert resumed == pytest.approx(fresh[k + 1:k + 7], rel=1e-12), (name, k)
        assert scheduler.iteration == k + 6
    with pytest.raises(ValueError, match="`last_batch_iteration` must be an integer >= -1"):
        build_scheduler(name, {**params, "last_batch_iteration": -2}, torch.optim.SGD(_params(), lr=0.1))


def test_warmup_lr_warms_up_to_each_groups_own_lr_by_default() -> None:
    # DeepSpeed: warmup_max_lr=None -> the param groups' LRs
    optimizer = torch.optim.SGD([{"params": [_params()[0]], "lr": 0.1}, {"params": [_params()[1]], "lr": 0.3}])
    scheduler = build_scheduler("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, optimizer)
    assert scheduler.lr_at(5) == pytest.approx([0.1, 0.3]) and scheduler.lr_at(1) == pytest.approx([0.05, 0.15])
    with pytest.raises(ValueError, match="`warmup_num_steps` must be a positive integer"):
        build_scheduler("WarmupLR", {"warmup_num_steps": 0}, optimizer)


def test_one_cycle_stairs_and_per_group_momentum() -> None:
    # 2 stairs per half of a 4 + 4 cycle: the scale is floor(position / 4 * 2) / 2 going up,
    # floor((8 - position) / 4 * 2) / 2 going down, position = (t + 1) % 8
    _check("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                        "cycle_first_stair_count": 2},
           {0: 0.01, 1: 0.055, 2: 0.055, 3: 0.1, 4: 0.055, 5: 0.055, 6: 0.01, 7: 0.01})
    # a second half of 0 steps is allowed (DeepSpeed: >= 0)
    _check("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                        "cycle_second_step_size": 0}, {0: 0.0325, 2: 0.0775, 3: 0.01})
    optimizer = torch.optim.AdamW([{"params": [_params()[0]]}, {"params": [_params()[1]]}], lr=1.0)
    scheduler = build_scheduler("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                                             "cycle_min_mom": [0.8, 0.5], "cycle_max_mom": [0.9, 0.7]}, optimizer)
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.8, 0.5])
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.8, 0.5])  # t=3: the LR peak
    assert scheduler.momentum_at(5) == pytest.approx([0.85, 0.6])
