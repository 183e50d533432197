"""Activation checkpointing per unit: recompute a block's activations in backward.

``apply_activation_checkpointing`` wraps the ``forward`` of each unit module (the same units
stage 3 gathers, Note [units] in ``units.py``) in non-reentrant ``torch.utils.checkpoint``: only
the unit's inputs are kept from forward, and the unit runs again in backward to rebuild what its
gradient needs. Under stage 3 the unit's parameters are gathered again before its backward
starts (the pre-backward hook on its output fires first), so the recompute sees whole
parameters; the wrapped function is the module's own ``forward``, so the recompute does not run
the gather / release hooks a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(modules: list[nn.Module]) -> Callable[[], None]:
    """Wrap each module's forward in checkpointing; returns a function that undoes it."""
    wrapped: list[nn.Module] = []
    for module in modules:
        if "forward" in module.__dict__:
            raise ValueError(
                f"{type(module).__name__}.forward is already replaced on the instance (wrapped twice?). Turn "
                "activation checkpointing on in one place only."
            )
        inner = module.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # evaluation: nothing to save
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        wrapped.append(module)

    def undo() -> None:
        for module in wrapped:
            module.__dict__.pop("forward", None)

    return undo
