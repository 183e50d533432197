"""ZeRO stage 3: parameters as 1/N shards, gathered one unit at a time, torch only.

Public pieces: ``gathered_parameters`` (``gathered``), ``plan_units`` (``units``: which parameters are gathered
together), ``GatherPool`` (``gather_pool``: gathered memory reused between units), meta-device construction
(``materialize``: ``initialize_modules``, ``has_meta_parameters``), activation recomputation
(``activation_checkpointing``: ``apply_activation_checkpointing``), the sharding at setup, ``apply_stage3``
(``sharding``), the runtime's hooks, ``Stage3Runtime`` (``runtime``), and one unit's shards, ``ShardedUnit``,
``is_released`` (``sharded_unit``). Streamed loading and the end-of-fit gather use the whole engine: they are in
``core/zero`` (``loading``, ``teardown``).
"""

from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.core.stage3.gather_pool import GatherPool
from lightning_zero.core.stage3.gathered import gathered_parameters
from lightning_zero.core.stage3.materialize import has_meta_parameters, initialize_modules
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit, is_released
from lightning_zero.core.stage3.sharding import apply_stage3
from lightning_zero.core.stage3.units import plan_units

__all__ = ["GatherPool", "ShardedUnit", "Stage3Runtime", "apply_activation_checkpointing", "apply_stage3",
           "gathered_parameters", "has_meta_parameters", "initialize_modules", "is_released", "plan_units"]
