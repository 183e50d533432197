"""ZeRO stage 3: parameters as 1/N shards, gathered one unit at a time, torch only.

Public pieces named here: ``gathered_parameters`` (``gathered``), ``plan_units`` (``units``: which parameters
are gathered together), ``GatherPool`` (``gather_pool``: gathered memory reused between units), meta-device
construction (``materialize``: ``initialize_modules``, ``has_meta_parameters``) and activation recomputation
(``activation_checkpointing``: ``apply_activation_checkpointing``).

Not named here, import them from their modules: ``apply_stage3`` (``sharding``), ``Stage3Runtime`` (``runtime``),
``ShardedUnit`` (``sharded_unit``), streamed loading (``loading``) and the end-of-fit gather (``teardown``).
They import ``core/zero``'s ``flat_param``, which imports ``materialize`` from here: naming them here would be
an import cycle through this ``__init__`` (``tests/unit/test_import_graph.py`` refuses it).
"""

from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.core.stage3.gather_pool import GatherPool
from lightning_zero.core.stage3.gathered import gathered_parameters
from lightning_zero.core.stage3.materialize import has_meta_parameters, initialize_modules
from lightning_zero.core.stage3.units import plan_units

__all__ = ["GatherPool", "apply_activation_checkpointing", "gathered_parameters", "has_meta_parameters",
           "initialize_modules", "plan_units"]
