"""A Hugging Face model directory as ``save_pretrained`` writes it (``config.json``, the weights in safetensors,
possibly sharded with ``model.safetensors.index.json``, and a tokenizer), read without ``transformers`` or Lightning:
what the launcher checks before any rank starts (the files, the tensors' names, shapes and dtypes from the files'
headers, the number of parameters) and the keys the ranks compare with the model they build."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header: dtype (safetensors' name, e.g. ``F32``) and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of a ``.safetensors`` file from its JSON header (8 bytes of length, then the header)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: TensorInfo(v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


@dataclass(frozen=True)
class HFDirectory:
    """A local directory ``save_pretrained`` wrote.

    Args:
        path: the directory.
    """

    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    def config(self) -> dict[str, Any]:
        """``config.json`` as plain data."""
        return json.loads(self.config_file.read_text())

    def weight_files(self) -> dict[str, Path]:
        """Key -> file: the index's weight map, or every key of one ``model.safetensors``.

        Raises:
            FileNotFoundError: neither is there (``pytorch_model.bin`` weights are named with the fix).
        """
        index = self.path / INDEX_FILE
        if index.is_file():
            return {k: self.path / name for k, name in json.loads(index.read_text())["weight_map"].items()}
        single = self.path / SINGLE_FILE
        if single.is_file():
            return dict.fromkeys(read_header(single), single)
        legacy = [p.name for p in self.path.glob("pytorch_model*.bin")]
        fix = (f" It holds {', '.join(legacy)}: the pickle format, which is not read (it runs code on load). Fix: "
               "load it once with transformers and `save_pretrained(dir)` (safetensors by default).") if legacy else ""
        raise FileNotFoundError(f"{self.path} holds neither {INDEX_FILE} nor {SINGLE_FILE}.{fix}")

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor of the weight files, from their headers (no tensor is read)."""
        out: dict[str, TensorInfo] = {}
        files = self.weight_files()
        for file in sorted(set(files.values())):
            header = read_header(file)
            out.update({k: v for k, v in header.items() if files.get(k) == file})
        return out

    def num_parameters(self) -> int:
        """The elements of every tensor in the weight files (a tied weight is saved once)."""
        return sum(t.numel for t in self.tensors.values())

    def weight_bytes(self) -> int:
        """The bytes of the weight files on disk."""
        return sum(p.stat().st_size for p in set(self.weight_files().values()))

    def tokenizer_files(self) -> list[Path]:
        """The tokenizer's files in the directory (empty: no tokenizer saved)."""
        return [self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()]

    def problems(self, key: str = "model.path") -> list[str]:
        """What the directory lacks to be loaded, each with its fix (empty when nothing)."""
        if not self.path.is_dir():
            return [f"{key}={self.path} is not a directory. Fix: the directory `model.save_pretrained(dir)` wrote."]
        out = []
        if not self.config_file.is_file():
            out.append(f"{key}={self.path} has no {CONFIG_FILE}. Fix: the directory `model.save_pretrained(dir)` "
                       "wrote (it writes the config with the weights).")
        try:
            files = self.weight_files()
        except FileNotFoundError as err:
            return [*out, f"{key}: {err}"]
        absent = sorted({p.name for p in files.values() if not p.is_file()})
        if absent:
            out.append(f"{key}: {INDEX_FILE} names files that are not there: {', '.join(absent)}.")
        return out
