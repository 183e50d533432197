"""The enums every part of the core shares: the ZeRO stage, the collectives, the offload device, and the
non-finite policy, each on :class:`StrChoice` (or an ``IntEnum`` for the stage) so that users give them as the
strings and ints of YAML, JSON and keyword arguments.

The leaf of core/ (docs/design.md, "One order inside core"): it imports nothing of the package.
"""

from __future__ import annotations

import enum


class StrChoice(str, enum.Enum):
    """A setting users give as a string (YAML, JSON, keyword arguments): each member equals its string.

    ``str()``, f-strings and ``repr()`` (in error messages) read as the string itself, so messages and
    logs look as they did when the setting was a plain string.
    """

    @classmethod
    def of(cls, value: str | StrChoice, what: str | None = None) -> StrChoice:
        """The member ``value`` names, or a ``ValueError`` listing the valid strings (``what``: the setting)."""
        try:
            return cls(value)
        except ValueError:
            *most, last = [repr(m.value) for m in cls]
            raise ValueError(f"`{what or cls.__name__}` must be {', '.join(most)} or {last}, got {value!r}.") from None

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)


class NonFinitePolicy(StrChoice):
    """What a ``nan`` / ``inf`` reduced gradient does in fp32 / bf16 (Note [non-finite policy] in
    ``core/precision/nonfinite.py``; fp16 keeps its loss scaler)."""

    OFF = "off"
    """Not checked: the optimizer steps on whatever the gradients hold (no collective spent on it)."""
    SKIP = "skip"
    """The step is skipped on every rank (parameters and optimizer state unchanged) and counted."""
    RAISE = "raise"
    """Every rank raises ``NonFiniteGradientError`` naming the first parameter with such a gradient."""


class ZeroStage(enum.IntEnum):
    """How much of the training state is partitioned over the data-parallel ranks.

    An ``IntEnum``: ``stage == 3``, ``f"zero{stage}"`` and logged hyperparameters still read as the
    plain number; code asks the predicates (``shards_gradients``) instead of comparing numbers.
    """

    DATA_PARALLEL = 0
    """Nothing partitioned: every rank holds the whole model state; gradients are all-reduced (DDP)."""
    OPTIMIZER_STATE = 1
    """The master weights and optimizer state are sharded; parameters and gradients stay whole."""
    GRADIENTS = 2
    """Stage 1 plus the reduced gradients: each rank keeps only its shard of them."""
    PARAMETERS = 3
    """Stage 2 plus the parameters: units are gathered just in time for forward and backward."""

    @classmethod
    def of(cls, value: int | str | ZeroStage) -> ZeroStage:
        """The stage a user gave (``3``, ``"3"``, ``ZeroStage.PARAMETERS``); a ``ValueError`` names the valid ones."""
        if isinstance(value, cls):
            return value
        try:
            if isinstance(value, bool):
                raise ValueError
            number = int(value) if isinstance(value, str) else value
            if isinstance(number, int):
                return cls(number)
        except ValueError:
            pass
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {value!r}.")

    def __str__(self) -> str:  # the number, as Python >= 3.11 prints an IntEnum (3.10 too)
        return str(int(self))

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    def __repr__(self) -> str:  # error messages quote the setting as the user wrote it: stage=3
        return str(int(self))

    @property
    def shards_optimizer(self) -> bool:
        """Whether the master weights and optimizer state are sharded (stage >= 1)."""
        return self >= ZeroStage.OPTIMIZER_STATE

    @property
    def shards_gradients(self) -> bool:
        """Whether each rank keeps only its shard of the reduced gradients (stage >= 2)."""
        return self >= ZeroStage.GRADIENTS

    @property
    def shards_parameters(self) -> bool:
        """Whether the parameters are sharded and gathered per unit (stage 3)."""
        return self is ZeroStage.PARAMETERS


class Collective(StrChoice):
    """How the ZeRO engine reduces gradients and gathers parameters (``ZeroConfig.collective``)."""

    AUTO = "auto"
    """``ALL_REDUCE`` on gloo (measured 1.4-2x faster there, docs/benchmarks.md), ``REDUCE_SCATTER`` elsewhere."""
    ALL_REDUCE = "all_reduce"
    """Gradient buckets all-reduced; parameters gathered with one broadcast per owning rank."""
    REDUCE_SCATTER = "reduce_scatter"
    """Gradients reduce-scattered; parameters all-gathered."""


class OffloadDevice(StrChoice):
    """Where offloaded state lives (DeepSpeed's ``offload_optimizer.device`` / ``offload_param.device``).

    The member names are the strings, so the Hydra ``offload/`` group's YAML (``optimizer_device: cpu``) parses.
    """

    none = "none"
    """Not offloaded: the state stays with the parameters, on the training device."""
    cpu = "cpu"
    """Separate host memory (pinned with ``pin_memory`` and an accelerator)."""
    nvme = "nvme"
    """Run-private swap files under ``nvme_path``, mapped as tensors (Note [swap files] in ``swap_file.py``)."""


class CheckpointFormat(StrChoice):
    """How the strategy saves checkpoints (``ZeroStrategy(checkpoint_format=...)``; both formats are read)."""

    AUTO = "auto"
    """``SHARDED`` when the optimizer is sharded (ZeRO stage >= 1), else ``CONSOLIDATED``."""
    SHARDED = "sharded"
    """Every rank writes its own shards into one directory (docs/checkpoints.md)."""
    CONSOLIDATED = "consolidated"
    """Lightning's one file, gathered on rank 0."""


class PipeSchedule(StrChoice):
    """The pipeline schedules built (torch's ``torch.distributed.pipelining``; docs/pipeline.md)."""

    GPIPE = "gpipe"
    """Fill-drain: every micro-batch's forward, then every backward."""
    ONE_F_ONE_B = "1f1b"
    """One forward one backward (DeepSpeed's TrainSchedule): at most ``stages`` micro-batches in flight."""
    INTERLEAVED_1F1B = "interleaved_1f1b"
    """1F1B over ``virtual_stages`` model chunks per rank."""

    @classmethod
    def of(cls, value: str | StrChoice, what: str | None = None) -> StrChoice:
        """Also the spellings of the Hydra group and DeepSpeed (``one_f_one_b``, ``interleaved``)."""
        return super().of({"one_f_one_b": "1f1b", "interleaved": "interleaved_1f1b"}.get(str(value), value), what)


class PrecisionMode(StrChoice):
    """The training precision, in Lightning's names (docs/precision.md)."""

    FP32 = "32-true"
    """Everything fp32; the master is the parameter buffer itself."""
    FP16_MIXED = "16-mixed"
    """fp16 parameters and gradients, fp32 master shards, DeepSpeed's loss scaler."""
    BF16_MIXED = "bf16-mixed"
    """bf16 parameters and gradients, fp32 master shards."""
    BF16_TRUE = "bf16-true"
    """bf16 parameters, gradients and optimizer state; no master copy."""

    @classmethod
    def of(cls, value: str | StrChoice, what: str | None = None) -> StrChoice:
        """Also Lightning's short names (``"32"``, ``"16"``, ``"bf16"``); ``"16-true"`` is refused with the reason."""
        name = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(str(value), str(value))
        try:
            return cls(name)
        except ValueError:
            hint = (" fp16 weights without an fp32 master lose small updates; use '16-mixed' (fp32 master "
                    "shards) or 'bf16-true'." if name == "16-true" else "")
            raise ValueError(f"Unknown precision {value!r} for ZeroStrategy. Use one of '32-true', '16-mixed', "
                             f"'bf16-mixed', 'bf16-true'.{hint}") from None
