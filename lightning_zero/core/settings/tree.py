"""The root of the settings tree: one frozen object holding every node a run is configured by.

Note [one settings tree]
    A run's settings are one :class:`Settings`: the ZeRO node (``zero``), where shards live (``offload``), the
    parallel sizes (``parallel``: pipeline, tensor, sequence, expert), the precision (``precision``; ``None``: the
    Trainer's) and the checkpoint format. Every node is a frozen dataclass that checks its own values when it is
    built; the rules across nodes are written once, in ``rules.py``. The routes in are translators into this tree
    and nothing more: ``ZeroStrategy``'s keyword arguments (``lightning/arguments.py``), the Hydra groups
    (``config/settings.py``, ``settings_of``) and a DeepSpeed JSON (``deepspeed/config.py``,
    ``deepspeed/strategy_args.py``); each checks the rules with the names its users write
    (``check_settings(settings, spelling)``). The strategy keeps the tree and hands each of its parts the nodes
    it needs, explicitly. The model is not part of the tree: any ``nn.Module`` / LightningModule is trained, ours
    or the user's (a Hugging Face model, a Hydra ``_target_``).

    Adding a setting: a field of the node it belongs to (with its check); a rule across nodes: one ``Rule`` in
    ``rules.py``; a parallel dimension: a size in :class:`ParallelSettings`, an axis of the mesh
    (``core/mesh/dims.py``), and an ``apply`` in ``parallel/`` (as expert parallelism: ``parallel.expert``, the
    ``EXPERT`` / ``EXPERT_DATA`` axes, ``parallel/expert.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_zero.core.common.choices import CheckpointFormat
from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.precision import PrecisionConfig
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.zero import ZeroConfig


@dataclass(frozen=True)
class ParallelSettings:
    """The model-parallel sizes; the data-parallel size is what the world leaves (``core/mesh/dims.py``).

    Args:
        pipeline: the pipeline (``None``: no split; a one-stage pipeline is none).
        tensor: ranks per tensor-parallel group and the plan (size 1: off).
        sequence: ranks per sequence group (DeepSpeed-Ulysses; 1: off).
        expert: ranks per expert-parallel group (``None``: the MoE layers' own ``ep_size``, found at setup,
            else off; Note [expert parallel in the strategy] in parallel/expert.py).
    """

    pipeline: PipelineConfig | None = None
    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    sequence: int = 1
    expert: ExpertParallelConfig | None = None

    def __post_init__(self) -> None:
        if self.pipeline is not None and self.pipeline.stages <= 1:
            object.__setattr__(self, "pipeline", None)
        if not isinstance(self.sequence, int) or isinstance(self.sequence, bool) or self.sequence < 1:
            raise ValueError(f"sequence_parallel must be a positive integer, got {self.sequence!r}")

    @property
    def stages(self) -> int:
        """Pipeline stages (1: none)."""
        return self.pipeline.stages if self.pipeline is not None else 1

    @property
    def experts(self) -> int:
        """Ranks per expert-parallel group as set (1: off, or left to the MoE layers)."""
        return self.expert.size if self.expert is not None else 1


@dataclass(frozen=True)
class Settings:
    """Every setting of a run (Note [one settings tree]).

    Args:
        zero: what is partitioned and how it is communicated.
        offload: where the optimizer (and stage 3's parameter) shards live.
        parallel: the pipeline, tensor, sequence and expert sizes.
        precision: the training precision; ``None``: the Trainer's.
        checkpoint_format: ``"auto"``, ``"sharded"`` or ``"consolidated"`` (a :class:`CheckpointFormat`).
    """

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    precision: PrecisionConfig | None = None
    checkpoint_format: CheckpointFormat = CheckpointFormat.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint_format", CheckpointFormat.of(self.checkpoint_format, "checkpoint_format"))

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are written in the sharded format (``"auto"``: at ZeRO stage >= 1, without expert
        parallelism, whose checkpoints hold the unsplit experts)."""
        fmt = self.checkpoint_format
        if self.parallel.experts > 1:
            return False
        return fmt is CheckpointFormat.SHARDED or (fmt is CheckpointFormat.AUTO and self.zero.stage.shards_optimizer)
