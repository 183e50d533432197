"""Names and constants of the sharded checkpoint layout (Note [sharded checkpoint format] in format.py)."""

from __future__ import annotations

import torch

from lightning_zero.checkpoint.plain import CheckpointError

FORMAT_NAME = "lightning_zero.sharded_checkpoint"
FORMAT_VERSION = 1
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
