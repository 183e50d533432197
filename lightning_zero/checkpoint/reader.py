"""Reading a sharded checkpoint directory: validation, lazy whole tensors, slices of parameters.

JSON and safetensors only (never unpickled). Whole tensors are read on access (``LazyStateDict``,
the lazy optimizer state); :meth:`ShardedCheckpoint.read_range` reads any element range of a
parameter's value from the rank files that hold it, straight into the caller's tensor, which is
what loading into shards uses (``owned.py``).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_zero.checkpoint.layout import (
    EXTRA,
    FORMAT_NAME,
    METADATA,
    READ_VERSIONS,
    FlatGroupRecord,
    TensorParallelRecord,
    parse_dtype,
    rank_file,
)
from lightning_zero.checkpoint.plain import CheckpointError, from_plain
from lightning_zero.checkpoint.slices import slice_runs, whole_runs
from lightning_zero.checkpoint.tensor_file import TensorFile
from lightning_zero.core.common.flat_param import overlap


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


class ShardedCheckpoint:
    """A sharded checkpoint directory opened for reading (JSON and safetensors only).

    Raises :class:`CheckpointError` when ``path`` is not such a checkpoint, has another format
    version, lacks a file, or holds a file that is not part of the format or not what it claims.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"No checkpoint at {os.fspath(path)!r}.")
        if not self.path.is_dir():
            raise CheckpointError(f"{os.fspath(path)!r} is a file, not a lightning_zero sharded checkpoint directory.")
        directory = self.path.resolve()
        meta_path = directory / METADATA
        if not meta_path.is_file():
            raise CheckpointError(
                f"{os.fspath(path)!r} is not a lightning_zero sharded checkpoint: it has no {METADATA}."
            )
        raw = meta_path.read_bytes()
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            looks = " (it looks like a pickle)" if raw[:1] == b"\x80" else ""
            raise CheckpointError(
                f"{meta_path} is not JSON{looks}; refused. lightning_zero never unpickles checkpoint files."
            ) from err
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{meta_path} is not the metadata of a lightning_zero sharded checkpoint.")
        if meta.get("version") not in READ_VERSIONS:
            raise CheckpointError(
                f"{os.fspath(path)!r} has sharded checkpoint format version {meta.get('version')!r}; this version of "
                f"lightning_zero reads versions {', '.join(map(str, READ_VERSIONS))}. Convert it with the "
                "lightning_zero that wrote it (`lightning-zero convert`)."
            )
        self.meta = meta
        self.groups = [FlatGroupRecord.from_json(g, i) for i, g in enumerate(meta.get("groups", []))]
        self.tensor_parallel = TensorParallelRecord.from_json(meta.get("tensor_parallel"))
        files = list(meta.get("files", []))
        expected = {METADATA, EXTRA, *files}
        present = {p.name for p in directory.iterdir()}
        unknown = sorted(present - expected)
        if unknown:
            raise CheckpointError(
                f"{os.fspath(path)!r} holds files that are not part of a sharded checkpoint: {unknown}; refused "
                "(they are never opened). Remove them if you trust the directory."
            )
        missing = sorted(expected - present)
        if missing:
            raise CheckpointError(
                f"The checkpoint {os.fspath(path)!r} is incomplete: missing {missing} (of a world size "
                f"{meta.get('world_size')} checkpoint)."
            )
        self._files = [TensorFile(directory / name) for name in files]
        extra = TensorFile(directory / EXTRA)
        self._extra = {k: extra.get_tensor(k) for k in extra}
        extra.close()

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def stage(self) -> int | None:
        return self.meta.get("stage")

    # -------------------------------------------------------------------------------- tensors
    def _file_with(self, index: int, key: str, what: str = "tensor") -> TensorFile:
        file = self._files[index]
        if key not in file:
            raise CheckpointError(f"{rank_file(index)} lacks the {what} {key!r}.")
        return file

    def read(self, ref: Mapping[str, Any]) -> Any:
        """The whole value a reference names (a tensor, or plain data)."""
        if "value" in ref:
            return from_plain(ref["value"], {})
        if "file" in ref:
            value = self._file_with(ref["file"], ref["key"]).get_tensor(ref["key"])
        else:  # a flat group's elements, or TP slices (Note [TP slices in checkpoints])
            value = self.read_range(ref, 0, ref["numel"]).reshape(ref["shape"])
        dtype = parse_dtype(ref.get("dtype"))
        return value.to(dtype) if dtype is not None else value

    def ref_dtype(self, ref: Mapping[str, Any]) -> torch.dtype:
        """The dtype the values of ``ref`` are stored in."""
        if "file" in ref:
            return self._file_with(ref["file"], ref["key"]).dtype(ref["key"])
        if "parts" in ref or "of" in ref:
            return self.ref_dtype(ref["parts"][0] if "parts" in ref else ref["of"])
        key = f"g{ref['flat']}.{ref['kind']}"
        rank = self.groups[ref["flat"]].shards[0].file
        return self._file_with(rank, key, "shard").dtype(key)

    def ref_shape(self, ref: Mapping[str, Any]) -> list[int]:
        """The shape of the tensor ``ref`` names (``[]`` for plain data)."""
        if "value" in ref:
            return []
        if "file" in ref:
            return self._file_with(ref["file"], ref["key"]).shape(ref["key"])
        return list(ref["shape"])

    def read_range(self, ref: Mapping[str, Any], start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``ref`` names, as 1-D, read from the
        rank files that hold them into ``out`` when given (cast to its dtype a piece at a time)."""
        if "file" in ref:
            return self._file_with(ref["file"], ref["key"]).read(ref["key"], start, end, out)
        if not 0 <= start <= end <= ref["numel"]:
            raise CheckpointError(f"Elements [{start}, {end}) are outside a tensor of {ref['numel']}.")
        if out is None:
            out = torch.empty(end - start, dtype=self.ref_dtype(ref))
        if "parts" in ref:  # a whole tensor written as TP slices: from each slice's runs
            tp, parts = ref["tp"], ref["parts"]
            for rank, at, whole, n in whole_runs(ref["shape"], tp["dim"], tp["chunks"], len(parts), start, end):
                self.read_range(parts[rank], at, at + n, out[whole - start : whole - start + n])
            return out
        if "of" in ref:  # this TP rank's slice of a whole tensor
            cut, of = ref["slice"], ref["of"]
            shape = self.ref_shape(of)
            for at, whole, n in slice_runs(shape, cut["dim"], cut["chunks"], cut["size"], cut["rank"], start, end):
                self.read_range(of, whole, whole + n, out[at - start : at - start + n])
            return out
        gi, offset = ref["flat"], ref["offset"]
        key = f"g{gi}.{ref['kind']}"
        lo, hi = offset + start, offset + end  # in the flat group's coordinates
        covered = 0
        for shard in self.groups[gi].shards:
            a, b = overlap(lo, hi, shard.start, shard.end)
            if b > a:
                self._file_with(shard.file, key, "shard").read(key, a - shard.start, b - shard.start,
                                                               out[a - lo : b - lo])
                covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"The shards of flat group {gi} do not cover elements [{lo}, {hi}).")
        return out

    def state_dict(self) -> LazyStateDict:
        return LazyStateDict(self, [(k, ref) for k, ref in self.meta["state_dict"]])

    def optimizer_states(self) -> list[dict[str, Any]]:
        """Per optimizer: ``{"state": idx -> lazily read per-parameter state, "param_groups": [...]}``."""
        return [{"param_groups": from_plain(o["param_groups"], {}), "state": LazyOptimizerState(self, o["state"])}
                for o in self.meta.get("optimizers", [])]

    def lightning_state(self) -> dict[str, Any]:
        return from_plain(self.meta.get("lightning", {}), self._extra)

    def rng_state(self, rank: int) -> dict[str, Any] | None:
        if rank >= len(self._files):
            return None
        file = self._files[rank]
        header = file.metadata()
        if "rng" not in header:
            return None
        tensors = {k.removeprefix("rng."): file.get_tensor(k) for k in file if k.startswith("rng.")}
        return from_plain(json.loads(header["rng"]), tensors)

    def to_lightning(self, rank: int = 0) -> dict[str, Any]:
        """The Lightning checkpoint dict, with lazy ``state_dict`` and ``optimizer_states``."""
        out = self.lightning_state()
        out["state_dict"] = self.state_dict()
        out["optimizer_states"] = self.optimizer_states()
        return out


class LazyStateDict(Mapping[str, torch.Tensor]):
    """The whole state dict of a sharded checkpoint, each tensor read on access.

    ``checkpoint`` and ``refs`` (key -> reference) let a loader read slices instead (``owned.py``)."""

    def __init__(self, checkpoint: ShardedCheckpoint, entries: list[tuple[str, Mapping[str, Any]]]) -> None:
        self.checkpoint = checkpoint
        self.refs = dict(entries)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.checkpoint.read(self.refs[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)

    def materialize(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self}


class _LazyParamState(Mapping[str, Any]):
    def __init__(self, checkpoint: ShardedCheckpoint, refs: Mapping[str, Any]) -> None:
        self._checkpoint, self.refs, self._cache = checkpoint, refs, {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._cache:
            self._cache[key] = self._checkpoint.read(self.refs[key])
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)


class LazyOptimizerState(Mapping[int, Mapping[str, Any]]):
    """Parameter index -> its optimizer state, read when asked for (one parameter at a time).
    ``checkpoint`` and ``refs`` (index -> key -> reference) let a loader read slices instead."""

    def __init__(self, checkpoint: ShardedCheckpoint, refs: Mapping[str, Any]) -> None:
        self.checkpoint = checkpoint
        self.refs = {int(k): v for k, v in refs.items()}

    def __getitem__(self, key: int | str) -> Mapping[str, Any]:
        return _LazyParamState(self.checkpoint, self.refs[int(key)])

    def __contains__(self, key: object) -> bool:
        try:
            return int(key) in self.refs  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return False

    def __iter__(self) -> Iterator[int]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)


def materialize_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``torch.optim`` state dict from one of :meth:`ShardedCheckpoint.optimizer_states`."""
    return {"state": {int(i): dict(s) for i, s in state["state"].items()}, "param_groups": state["param_groups"]}


LAST = "last.ckpt"  # what ModelCheckpoint(save_last=True) names the newest checkpoint


def resume_path(path: str | os.PathLike) -> Path:
    """The checkpoint a run resumes from: ``path`` itself, or, for a folder of checkpoints (a run's
    ``checkpoints/``), its ``last.ckpt``.

    Raises:
        CheckpointError: nothing at ``path``, or a folder of checkpoints without a ``last.ckpt`` (its
            checkpoints are named, to choose one).
    """
    given = Path(path).expanduser()
    if not given.exists():
        raise CheckpointError(f"{os.fspath(path)} is not a checkpoint file or directory.")
    if not given.is_dir() or (given / METADATA).is_file():
        return given
    if (given / LAST).exists():
        return given / LAST
    names = sorted(p.name for p in given.glob("*.ckpt"))
    if names:
        raise CheckpointError(f"{os.fspath(path)} is a folder of checkpoints without a {LAST}: name one of them, e.g. "
                              f"{given / names[-1]} (it holds {', '.join(names)}).")
    raise CheckpointError(f"{os.fspath(path)} is a folder without a checkpoint: a sharded checkpoint holds "
                          f"{METADATA}, a run's checkpoints/ folder a {LAST}.")


def open_to_resume(path: str | os.PathLike) -> ShardedCheckpoint | None:
    """What can be checked of a checkpoint without reading its tensors: a sharded directory is opened (its
    metadata parses, every file it names is there, every safetensors header parses and fits its file); a
    single file (stage 0: Lightning's ``torch.save``) is a complete zip archive. Returns the opened sharded
    checkpoint (``None`` for a single file).

    Raises:
        CheckpointError: the checkpoint is incomplete, truncated or not in a format lightning_zero reads.
    """
    path = Path(path)
    if path.is_dir():
        return ShardedCheckpoint(path)
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save's format since torch 1.6
    if zipped:
        try:
            with zipfile.ZipFile(path) as archive:  # reads the central directory at the end: a cut file has none
                archive.infolist()
        except (zipfile.BadZipFile, OSError) as err:
            raise CheckpointError(f"{path} is truncated or damaged ({err}): it is not a whole torch.save file.") \
                from err
    return None


def shape_mismatches(checkpoint: ShardedCheckpoint, expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """``key [checkpoint shape] here, [expected shape]`` for every state-dict key whose shapes differ (a key
    the checkpoint lacks is not compared); when no key is shared at all, one line saying so."""
    shapes = {key: tuple(checkpoint.ref_shape(ref)) for key, ref in checkpoint.meta.get("state_dict", [])}
    shared = [key for key in expected if key in shapes]
    if shapes and expected and not shared:
        return [f"none of its {len(shapes)} tensors is the model's (it holds {next(iter(shapes))!r}, the model "
                f"{next(iter(expected))!r})"]
    return [f"{key} is {list(shapes[key])} in the checkpoint, {list(expected[key])} in the model"
            for key in shared if shapes[key] != tuple(expected[key])]
