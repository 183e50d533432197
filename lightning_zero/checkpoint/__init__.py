"""Sharded, atomic, unpickle-free checkpoints (Note [sharded checkpoint format] in format.py)."""

from __future__ import annotations

from lightning_zero.checkpoint.convert import consolidate_checkpoint, convert_checkpoint
from lightning_zero.checkpoint.layout import FORMAT_VERSION
from lightning_zero.checkpoint.owned import load_owned_optimizer_state, load_owned_state_dict
from lightning_zero.checkpoint.plain import CheckpointError
from lightning_zero.checkpoint.reader import (
    LazyStateDict,
    ShardedCheckpoint,
    is_sharded_checkpoint,
    materialize_optimizer_state,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "LazyStateDict",
    "ShardedCheckpoint",
    "consolidate_checkpoint",
    "convert_checkpoint",
    "is_sharded_checkpoint",
    "load_owned_optimizer_state",
    "load_owned_state_dict",
    "materialize_optimizer_state",
]
