"""Safetensors files written and read a bounded piece at a time: no whole copy of what is saved; and
:func:`own_bytes`, which gives views their own storage before ``torch.save`` (Note [own bytes]).

Note [streamed safetensors]
    The file layout is safetensors' own (an 8-byte little-endian header length, a JSON header
    naming each tensor's dtype, shape and byte range, then the bytes), so ``safetensors.safe_open``
    and any other reader open these files. The library's ``save_file`` first turns every tensor
    into a Python ``bytes`` object (a whole copy of what is saved) and ``safe_open`` maps the whole
    file, which under a data limit fails for a file bigger than what is left. Here:

    * writing computes the header from dtypes and shapes, then writes each tensor's bytes straight
      from its own storage (a CPU tensor is written from its memory, a CUDA tensor through one
      staging buffer of at most ``STAGING_BYTES``); an entry may be a list of 1-D tensors written
      one after another (optimizer state kept in pieces), or a function called when its turn comes
      (conversion: one tensor resident at a time).
    * reading parses the header and reads element ranges with ``os.preadv`` into the caller's
      tensor (or a new one of that range), so a rank reads only the slices it owns.

    A header that is not safetensors is a :class:`CheckpointError` that says so; an ``OSError`` or
    an allocation failure while reading is reported as what it is, naming the file and the bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from lightning_zero.checkpoint.plain import CheckpointError

STAGING_BYTES = 64 * 2**20  # the most one CUDA -> host copy (and one read of a dtype cast) holds
_MAX_HEADER = 100 * 2**20

_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

Source = Union[torch.Tensor, list[torch.Tensor], Callable[[], torch.Tensor]]  # noqa: UP007 - a runtime alias


@dataclass(frozen=True)
class Entry:
    """One tensor of a file to write: its name, dtype, shape and where its values come from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Source

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


