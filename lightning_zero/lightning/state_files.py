"""Whole-model weight files opened lazily: a ``.safetensors`` file, the safetensors shards of a directory
(``save_pretrained``'s ``model.safetensors.index.json`` and its files, or one ``model.safetensors``), or a
``torch.save`` file (a Lightning checkpoint's ``state_dict`` is found) as a read-only mapping that loads one
tensor per access, for :func:`lightning_zero.core.zero.loading.load_full_state_dict`.

The file-format glue lives here, outside ``core/`` (which imports only torch and the standard
library): safetensors is imported only when a ``.safetensors`` file is opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
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


SAFETENSORS_INDEX = "model.safetensors.index.json"  # save_pretrained's names
SAFETENSORS_SINGLE = "model.safetensors"


def safetensors_weight_map(path: str | os.PathLike) -> dict[str, Path]:
    """Key -> the file holding it, for a directory ``save_pretrained`` wrote (its index, or one
    ``model.safetensors``) or an index file.

    Raises:
        FileNotFoundError: no index and no ``model.safetensors`` (the message names the directory and the fix).
    """
    path = Path(path)
    index = path if path.is_file() else path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: index.parent / name for key, name in weight_map.items()}
    single = path / SAFETENSORS_SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"{path} holds neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}: the weights "
                            "save_pretrained writes (`model.save_pretrained(dir)`, safetensors by default).")


class SafetensorsFiles(Mapping[str, torch.Tensor]):
    """A read-only mapping over several ``.safetensors`` files (sharded weights and their index): each file is
    opened on the first access to one of its keys, and one tensor is loaded per access.

    Args:
        weight_map: key -> the file holding it (:func:`safetensors_weight_map`).
    """

    def __init__(self, weight_map: Mapping[str, Path]) -> None:
        self._where = dict(weight_map)
        self._open: dict[Path, SafetensorsFile] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self._where[key]
        if path not in self._open:
            self._open[path] = SafetensorsFile(str(path))
        return self._open[path][key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def open_state_dict(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A lazily loading mapping for a path (``.safetensors``; a directory of safetensors shards or their
    ``.index.json``; or a ``torch.save`` file memory-mapped) or the mapping itself.

    Args:
        source: a path or a mapping of key -> tensor.
    """
    if isinstance(source, Mapping):
        return source
    path = os.fspath(source)
    if path.endswith(".safetensors"):
        return SafetensorsFile(path)
    if os.path.isdir(path) or path.endswith(".index.json"):
        return SafetensorsFiles(safetensors_weight_map(path))
    loaded: Any = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    return loaded
