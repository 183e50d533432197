"""ZeRO partitioning (stages 0-3) and the engine that composes the core: the top of core/, torch only.

Public pieces: the engine, ``ZeroEngine`` (``engine``), how it is built, ``StageCoupling``,
``SelfReducingOptimizer``, ``check_optimizer`` (``engine_setup``), the step's states, ``StepState``,
``GradReduction``, ``StepStateError``, and ``weighted_norm_excess`` (``engine_step``); the gradient hooks and
buckets, ``GradReducer``, ``ReductionMode`` (``grad_reducer``); the optimizer re-pointed at shards,
``ShardedOptimizer`` (``optimizer``), its whole state, ``full_optimizer_state``, ``load_full_optimizer_state``
(``optimizer_state``); whole tensors streamed into the shards, ``load_full_state_dict`` (``loading``); and what a
finished fit gathers back, ``plan_teardown``, ``TeardownPlan`` (``teardown``).
Nothing else in core/ imports this folder.
"""

from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.engine_setup import SelfReducingOptimizer, StageCoupling, check_optimizer
from lightning_zero.core.zero.engine_step import GradReduction, StepState, StepStateError, weighted_norm_excess
from lightning_zero.core.zero.grad_reducer import GradReducer, ReductionMode
from lightning_zero.core.zero.loading import load_full_state_dict
from lightning_zero.core.zero.optimizer import ShardedOptimizer
from lightning_zero.core.zero.optimizer_state import full_optimizer_state, load_full_optimizer_state
from lightning_zero.core.zero.teardown import TeardownPlan, plan_teardown

__all__ = ["GradReducer", "GradReduction", "ReductionMode", "SelfReducingOptimizer", "ShardedOptimizer",
           "StageCoupling", "StepState", "StepStateError", "TeardownPlan", "ZeroEngine", "check_optimizer",
           "full_optimizer_state", "load_full_optimizer_state", "load_full_state_dict", "plan_teardown",
           "weighted_norm_excess"]
