"""The mark of a stand-in parameter that has no values yet: built on the meta device and replaced by a storage-less
parameter (Note [sharded construction] in ``core/stage3/materialize.py``), until its unit initialises it.

Here, in the leaf of core/, because the flat buffer reads it too: ``FlatParamGroup.bind`` copies every parameter
into the buffer except the ones still marked (Note [split owners] in ``materialize.py``).
"""

from __future__ import annotations

import torch

_UNINITIALIZED = "_lightning_zero_uninitialized"  # attribute on parameters replaced from meta


def mark_uninitialized(p: torch.Tensor) -> None:
    """Mark ``p`` as a stand-in without values (set by the meta replacement)."""
    setattr(p, _UNINITIALIZED, True)


def is_uninitialized(p: torch.Tensor) -> bool:
    """Whether ``p`` is a stand-in that no initialiser has filled yet."""
    return bool(getattr(p, _UNINITIALIZED, False))


def mark_initialized(p: torch.Tensor) -> None:
    """Drop the uninitialised mark (a stand-in that is never initialised here: another rank's)."""
    if hasattr(p, _UNINITIALIZED):
        delattr(p, _UNINITIALIZED)
