"""The text corpus of the GPT experiments, without Lightning: which files, their bytes, the train / validation
split and how many samples it makes; and the same sizes counted from the files' sizes alone (nothing read),
which the config checks use before launch."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def stdlib_path() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(path: str | os.PathLike[str] | None = None, pattern: str | None = None) -> list[Path]:
    """Files making up a corpus, in sorted (deterministic) relative-path order.

    ``path=None`` means the standard library (``*.py``, skipping ``site-packages`` and ``test``/``tests``
    directories). A file path is returned as is; a directory is searched recursively for ``pattern``
    (default ``*.py`` for the standard library, ``*`` otherwise), skipping the same directories.
    """
    root = stdlib_path() if path is None else Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"corpus path {root} does not exist")
    pattern = pattern or ("*.py" if path is None else "*")
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        found.extend(Path(dirpath, f) for f in filenames if Path(f).match(pattern))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(
    path: str | os.PathLike[str] | None = None, max_bytes: int | None = 8_000_000, pattern: str | None = None
) -> torch.Tensor:
    """Concatenate the corpus files (newline separated) into a 1-D ``uint8`` tensor of at most ``max_bytes``.

    Unreadable files are skipped; reading stops as soon as the cap is reached, so start-up is fast.
    """
    chunks: list[bytes] = []
    total = 0
    for file in list_corpus_files(path, pattern):
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            raw = file.read_bytes()
        except OSError:
            continue
        if raw:
            chunks.append(raw + b"\n")
            total += len(raw) + 1
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 2:
        raise ValueError(f"corpus at {path or stdlib_path()} is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def corpus_bytes(path: str | os.PathLike[str] | None = None, max_bytes: int | None = 8_000_000,
                 pattern: str | None = None) -> int:
    """The length of :func:`load_corpus` ``(path, max_bytes, pattern)``, from the files' sizes (nothing is read)."""
    total = 0
    for file in list_corpus_files(path, pattern):
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            size = file.stat().st_size
        except OSError:
            continue
        if size:
            total += size + 1  # load_corpus's newline after each file
    return total if max_bytes is None else min(total, max_bytes)


def split_sizes(num_bytes: int, val_fraction: float = 0.05) -> tuple[int, int]:
    """The bytes of the (train, validation) parts :func:`split_corpus` makes of ``num_bytes``."""
    n_val = int(num_bytes * val_fraction)
    return num_bytes - n_val, n_val


def split_corpus(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split into (train, validation); the validation part is the last ``val_fraction`` of the bytes."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError("val_fraction must be in [0, 1)")
    n_train = split_sizes(len(data), val_fraction)[0]
    return data[:n_train], data[n_train:]


def chunk_count(num_bytes: int, seq_len: int) -> int:
    """Samples of ``seq_len`` tokens (``seq_len + 1`` bytes, at stride ``seq_len``) in ``num_bytes`` bytes."""
    return max(0, (num_bytes - 1) // seq_len)
