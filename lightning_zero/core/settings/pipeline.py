"""The pipeline node of the settings tree, ``PipelineConfig``: stages, schedule, micro-batches, partitioning.

Field names follow DeepSpeed's pipeline engine where it has one (``partition_method``,
``activation_checkpoint_interval``, ``micro_batches``). The schedules are PyTorch's own
(``torch.distributed.pipelining``); see docs/pipeline.md for which of them compose with ZeRO.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_zero.core.common.choices import PipeSchedule

SCHEDULES: tuple[str, ...] = tuple(s.value for s in PipeSchedule)
# torch schedules refused, with the reason (docs/pipeline.md)
REFUSED_SCHEDULES: dict[str, str] = {
    name: "it is not wired into lightning_zero: the zero-bubble schedules compute weight gradients in a "
    "separate pass and assign `param.grad` by hand (lightning_zero's deferred reduction would read them, but "
    "their stage placement and that pass are untested with ZeRO here); use 'gpipe', '1f1b' or 'interleaved_1f1b'"
    for name in ("interleaved_zero_bubble", "zbv_zero_bubble", "zero_bubble", "dualpipev", "looped_bfs")
}


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is split into pipeline stages and how micro-batches flow through them.

    Args:
        stages: pipeline stages (ranks per pipeline); the world size must be a multiple of it and
            the quotient is the data-parallel size over which ZeRO partitions.
        micro_batches: micro-batches per batch; must divide the per-data-parallel-rank batch size.
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"`` (one forward one backward, DeepSpeed's
            TrainSchedule) or ``"interleaved_1f1b"`` (needs ``virtual_stages >= 2``): a :class:`PipeSchedule`.
        virtual_stages: model chunks per rank (interleaved schedules).
        partition_method: ``"uniform"`` (equal layer counts), ``"parameters"`` (balanced parameter
            counts) or ``"type:<regex>"`` (balance the layers whose class name matches).
        activation_checkpoint_interval: recompute activations in backward for every group of this many
            layers (0: keep them).
        reduce_per_micro_batch: ZeRO stages 2-3: reduce-scatter each micro-batch's gradients as its
            backward ends instead of once per step, so no rank holds its stage's whole gradient (the
            peak model state drops by ``4 Psi_s`` bytes) at the price of ``micro_batches`` reductions
            per step (docs/pipeline.md has the measurement). Not with parameters tied across stages.
    """

    stages: int = 2
    micro_batches: int = 4
    schedule: PipeSchedule = PipeSchedule.ONE_F_ONE_B
    virtual_stages: int = 1
    partition_method: str = "parameters"
    activation_checkpoint_interval: int = 0
    reduce_per_micro_batch: bool = False

    def __post_init__(self) -> None:
        if str(self.schedule) in REFUSED_SCHEDULES:
            reason = REFUSED_SCHEDULES[str(self.schedule)]
            raise ValueError(f"pipeline schedule {str(self.schedule)!r} is not supported: {reason}.")
        try:
            object.__setattr__(self, "schedule", PipeSchedule.of(self.schedule))  # users pass strings
        except ValueError:
            raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {self.schedule!r}.") from None
        for name in ("stages", "micro_batches", "virtual_stages"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"pipeline `{name}` must be >= 1, got {getattr(self, name)!r}.")
        if self.activation_checkpoint_interval < 0:
            raise ValueError("`activation_checkpoint_interval` must be >= 0 (0: no activation checkpointing).")
        interleaved = self.schedule is PipeSchedule.INTERLEAVED_1F1B
        if interleaved != (self.virtual_stages > 1):
            raise ValueError(
                f"schedule={self.schedule!r} with virtual_stages={self.virtual_stages}: the interleaved schedule needs "
                "virtual_stages >= 2 and the others need virtual_stages=1."
            )
        if interleaved and self.micro_batches % self.stages:
            raise ValueError(f"interleaved_1f1b needs micro_batches ({self.micro_batches}) to be a multiple of "
                             f"stages ({self.stages}).")
        if self.schedule is PipeSchedule.ONE_F_ONE_B and self.micro_batches < self.stages:
            raise ValueError(f"schedule='1f1b' needs micro_batches >= stages ({self.micro_batches} < {self.stages}); "
                             "use more micro-batches, or schedule='gpipe'.")
        method = self.partition_method
        if method not in ("uniform", "parameters") and not method.startswith("type:"):
            raise ValueError(f"partition_method must be 'uniform', 'parameters' or 'type:<regex>', got {method!r}.")
        if method.startswith("type:"):
            try:
                re.compile(method[5:])
            except re.error as err:
                raise ValueError(f"partition_method {method!r}: bad regular expression ({err}).") from err

    @property
    def chunks(self) -> int:
        """Model chunks in the whole pipeline (``stages x virtual_stages``)."""
        return self.stages * self.virtual_stages

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises when it does not divide."""
        return _split_evenly(
            world_size, self.stages,
            f"The world size ({world_size} ranks) is not a multiple of pipeline stages={self.stages}: every "
            f"data-parallel replica needs {self.stages} ranks. Fix: devices x num_nodes a multiple of "
            f"{self.stages}, or fewer stages.",
        )

    def check_batch(self, batch_size: int, full_batch_size: int | None = None) -> None:
        """Raise unless ``micro_batches`` divides the per-rank batch size.

        Args:
            batch_size: the samples of this batch on this data-parallel rank.
            full_batch_size: the loader's batch size, when known: a smaller batch is the short last batch
                of an epoch (``drop_last=False``), and the message says so.
        """
        if full_batch_size is not None and batch_size < full_batch_size:
            _split_evenly(
                batch_size, self.micro_batches,
                f"The last batch of the epoch holds {batch_size} samples per data-parallel rank (the DataLoader's "
                f"batch size is {full_batch_size}; drop_last=False keeps the rest of the data set as a short batch), "
                f"which does not split into micro_batches={self.micro_batches} equal micro-batches. Fix: "
                "DataLoader(drop_last=True), or a data set length per data-parallel rank that the batch size "
                "divides.",
            )
            return
        _split_evenly(
            batch_size, self.micro_batches,
            f"The batch of {batch_size} samples per data-parallel rank does not split into micro_batches="
            f"{self.micro_batches} equal micro-batches. Fix: a batch size that is a multiple of "
            f"{self.micro_batches} (data.micro_batch_size / the DataLoader's batch_size), or other micro_batches.",
        )


def short_last_batch(samples: int, batch_size: int, drop_last: bool, micro_batches: int) -> str | None:
    """Why an epoch of ``samples`` per data-parallel rank ends in a batch that does not split into
    ``micro_batches`` (``None``: every batch splits; ``batch_size`` itself is checked by ``check_batch``)."""
    short = samples % batch_size
    if drop_last or short % micro_batches == 0:
        return None
    return (f"The train DataLoader's last batch of each epoch holds {short} samples per data-parallel rank "
            f"({samples} samples, batch_size={batch_size}, drop_last=False), which does not split into "
            f"micro_batches={micro_batches} equal micro-batches: the run would stop there. Fix: "
            f"DataLoader(drop_last=True), a batch size that divides {samples}, or a data set length per "
            f"data-parallel rank that leaves a last batch of a multiple of {micro_batches} samples.")


def _split_evenly(total: int, parts: int, error: str) -> int:
    """``total // parts``, or ``ValueError(error)`` when ``parts`` does not divide ``total``."""
    if total % parts:
        raise ValueError(error)
    return total // parts