def entry(name: str, value: torch.Tensor | list[torch.Tensor]) -> Entry:
    """An entry for a tensor, or for 1-D pieces written end to end as one 1-D tensor."""
    if isinstance(value, torch.Tensor):
        return Entry(name, value.dtype, tuple(value.shape), value)
    if not value or len({p.dtype for p in value}) != 1:
        raise ValueError(f"{name!r}: pieces must be a non-empty list of one dtype")
    return Entry(name, value[0].dtype, (sum(p.numel() for p in value),), list(value))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 view (a copy only when it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _write_tensor(fd: int, t: torch.Tensor, staging: list[torch.Tensor]) -> int:
    raw = _bytes_of(t)
    if raw.device.type == "cpu":
        view = memoryview(raw.numpy())
        for lo in range(0, len(view), STAGING_BYTES):
            _write_all(fd, view[lo : lo + STAGING_BYTES])
        return raw.numel()
    if not staging:  # one buffer for the whole file, pinned when the device allows
        pin = torch.cuda.is_available()
        staging.append(torch.empty(min(STAGING_BYTES, raw.numel()), dtype=torch.uint8, pin_memory=pin))
    buf = staging[0]
    for lo in range(0, raw.numel(), buf.numel()):
        n = min(buf.numel(), raw.numel() - lo)
        buf[:n].copy_(raw[lo : lo + n])
        _write_all(fd, memoryview(buf[:n].numpy()))
    return raw.numel()


def write_file(path: str | os.PathLike, entries: Iterable[Entry], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``entries`` to ``path`` (Note [streamed safetensors]) and fsync it."""
    entries = list(entries)
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in _CODES:
            raise CheckpointError(f"{e.name!r} has dtype {e.dtype}, which safetensors cannot store.")
        header[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    staging: list[torch.Tensor] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(text)) + text))
        for e in entries:
            source = e.source() if callable(e.source) else e.source
            pieces = source if isinstance(source, list) else [source]
            written = 0
            for piece in pieces:
                if piece.dtype != e.dtype:
                    raise CheckpointError(f"{e.name!r}: a piece of dtype {piece.dtype} in a {e.dtype} entry.")
                written += _write_tensor(fd, piece, staging)
            if written != e.nbytes:
                raise CheckpointError(f"{e.name!r} produced {written} bytes, its header says {e.nbytes}.")
            del source, pieces
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor | list[torch.Tensor]],
                 metadata: Mapping[str, str] | None = None) -> None:
    """Write a mapping of tensors (or 1-D piece lists) from their own storage."""
    write_file(path, [entry(k, v) for k, v in tensors.items()], metadata)


def _io_error(path: Path, what: str, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Reading {what} from {path} failed: {type(err).__name__}: {err}. This is an I/O or memory error, not a "
        "problem of the file: check free memory (each rank reads only its own slices, a bounded piece at a time) "
        "and the storage."
    )


class TensorFile:
    """A safetensors file opened for reading slices (Note [streamed safetensors]).

    Raises :class:`CheckpointError` when the file is not safetensors (it is never unpickled).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise _io_error(self.path, "the header", err) from err
        head = b""
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} in a file of {size} bytes: truncated, or not safetensors")
            header = json.loads(os.pread(self._fd, length, 8).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            self._meta: dict[str, str] = header.pop("__metadata__", None) or {}
            self._entries: dict[str, tuple[torch.dtype, list[int], int]] = {}
            data_size = size - 8 - length
            ends = [int(spec["data_offsets"][1]) for spec in header.values()]
            if ends and max(ends) > data_size:
                raise ValueError(f"truncated: its header describes {8 + length + max(ends)} bytes, the file has {size}")
            for name, spec in header.items():
                dtype = _DTYPES[spec["dtype"]]
                shape = [int(d) for d in spec["shape"]]
                begin, end = (int(x) for x in spec["data_offsets"])
                numel = 1
                for d in shape:
                    numel *= d
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                if end - begin != nbytes or not 0 <= begin <= end <= data_size:
                    raise ValueError(f"{name!r}: bytes [{begin}, {end}) do not fit its shape or the file")
                self._entries[name] = (dtype, shape, 8 + length + begin)
        except OSError as err:
            self.close()
            raise _io_error(self.path, "the header", err) from err
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, struct.error) as err:
            self.close()
            looks = " (it looks like a pickle)" if head[:1] == b"\x80" else ""
            raise CheckpointError(
                f"{self.path} is not a valid safetensors file{looks} ({err}); refused. lightning_zero never "
                "unpickles checkpoint files."
            ) from err

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def metadata(self) -> dict[str, str]:
        return dict(self._meta)

    def dtype(self, key: str) -> torch.dtype:
        return self._entries[key][0]

    def shape(self, key: str) -> list[int]:
        return list(self._entries[key][1])

    def read(self, key: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of ``key`` (flattened) as a 1-D tensor, read into ``out``
        (contiguous, that many elements) when given, converting the dtype a bounded piece at a time."""
        dtype, shape, base = self._entries[key]
        numel = 1
        for d in shape:
            numel *= d
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of {key!r} are outside its {numel}.")
        n = end - start
        size = torch.empty((), dtype=dtype).element_size()
        try:
            if out is None:
                out = torch.empty(n, dtype=dtype)
            if out.numel() != n or not out.is_contiguous():
                raise ValueError(f"`out` must be contiguous with {n} elements")
            if out.dtype == dtype and out.device.type == "cpu":
                self._pread(out.reshape(-1).view(torch.uint8), base + start * size)
                return out
            step = max(1, STAGING_BYTES // size)
            flat = out.reshape(-1)
            for lo in range(0, n, step):
                m = min(step, n - lo)
                tmp = torch.empty(m, dtype=dtype)
                self._pread(tmp.view(torch.uint8), base + (start + lo) * size)
                flat[lo : lo + m].copy_(tmp)
            return out
        except (OSError, MemoryError, RuntimeError) as err:
            if isinstance(err, RuntimeError) and "alloc" not in str(err).lower():
                raise
            raise _io_error(self.path, f"{n * size} bytes of {key!r}", err) from err

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.read(key).reshape(self.shape(key))

    def _pread(self, dest: torch.Tensor, offset: int) -> None:
        view = memoryview(dest.detach().numpy())
        done = 0
        while done < len(view):
            chunk = view[done : done + STAGING_BYTES]
            got = os.preadv(self._fd, [chunk], offset + done)
            if got <= 0:
                raise OSError(f"unexpected end of file at byte {offset + done}")
            done += got

# Note [own bytes]: ``torch.save`` writes a tensor's whole storage: a parameter that views a slice of a flat
# ZeRO buffer would drag the buffer along (a 26 MB model saved as 433 MB). :func:`own_bytes` copies such views
# into tensors of their own size, keeping tensors that shared one storage region shared (tied weights).


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
