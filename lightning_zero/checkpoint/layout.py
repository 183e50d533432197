"""Names, constants and typed metadata records of the sharded checkpoint layout (Note [sharded checkpoint
format] in format.py).

Note [metadata records]
    ``metadata.json``'s ``groups`` entries are built and read as frozen records
    (:class:`FlatGroupRecord`, with its :class:`ShardPlace` s and :class:`ParamPlace` s) and stored
    as the plain JSON that format version 1 has always had: ``to_json`` writes the same keys in the
    same order (lists, not tuples), and ``from_json`` reads what any version-1 writer wrote, so a
    checkpoint written before the records existed loads unchanged. A field added here is a format
    change: bump ``FORMAT_VERSION``. Version 2 added the ``tensor_parallel`` record
    (:class:`TensorParallelRecord`) and the parts references of TP slices; a checkpoint without TP is
    still written as version 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero.checkpoint.plain import CheckpointError

FORMAT_NAME = "lightning_zero.sharded_checkpoint"
FORMAT_VERSION = 2  # the newest: TP slices (Note [TP slices in checkpoints] in slices.py)
READ_VERSIONS = (1, 2)
PLAIN_VERSION = 1  # what a checkpoint without TP slices is written as (version-1 readers read it)
METADATA = "metadata.json"
EXTRA = "extra.safetensors"
MODEL_KEYS = ("state_dict", "optimizer_states")  # written from the shards, not into the metadata


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"Unknown dtype {name!r} in the checkpoint's metadata.")
    return dtype


@dataclass(frozen=True)
class ShardPlace:
    """Elements ``[start, end)`` of a flat group, held by the rank file ``file`` (JSON: ``[file, start, end]``)."""

    file: int
    start: int
    end: int

    def to_json(self) -> list[int]:
        return [self.file, self.start, self.end]


@dataclass(frozen=True)
class ParamPlace:
    """A parameter inside a flat group: its state-dict key, first element and shape."""

    name: str | None
    offset: int
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "offset": self.offset, "shape": list(self.shape)}


@dataclass(frozen=True)
class FlatGroupRecord:
    """One flat group of a sharded checkpoint (an entry of ``metadata.json``'s ``groups``).

    Attributes:
        padded_numel: elements of the flat buffer, padding included.
        shards: where each data-parallel rank's shard is (one :class:`ShardPlace` per rank).
        dtype: the dtype of the ``g<i>.param`` shards, by name (``"float32"``).
        master: whether a separate fp32 master shard ``g<i>.master`` was written.
        optimizer_group: the optimizer param group of its parameters (-1: frozen parameters).
        params: its parameters, in buffer order.
    """

    padded_numel: int
    shards: tuple[ShardPlace, ...]
    dtype: str
    master: bool
    optimizer_group: int
    params: tuple[ParamPlace, ...]

    def to_json(self) -> dict[str, Any]:
        """The plain form written into ``metadata.json`` (Note [metadata records])."""
        return {"padded_numel": self.padded_numel, "shards": [s.to_json() for s in self.shards], "dtype": self.dtype,
                "master": self.master, "optimizer_group": self.optimizer_group,
                "params": [p.to_json() for p in self.params]}

    @classmethod
    def from_json(cls, plain: Mapping[str, Any], index: int) -> FlatGroupRecord:
        """The record of group ``index`` as ``metadata.json`` holds it; a malformed entry is a CheckpointError."""
        try:
            return cls(
                padded_numel=int(plain["padded_numel"]),
                shards=tuple(ShardPlace(int(f), int(a), int(b)) for f, a, b in plain["shards"]),
                dtype=str(plain["dtype"]),
                master=bool(plain["master"]),
                optimizer_group=int(plain["optimizer_group"]),
                params=tuple(ParamPlace(p["name"], int(p["offset"]), tuple(int(n) for n in p["shape"]))
                             for p in plain["params"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"Flat group {index} of the checkpoint's metadata is malformed "
                                  f"({type(err).__name__}: {err}); it was not written in lightning_zero's sharded "
                                  f"checkpoint format {FORMAT_VERSION}.") from err


@dataclass(frozen=True)
class TensorParallelRecord:
    """``metadata.json``'s ``tensor_parallel`` (version 2): the TP size the checkpoint was written at and, per
    state-dict key of a split parameter, the dimension it was cut along and its fused blocks (Note [TP slices
    in checkpoints] in slices.py). A key not listed is replicated: written whole by TP rank 0.

    Attributes:
        size: TP ranks that wrote slices.
        split: state-dict key -> ``(dim, chunks)``.
    """

    size: int
    split: Mapping[str, tuple[int, int]]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "split": {k: {"dim": d, "chunks": c} for k, (d, c) in self.split.items()}}

    @classmethod
    def from_json(cls, plain: Mapping[str, Any] | None) -> TensorParallelRecord | None:
        """The record, or ``None`` for a checkpoint written without TP; malformed: a CheckpointError."""
        if plain is None:
            return None
        try:
            split = {str(k): (int(v["dim"]), int(v["chunks"])) for k, v in plain["split"].items()}
            return cls(int(plain["size"]), split)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"The checkpoint's tensor_parallel record is malformed ({type(err).__name__}: {err})."
                                  ) from err
