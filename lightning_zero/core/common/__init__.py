"""The leaf of core/: what every other folder shares, importing nothing of the package (torch only).

Public pieces: the enums users give as strings and ints, ``StrChoice``, ``ZeroStage``, ``Collective``,
``NonFinitePolicy``, ``OffloadDevice`` (``choices``); the flat, padded, sharded buffer of a group of parameters,
``FlatParamGroup``, ``ParamSlot``, ``overlap`` (``flat_param``); the model-state formulas and byte counts,
``ModelStateBytes``, ``StorageCounter``, ``model_state_formula``, ``offloaded_model_state``,
``tensor_parallel_model_state``, ``format_bytes`` (``memory``); the mark of a stand-in parameter without values,
``is_uninitialized``, ``mark_uninitialized``, ``mark_initialized`` (``uninitialized``).
"""

from lightning_zero.core.common.choices import Collective, NonFinitePolicy, OffloadDevice, StrChoice, ZeroStage
from lightning_zero.core.common.flat_param import FlatParamGroup, ParamSlot, overlap
from lightning_zero.core.common.memory import (
    ModelStateBytes,
    StorageCounter,
    format_bytes,
    model_state_formula,
    offloaded_model_state,
    tensor_parallel_model_state,
)
from lightning_zero.core.common.uninitialized import is_uninitialized, mark_initialized, mark_uninitialized

__all__ = ["Collective", "FlatParamGroup", "ModelStateBytes", "NonFinitePolicy", "OffloadDevice", "ParamSlot",
           "StorageCounter", "StrChoice", "ZeroStage", "format_bytes", "is_uninitialized", "mark_initialized",
           "mark_uninitialized", "model_state_formula", "offloaded_model_state", "overlap",
           "tensor_parallel_model_state"]
