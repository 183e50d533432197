"""Whole-model weight files opened lazily: a ``.safetensors`` file or a ``torch.save`` file (a
Lightning checkpoint's ``state_dict`` is found) as a read-only mapping that loads one tensor per
access, for :func:`lightning_zero.core.zero.loading.load_full_state_dict`.

The file-format glue lives here, outside ``core/`` (which imports only torch and the standard
library): safetensors is imported only when a ``.safetensors`` file is opened.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class SafetensorsFile(Mapping[str, torch.Tensor]):
    """A read-only mapping over a ``.safetensors`` file that loads one tensor per access.

    Args:
        path: the file.
    """

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self._file = safe_open(path, framework="pt", device="cpu")
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def open_state_dict(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A lazily loading mapping for a path (``.safetensors``, or a ``torch.save`` file memory-mapped)
    or the mapping itself.

    Args:
        source: a path or a mapping of key -> tensor.
    """
    if isinstance(source, Mapping):
        return source
    path = os.fspath(source)
    if path.endswith(".safetensors"):
        return SafetensorsFile(path)
    loaded: Any = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    return loaded
