"""ZeRO partitioning (stages 0-2, and the engine every stage runs in): torch only.

Public pieces named here: ``ZeroConfig``, ``DtypePolicy``, ``ZeroStage``, ``NonFinitePolicy``, ``StrChoice``
(``config``), ``FlatParamGroup`` (``flat_param``: the flat sharded buffer), ``ModelStateBytes``,
``model_state_formula``, ``format_bytes`` (``memory``).

Not named here, import them from their modules: the engine (``ZeroEngine``, ``StageCoupling`` in ``engine``;
``StepState`` in ``engine_step``), the gradient hooks and buckets (``grad_reducer``: ``ReductionMode``) and the
optimizer re-pointed at shards (``optimizer``, ``optimizer_state``). They import ``core/stage3``, ``core/offload``
and ``core/comm``, whose modules import this package's ``config`` / ``flat_param``: naming them here would be an
import cycle through this ``__init__`` (``tests/unit/test_import_graph.py`` refuses it).
"""

from lightning_zero.core.zero.config import DtypePolicy, NonFinitePolicy, StrChoice, ZeroConfig, ZeroStage
from lightning_zero.core.zero.flat_param import FlatParamGroup
from lightning_zero.core.zero.memory import ModelStateBytes, format_bytes, model_state_formula

__all__ = ["DtypePolicy", "FlatParamGroup", "ModelStateBytes", "NonFinitePolicy", "StrChoice", "ZeroConfig",
           "ZeroStage", "format_bytes", "model_state_formula"]
