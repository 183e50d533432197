"""The device mesh: the sizes of the parallel dimensions and their process groups, built once.

Public pieces: ``Axis``, ``ParallelDims`` (``dims``: sizes checked once, rank layout, which dimensions
are on) and ``ProcessMesh`` (``groups``: this rank's coordinates and process groups). Every parallelism
(ZeRO over data x sequence, pipeline stages, tensor, sequence and expert parallel) takes its groups from here.
"""

from lightning_zero.core.mesh.dims import FINE_ORDER, ORDER, Axis, ParallelDims
from lightning_zero.core.mesh.groups import ProcessMesh

__all__ = ["FINE_ORDER", "ORDER", "Axis", "ParallelDims", "ProcessMesh"]
