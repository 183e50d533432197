"""Sequence parallelism applied to a module (:func:`apply_sequence_parallel`): the sequence groups on the device mesh,
the model told its :class:`SequenceGroup`; the data is sharded over the data dimension only (the mesh's ``data_shard``).

Note [sequence parallel in the strategy]
    With ``sequence_parallel=P`` the world is ``data x sequence`` (Note [rank order] in core/mesh/dims.py:
    rank ``r = d * P + s``). ZeRO's group spans both (``ParallelDims.zero_axes``), which is the whole world
    here since pipelines and tensor parallel are refused with it, so the strategy's data-parallel comm is
    unchanged; the sequence groups come from the strategy's ``ProcessMesh``. Lightning's sampler
    gets ``num_replicas = D``, ``rank = d``: the P ranks of a sequence group draw the same samples, and the
    model (through ``configure_sequence_parallel``) takes each rank's slice of every sequence.
"""

from __future__ import annotations

from torch import nn

from lightning_zero.core.common.errors import UsageError
from lightning_zero.core.mesh import Axis, ProcessMesh
from lightning_zero.sequence_parallel.checks import check_sequence_parallel
from lightning_zero.sequence_parallel.group import SequenceGroup

HOOK = "configure_sequence_parallel"


class StrategySequenceParallel:
    """One strategy's sequence dimension (size > 1): its group from the strategy's mesh (made once per strategy
    and closed at exit with the mesh, Note [clean exit] in core/comm/process_groups.py)."""

    def __init__(self, mesh: ProcessMesh) -> None:
        self.dims = mesh.dims
        self.rank = mesh.rank
        check_sequence_parallel(self.dims.sequence, world_size=self.dims.world_size)
        self.group = SequenceGroup(mesh.group(Axis.SEQUENCE), self.dims.sequence, mesh.index(Axis.SEQUENCE))

    def attach(self, module: nn.Module) -> None:
        """Tell ``module`` its sequence group; refuse a module that cannot take it."""
        hook = getattr(module, HOOK, None)
        if hook is None:
            raise UsageError(
                f"sequence_parallel={self.group.size}: {type(module).__name__} has no `{HOOK}(sequence_group)` "
                "method, so nothing would split its sequences. The GPT experiment (lightning_zero.models.gpt) "
                "has it; for your own model implement it (slice the batch, global positions, attention through "
                "lightning_zero.sequence_parallel.DistributedAttention, the token-weighted loss: "
                "docs/sequence_parallel.md). Hugging Face models are not supported yet.")
        hook(self.group)

    @staticmethod
    def detach(module: nn.Module) -> None:
        hook = getattr(module, HOOK, None)
        if hook is not None:
            hook(None)


def apply_sequence_parallel(module: nn.Module, mesh: ProcessMesh) -> StrategySequenceParallel | None:
    """Tell ``module`` its sequence group on ``mesh`` (``None``: the mesh has no sequence dimension); its attention
    then runs between the all-to-alls. :meth:`StrategySequenceParallel.detach` undoes it."""
    if not mesh.dims.sequence_enabled:
        return None
    sequence = StrategySequenceParallel(mesh)
    sequence.attach(module)
    return sequence
