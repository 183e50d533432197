"""Plain data <-> JSON, with tensors kept aside (Note [plain checkpoint data]).

Note [plain checkpoint data]
    Everything of a Lightning checkpoint that is not a model or optimizer tensor (loop progress,
    callbacks, LR schedulers, loss-scaler state, hyper-parameters) is written as JSON. Values must
    be plain: ``None``, ``bool``, ``int``, ``float`` (also inf / nan), ``str``, lists, tuples and
    dicts (any plain keys), OmegaConf containers (stored as plain containers, resolved), numpy
    scalars, ``torch.dtype`` and tensors. A tensor is replaced by a reference into a side
    safetensors file. Anything else raises :class:`CheckpointError` naming its key: nothing is
    ever pickled, so reading needs no unpickling. Markers are one-key dicts whose key starts with
    ``"__"``; a user dict that looks like one is stored as a list of items, so it cannot be
    confused with a marker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (bad input, unsupported value, unsafe file)."""


_MARKERS = ("__tensor__", "__tuple__", "__items__", "__float__", "__dtype__")


def to_plain(value: Any, tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> Any:
    """``value`` as JSON-able data; tensors are moved into ``tensors`` and referenced."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    try:  # OmegaConf (Hydra) containers: stored as plain containers
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is optional
        pass
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return to_plain(value.item(), tensors, where)
        if isinstance(value, np.ndarray):
            return to_plain(torch.from_numpy(value.copy()), tensors, where)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, tuple):
        return {"__tuple__": [to_plain(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_plain(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_plain(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__items__": [[to_plain(k, tensors, f"{where} key {k!r}"), to_plain(v, tensors, f"{where}[{k!r}]")]
                              for k, v in value.items()]}
    raise CheckpointError(
        f"The checkpoint entry {where} holds a {type(value).__module__}.{type(value).__qualname__}. The sharded "
        "checkpoint format stores only plain data (None, bool, int, float, str, list, tuple, dict), OmegaConf "
        "containers and tensors, so that loading never unpickles. Convert it to plain data (e.g. in "
        "`on_save_checkpoint` / a callback's `state_dict`, or `save_hyperparameters(ignore=[...])`), or use "
        "`ZeroStrategy(checkpoint_format='consolidated')`."
    )


def from_plain(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(value, list):
        return [from_plain(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
        if key == "__tensor__":
            if inner not in tensors:
                raise CheckpointError(f"The checkpoint's metadata refers to tensor {inner!r}, which is missing.")
            return tensors[inner]
        if key == "__tuple__":
            return tuple(from_plain(v, tensors) for v in inner)
        if key == "__items__":
            return {_hashable(from_plain(k, tensors)): from_plain(v, tensors) for k, v in inner}
        if key == "__float__":
            return float(inner)
        if key == "__dtype__":
            dtype = getattr(torch, str(inner), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"Unknown dtype {inner!r} in the checkpoint's metadata.")
            return dtype
    return {k: from_plain(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
