"""``gathered_parameters``: whole parameters for a moment, on every rank (DeepSpeed's
``GatheredParameters``), with an optional modification by one rank scattered back into the shards.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch
from torch import nn


class ZeroEngine(Protocol):
    """What this module needs of :class:`~lightning_zero.core.zero.engine.ZeroEngine` (a protocol, so that
    stage 3 does not import the engine that imports it)."""

    names: Mapping[nn.Parameter, str]

    def gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> AbstractContextManager[None]: ...

# attribute set on each parameter while an engine partitions it: a weak reference to the engine
# (a WeakKeyDictionary keyed by tensors crashed the interpreter at teardown in our tests)
_ATTR = "_lightning_zero_engine"


def register(engine: ZeroEngine) -> None:
    ref = weakref.ref(engine)
    for p in engine.names:
        setattr(p, _ATTR, ref)


def unregister(engine: ZeroEngine) -> None:
    for p in engine.names:
        if getattr(p, _ATTR, lambda: None)() is engine:
            delattr(p, _ATTR)


def _owner(p: torch.Tensor) -> ZeroEngine | None:
    ref = getattr(p, _ATTR, None)
    return ref() if ref is not None else None


@contextmanager
def gathered_parameters(
    params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None
) -> Iterator[None]:
    """Make ``params`` whole on every rank inside the block.

    Every rank of the data-parallel group must enter the block together (it communicates). With
    ``modifier_rank=None`` the parameters are for reading; changes are lost. With a rank, that
    rank's values at exit are broadcast to every rank and written into every rank's shard (and
    fp32 master copy), e.g. to initialise or surgically edit weights under stage 3. Parameters
    not managed by a ZeRO engine are left alone (the block is a no-op for them).

    Args:
        params: a parameter or an iterable of them (e.g. ``module.parameters()``).
        modifier_rank: data-parallel rank whose modification is kept, or ``None``.
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    engines = {id(e): e for p in params if (e := _owner(p)) is not None}
    if len(engines) > 1:
        raise ValueError("gathered_parameters got parameters of two different ZeRO engines; gather them separately.")
    if not engines:
        yield
        return
    engine = next(iter(engines.values()))
    with engine.gathered(params, modifier_rank):
        yield
