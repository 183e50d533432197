"""PyTorch FSDP2 as a Lightning strategy, the reference stage 3 is compared with."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


class FSDP2Strategy(ModelParallelStrategy):
    """PyTorch FSDP2 driven by Lightning's ModelParallelStrategy (which, unlike FSDPStrategy, runs on CPU):
    ``fully_shard`` on every transformer block, then on the root, over a 1-D data-parallel mesh of all ranks.
    Defaults otherwise (``reshard_after_forward=True``, fp32, no mixed precision, no CPU offload)."""

    def __init__(self, **fsdp_options: Any) -> None:
        super().__init__(tensor_parallel_size=1, process_group_backend="gloo")
        self.fsdp_options = fsdp_options

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank is a data-parallel rank
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        mesh = self.device_mesh["data_parallel"]
        gpt = self.lightning_module.model
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh, **self.fsdp_options)
        fully_shard(gpt, mesh=mesh, **self.fsdp_options)
        super().setup(trainer)  # then the optimizer is built on the sharded (DTensor) parameters
