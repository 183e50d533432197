"""The settings tree (Note [one settings tree] in ``tree.py``): frozen dataclasses, one node per concern, each
checking its own values where it is built, and the rules across nodes written once (``rules.py``).

Public pieces: the root, ``Settings``, and the parallel sizes, ``ParallelSettings`` (``tree``); the ZeRO node,
``ZeroConfig`` (``zero``); the offload node, ``OffloadConfig``, with the check of a swap directory,
``nvme_path_problem``, and ``offload_from_args`` (``offload``); the precision node, ``PrecisionConfig``, its
``LossScalerConfig`` and the flat buffers' dtypes, ``DtypePolicy`` (``precision``); the pipeline node,
``PipelineConfig`` (``pipeline``); the tensor-parallel node, ``TensorParallelConfig`` (``tensor``); the
expert-parallel node, ``ExpertParallelConfig`` (``expert``); the rules,
``Rule``, ``RULES``, ``settings_problems``, ``check_settings`` (``rules``). Their enums live in
``core/common/choices.py``.
"""

from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.offload import OffloadConfig, nvme_path_problem, offload_from_args
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.precision import DtypePolicy, LossScalerConfig, PrecisionConfig
from lightning_zero.core.settings.rules import RULES, Rule, check_settings, settings_problems
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import ParallelSettings, Settings
from lightning_zero.core.settings.zero import ZeroConfig

__all__ = ["RULES", "DtypePolicy", "ExpertParallelConfig", "LossScalerConfig", "OffloadConfig", "ParallelSettings",
           "PipelineConfig", "PrecisionConfig", "Rule", "Settings", "TensorParallelConfig", "ZeroConfig",
           "check_settings", "nvme_path_problem", "offload_from_args", "settings_problems"]
