"""DeepSpeed's learning-rate schedules as PyTorch LR schedulers (``torch.optim.lr_scheduler.LRScheduler``).

DeepSpeed's schedulers count ``last_batch_iteration`` from -1: building one sets the optimizer's
LR for the first step, and ``step()`` after each optimizer step advances the count, so the optimizer
step number ``k`` (0-based) runs with the LR of iteration ``t = k - 1``. A PyTorch scheduler counts
``last_epoch`` from 0 after construction, so each class here computes DeepSpeed's value at
``t = last_epoch - 1``: with Lightning stepping it after every optimizer step (``interval="step"``),
every optimizer step sees exactly the LR DeepSpeed would give it. :meth:`DeepSpeedSchedule.lr_at`
is the curve itself, per DeepSpeed iteration ``t``.

Curves (``W = max(2, warmup_num_steps)``, ``T = total_num_steps``; ``g(t) = log(t + 1) / log(W)`` for
``warmup_type="log"`` (the default), ``t / W`` for ``"linear"``):

* ``WarmupLR``: ``min_lr + (max_lr - min_lr) * g(t)`` while ``t < W``, then ``max_lr``.
* ``WarmupDecayLR``: the warmup above, then linearly back down to ``min_lr`` at ``T``:
  ``min_lr + (max_lr - min_lr) * max(0, (T - t) / max(1, T - W))``.
* ``WarmupCosineLR``: the optimizer's LR times a ratio: ``r0 + (1 - r0) * g(t)`` while ``t < W``
  (``r0 = warmup_min_ratio``), then ``c + (1 - c) * (1 + cos(pi * (t - W + 1) / (T - W))) / 2`` with
  ``c = cos_min_ratio``, floored at 0.
* ``OneCycle``: a triangle from ``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
  steps and back over ``cycle_second_step_size``, evaluated at ``t + 1``; afterwards
  ``cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` with ``d = t - cycle_size + 1`` (no decay
  when ``decay_step_size`` or ``decay_lr_rate`` is 0). With ``cycle_momentum``, ``betas[0]`` moves the
  opposite way between ``cycle_max_mom`` and ``cycle_min_mom``.
  With ``cycle_first_stair_count`` / ``cycle_second_stair_count`` > 0 the scale of a half cycle moves
  in that many stairs: ``floor(position * stairs / half) / stairs`` of the position in the cycle.
* ``LRRangeTest``: ``lr_range_test_min_lr * (1 + step_rate * (t + 1) / step_size)`` (``floor`` of the
  quotient with ``staircase``).

``last_batch_iteration`` (every schedule, default -1) is DeepSpeed's resume point: the schedule
continues from DeepSpeed iteration ``last_batch_iteration`` instead of -1, i.e. the first optimizer
step runs with the LR of that iteration and the next with the following one. (DeepSpeed leaves the
optimizer's LR untouched until the first ``step()`` then; here the optimizer starts at the LR that
iteration's ``step()`` left, which is what a resumed DeepSpeed optimizer holds.) ``WarmupLR``'s
``warmup_max_lr`` defaults, as DeepSpeed's, to each param group's own LR.

Deliberate differences from DeepSpeed: ``OneCycle`` keeps each group's ``betas[1]`` (DeepSpeed
overwrites it with 0.99); an unknown ``warmup_type`` is an error (DeepSpeed warns and uses
``"log"``). A ``total_num_steps`` not above the warmup length is warned about, as DeepSpeed does.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

_WARMUP_TYPES = ("log", "linear")


def _start(last_batch_iteration: int) -> int:
    """DeepSpeed iterations already done before this schedule starts (``last_batch_iteration + 1``)."""
    if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) or last_batch_iteration < -1:
        raise ValueError(f"`last_batch_iteration` must be an integer >= -1 (-1: start from the beginning), got "
                         f"{last_batch_iteration!r}.")
    return last_batch_iteration + 1


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return value


def _per_group(value: float | Sequence[float], optimizer: Optimizer, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"`{name}` lists {len(value)} values for {len(optimizer.param_groups)} param groups.")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class DeepSpeedSchedule(LRScheduler):
    """Base: DeepSpeed's per-iteration curve, driven by PyTorch's ``last_epoch`` (see the module docs)."""

    start: int = 0  # last_batch_iteration + 1 (set by each subclass before LRScheduler.__init__)

    def lr_at(self, t: int) -> list[float]:
        """The LR of each param group at DeepSpeed iteration ``t`` (``-1``: before the first ``step()``)."""
        raise NotImplementedError

    @property
    def iteration(self) -> int:
        """DeepSpeed's ``last_batch_iteration`` equivalent."""
        return self.last_epoch - 1 + self.start

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lr_at(self.iteration)


