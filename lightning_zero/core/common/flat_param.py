"""One flat, padded buffer per group of parameters, split into equal shards.

Note [flat shard layout]
    The trainable parameters of one optimizer param group are laid end to end, in module order,
    in one 1-D buffer whose length is padded up to a multiple of the data-parallel world size N.
    Rank r owns elements ``[r * S, (r + 1) * S)`` with ``S = padded / N`` (its *shard*). The
    module's ``nn.Parameter`` objects stay the same Python objects; while bound, their ``.data``
    are views into the buffer, so an in-place update of the buffer is an update of the module.
    Padding elements are zero in parameters and gradients and stay zero under any element-wise
    optimizer, so they change neither norms nor updates. Every stage uses this one layout; a stage
    only chooses which buffers are kept whole and which as the local shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero.core.common.uninitialized import is_uninitialized


def overlap(start: int, end: int, other_start: int, other_end: int) -> tuple[int, int]:
    """The intersection ``[lo, hi)`` of ``[start, end)`` and ``[other_start, other_end)``; empty: ``hi <= lo``."""
    return max(start, other_start), min(end, other_end)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its flat buffer."""

    param: nn.Parameter
    offset: int  # first element in the flat buffer
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters of one flat group that is reduced as one message.

    ``order`` is the bucket's place in the fixed launch order shared by all ranks
    (Note [fixed launch order] in ``grad_reducer.py``).
    """

    group_index: int
    start: int  # first element in the flat buffer
    end: int  # one past the last element
    slots: tuple[int, ...]  # indices into FlatParamGroup.slots
    order: int


class FlatParamGroup:
    """The flat buffer of one optimizer param group (Note [flat shard layout]).

    Args:
        params: trainable parameters of the group, in module order; one dtype and device.
        world_size: number of data-parallel ranks N.
        rank: this rank's index in the data-parallel group.
        experts: the group holds expert parameters, sharded over the expert-data group (``world_size`` and
            ``rank`` are that group's; its collectives are ``comm.of(True)``'s, Note [expert axes] in
            core/mesh/dims.py).
    """

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int, experts: bool = False) -> None:
        if params:
            dtypes = {p.dtype for p in params}
            devices = {p.device for p in params}
            if len(dtypes) > 1 or len(devices) > 1:
                raise ValueError(
                    f"One optimizer param group holds parameters of several dtypes {sorted(map(str, dtypes))} "
                    f"or devices {sorted(map(str, devices))}. Cast the module to one dtype and device first "
                    "(the precision plugin does this), or split the group."
                )
        self.world_size = world_size
        self.rank = rank
        self.experts = experts
        self.slots: list[ParamSlot] = []
        offset = 0
        for p in params:
            self.slots.append(ParamSlot(p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel: int = offset  # elements of real parameters
        self.padded_numel: int = -(-max(offset, 1) // world_size) * world_size  # multiple of N, >= 1 shard elem
        self.shard_numel: int = self.padded_numel // world_size  # S
        self.dtype: torch.dtype = params[0].dtype if params else torch.float32
        self.device: torch.device = params[0].device if params else torch.device("cpu")
        self.flat: torch.Tensor | None = None  # 1-D padded parameter buffer while bound; stage 3 frees its storage
        self.shard: torch.Tensor | None = None  # stage 3: this rank's 1-D parameter shard, kept while flat is freed
        self.optimizer_group: int = -1  # index of its optimizer param group; -1: frozen / in no group

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r * self.shard_numel, (r + 1) * self.shard_numel

    def own_shard(self) -> torch.Tensor:
        """Where this rank's shard of the parameters lives (the optimizer steps it)."""
        if self.shard is not None:
            return self.shard
        start, end = self.shard_range()
        return self.flat[start:end]

    def bind(self) -> torch.Tensor:
        """Copy the parameters into a new flat buffer and make them views into it."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for s in self.slots:
                view = flat[s.offset : s.offset + s.numel]
                if not is_uninitialized(s.param):  # else: initialised in place later (materialize.py)
                    view.copy_(s.param.data.reshape(-1))
                s.param.data = view.view(s.shape)
        self.flat = flat
        return flat

    def unbind(self) -> None:
        """Give every parameter its own storage again (a copy of its current value)."""
        if self.flat is None:
            return
        for s in self.slots:
            s.param.data = s.param.data.clone()
        self.flat = None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (parameter shapes) into a buffer laid out like this group."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]
