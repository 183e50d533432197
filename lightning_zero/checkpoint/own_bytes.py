"""Tensors that hold their own bytes only, before ``torch.save``.

``torch.save`` writes a tensor's whole storage: a parameter that views a slice of a flat ZeRO buffer
would drag the buffer along (a 26 MB model saved as 433 MB). :func:`own_bytes` copies such views into
tensors of their own size, keeping tensors that shared one storage region shared (tied weights).
"""

from __future__ import annotations

from typing import Any

import torch


def _needs_copy(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return storage.nbytes() > t.numel() * t.element_size() or not t.is_contiguous()


def own_bytes(obj: Any, _memo: dict[tuple[Any, ...], torch.Tensor] | None = None) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor that views a larger storage replaced by a
    compact copy; other values and already-compact tensors are returned as they are (not copied)."""
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta" or not _needs_copy(obj):
            return obj
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
        if key not in memo:
            copy = obj.detach().clone(memory_format=torch.contiguous_format)
            memo[key] = torch.nn.Parameter(copy, obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else copy
        return memo[key]
    if isinstance(obj, dict):
        out = {k: own_bytes(v, memo) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        try:
            rebuilt = type(obj)(out)  # OrderedDict and friends, with a state dict's _metadata
        except TypeError:
            return out
        if hasattr(obj, "_metadata"):
            rebuilt._metadata = obj._metadata
        return rebuilt
    if isinstance(obj, list):
        return [own_bytes(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(own_bytes(v, memo) for v in obj)
    return obj