class _Warmup(DeepSpeedSchedule):
    def _init_warmup(self, warmup_num_steps: int, warmup_type: str) -> None:
        if warmup_type not in _WARMUP_TYPES:
            raise ValueError(f"`warmup_type` must be one of {list(_WARMUP_TYPES)}, got {warmup_type!r}.")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = warmup_type

    def _warmup_fraction(self, t: int) -> float:
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def _check_total(self, total_num_steps: int) -> None:
        if total_num_steps <= self.warmup_num_steps:  # DeepSpeed warns too, and trains on
            warnings.warn(f"{type(self).__name__}: total_num_steps={total_num_steps} does not exceed the warmup "
                          f"length max(2, warmup_num_steps)={self.warmup_num_steps}; the LR never decays.",
                          UserWarning, stacklevel=3)


class WarmupLR(_Warmup):
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` (log or linear), then constant.
    ``warmup_max_lr=None`` (the default) warms each param group up to its own LR."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1, last_epoch: int = -1) -> None:
        self.start = _start(last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "warmup_max_lr")
        self._init_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_epoch)

    def _gamma(self, t: int) -> float:
        return self._warmup_fraction(t) if t < self.warmup_num_steps else 1.0

    def lr_at(self, t: int) -> list[float]:
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: ``WarmupLR``'s warmup, then linear decay to ``warmup_min_lr`` at
    ``total_num_steps``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1, last_epoch: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        self._init_warmup(warmup_num_steps, warmup_type)
        self._check_total(self.total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration,
                         last_epoch)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return self._warmup_fraction(t)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Warmup):
    """DeepSpeed's ``WarmupCosineLR``: a ratio of the optimizer's LR, warmed up then cosine-decayed."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1, last_epoch: int = -1) -> None:
        self.start = _start(last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self._init_warmup(warmup_num_steps, warmup_type)
        self._check_total(self.total_num_steps)
        super().__init__(optimizer, last_epoch)

    def ratio_at(self, t: int) -> float:
        """The factor on the optimizer's LR at DeepSpeed iteration ``t`` (0 before the first step, as DeepSpeed)."""
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction(t)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(t - self.warmup_num_steps + 1, span) / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, t: int) -> list[float]:
        ratio = self.ratio_at(t)
        return [base * ratio for base in self.base_lrs]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's ``OneCycle`` (1Cycle LR policy, optionally cycling Adam's ``betas[0]`` inversely)."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float | Sequence[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1, last_epoch: int = -1) -> None:
        self.start = _start(last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(f"`cycle_first_step_size` must be positive and `cycle_second_step_size` >= 0, got "
                             f"{cycle_first_step_size!r} and {cycle_second_step_size!r}.")
        self.first_size, self.second_size = first, second
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None else int(cycle_second_stair_count)
        if self.first_stairs < 0 or self.second_stairs < 0:
            raise ValueError("`cycle_first_stair_count` and `cycle_second_stair_count` must be >= 0 (0: no stairs).")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.min_lrs = _per_group(cycle_min_lr, optimizer, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, optimizer, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = float(decay_lr_rate), float(decay_mom_rate)
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and all("betas" in g for g in optimizer.param_groups)
        self.min_moms = _per_group(cycle_min_mom, optimizer, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, optimizer, "cycle_max_mom")
        super().__init__(optimizer, last_epoch)

    def _scale(self, t: int) -> float:
        x = (t + 1) / self.total_size
        x = 1.0 + x - math.floor(1.0 + x)
        rising = x <= self.step_ratio
        stairs = self.first_stairs if rising else self.second_stairs
        if stairs > 0:  # flat stairs, from the integer position in the cycle (no float rounding at the peak)
            position = (t + 1) % self.total_size
            up = position <= self.first_size
            part = position / self.first_size if up else (self.total_size - position) / self.second_size
            return math.floor(part * stairs) / stairs
        return x / self.step_ratio if rising else (x - 1.0) / (self.step_ratio - 1.0)

    def lr_at(self, t: int) -> list[float]:
        if t < 0:
            return list(self.min_lrs)
        if t < self.total_size:
            s = self._scale(t)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * (t - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, t: int) -> list[float]:
        """``betas[0]`` of each param group at DeepSpeed iteration ``t``."""
        if t < 0:
            return list(self.min_moms)
        if t < self.total_size:
            s = self._scale(t)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * (t - self.total_size + 1) / self.decay_step_size
        return [hi * factor for hi in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self.momentum_at(self.iteration)):
                group["betas"] = (momentum, *tuple(group["betas"])[1:])


class LRRangeTest(DeepSpeedSchedule):
    """DeepSpeed's ``LRRangeTest``: an LR growing linearly (or in stairs) from ``lr_range_test_min_lr``."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1, last_epoch: int = -1) -> None:
        self.start = _start(last_batch_iteration)
        _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.min_lrs = _per_group(lr_range_test_min_lr, optimizer, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int) -> list[float]:
        if t < 0:
            return list(self.min_lrs)
        interval = (t + 1) / self.step_size
        factor = 1.0 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [lo * factor for lo in self.min_lrs]


SCHEDULERS: dict[str, type[DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest,
}
NEEDS_TOTAL_STEPS = ("WarmupDecayLR", "WarmupCosineLR")


def scheduler_class(name: str) -> type[DeepSpeedSchedule]:
    """The class of a DeepSpeed ``scheduler.type`` (exact names, as DeepSpeed requires)."""
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler.type={name!r} is not a DeepSpeed scheduler lightning_zero knows. "
                         f"Use one of {list(SCHEDULERS)}.")
    return SCHEDULERS[name]


def check_scheduler_params(name: str, params: dict[str, Any]) -> None:
    """Refuse parameters the scheduler does not take (naming the valid ones) before any optimizer exists."""
    signature = inspect.signature(scheduler_class(name).__init__)
    valid = [p for p in signature.parameters if p not in ("self", "optimizer", "last_epoch")]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"scheduler.params of {name}: unknown key(s) {unknown}; valid keys: {valid}.")
    required = [p for p, spec in signature.parameters.items()
                if spec.default is inspect.Parameter.empty and p not in ("self", "optimizer")]
    missing = [p for p in required if p not in params and p != "total_num_steps"]
    if missing:
        raise ValueError(f"scheduler.params of {name}: missing {missing}.")
    if "last_batch_iteration" in params:
        try:
            _start(params["last_batch_iteration"])
        except ValueError as err:
            raise ValueError(f"scheduler.params of {name}: {err}") from err


def build_scheduler(name: str, params: dict[str, Any], optimizer: Optimizer,
                    total_steps: int | None = None) -> DeepSpeedSchedule:
    """Build ``scheduler.type`` on ``optimizer``. ``total_steps`` fills a missing ``total_num_steps``."""
    check_scheduler_params(name, params)
    kwargs = dict(params)
    if name in NEEDS_TOTAL_STEPS and kwargs.get("total_num_steps") is None:
        if total_steps is None:
            raise ValueError(f"scheduler {name} needs scheduler.params.total_num_steps (or Trainer(max_steps=...)).")
        kwargs["total_num_steps"] = total_steps
    return scheduler_class(name)(optimizer, **kwargs)
