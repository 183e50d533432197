"""Tensor-slicing model parallelism (Megatron-style layers on plain tensors; docs/tensor_parallel.md).

``config`` (``TensorParallelConfig``), ``collectives`` (the conjugate autograd functions over a TP group),
``layers`` (column / row-parallel ``Linear``, split tags), ``vocab`` (vocabulary-parallel embedding and
cross-entropy), ``styles`` (the plan vocabularies: HF strings, torch styles), ``regions`` (whole parameters
on split activations), ``plan`` (finding, checking and applying a plan), ``lightning`` (the strategy's side:
mesh, norm, sampler, refusals).
"""

from lightning_zero.checkpoint.slices import split_dim
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lightning_zero.tensor_parallel.styles import Colwise, Replicate, ReplicateGradSum, Rowwise, VocabEmbedding
from lightning_zero.tensor_parallel.vocab import vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "Colwise",
    "Replicate",
    "ReplicateGradSum",
    "RowParallelLinear",
    "Rowwise",
    "TPGroup",
    "TensorParallelConfig",
    "VocabEmbedding",
    "VocabParallelEmbedding",
    "split_dim",
    "vocab_parallel_cross_entropy",
]
