"""Saving a sharded checkpoint atomically: every rank writes into a temporary directory, rank 0
publishes it under the checkpoint's name once all succeeded (Note [sharded checkpoint format])."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_zero.checkpoint.collect import StageLayout, Tensors, collect
from lightning_zero.checkpoint.layout import EXTRA, FORMAT_NAME, METADATA, rank_file
from lightning_zero.checkpoint.plain import CheckpointError
from lightning_zero.checkpoint.tensor_file import save_tensors

if TYPE_CHECKING:
    from lightning_zero.core.zero.engine import ZeroEngine

# Fault injection for tests: called with (rank, temporary directory) after this rank wrote its
# files and before the ranks agree; whatever it raises is that rank's write error.
after_write_hook: Callable[[int, Path], None] | None = None


def write_rank(directory: Path, rank: int, tensors: Tensors, meta: dict[str, Any] | None,
               extra: dict[str, Any]) -> None:
    """Write this rank's file (and rank 0's metadata and extra tensors) into ``directory``."""
    header = extra.pop("__header__")
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(directory / rank_file(rank), tensors, header)
    if meta is not None:
        save_tensors(directory / EXTRA, extra, {"format": FORMAT_NAME})
        path = directory / METADATA
        with open(path, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())


def new_temporary(path: str | os.PathLike) -> str:
    return f"{os.fspath(path)}.tmp-{uuid.uuid4().hex[:12]}"


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rank 0, after every rank wrote ``tmp``: make it the checkpoint ``path`` atomically.

    Refuses (before touching anything) when ``path`` is a directory or file this format did not
    write (not a symlink to a version): it is the user's, and is never deleted."""
    final = Path(path)
    parent = final.parent
    try:
        refuse_foreign(final)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(Path(tmp))  # the files' directory entries are durable before the rename
    pattern = re.compile(re.escape(final.name) + r"\.v(\d+)$")
    versions = [int(m.group(1)) for p in parent.iterdir() if (m := pattern.match(p.name))]
    target = parent / f"{final.name}.v{max(versions, default=0) + 1}"
    os.replace(tmp, target)
    previous = os.readlink(final) if final.is_symlink() else None
    link = parent / f".{final.name}.link-{uuid.uuid4().hex[:12]}"
    os.symlink(target.name, link)
    os.replace(link, final)  # the atomic switch
    _fsync_dir(parent)
    if previous is not None and (parent / previous).resolve() != target.resolve():
        shutil.rmtree(parent / previous, ignore_errors=True)
    return target


def refuse_foreign(final: Path) -> None:
    """Raise when ``final`` exists but is not this format's symlink: it is the user's, never replaced."""
    if final.exists() and not final.is_symlink():
        raise CheckpointError(
            f"{os.fspath(final)!r} exists and is not a sharded checkpoint written by lightning_zero (those are "
            "symlinks to NAME.v<K>); refused to replace it. Move it away or save under another name."
        )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def save_sharded(
    path: str | os.PathLike,
    checkpoint: Mapping[str, Any],
    engine: ZeroEngine | None,
    rank: int,
    world_size: int,
    broadcast: Callable[[Any], Any],
    failed_ranks: Callable[[bool], list[int]],
    layout: StageLayout | None = None,
    merge: Callable[[dict[str, Any] | None], dict[str, Any] | None] | None = None,
) -> None:
    """Every rank calls this together (Note [sharded checkpoint format]).

    Args:
        broadcast: rank 0's temporary directory name (a str) on every rank (the strategy's
            ``DataParallelComm.broadcast_text``: its own group and timeout, no pickling).
        failed_ranks: all-gather of one flag per rank; the ranks where it is true.
        layout: a pipeline stage's place in the checkpoint (Note [pipelined shards]).
        merge: with ``layout``: a collective every rank joins with its stage's metadata (``None``
            where collecting failed); returns on rank 0 the whole checkpoint's metadata (raising
            when a stage's part is missing), elsewhere ``None``.
    """
    tmp = broadcast(new_temporary(path) if rank == 0 else None)
    error: BaseException | None = None
    tensors: Tensors = {}
    meta: dict[str, Any] | None = None
    extra: dict[str, Any] = {}
    try:
        if rank == 0:
            refuse_foreign(Path(path))  # before anything is written; agreed on below, so every rank raises
        tensors, meta, extra = collect(checkpoint, engine, rank, world_size, layout)
    except Exception as exc:  # agreed on below, so that no rank waits for a rank that failed
        error = exc
    if merge is not None:  # joined by every rank, failed or not: no rank waits for one that raised
        try:
            meta = merge(meta if error is None else None)
        except Exception as exc:
            error = error or exc
    try:
        if error is None:
            write_rank(Path(tmp), rank, tensors, meta, extra)
            del tensors
            if after_write_hook is not None:
                after_write_hook(rank, Path(tmp))
    except Exception as exc:
        error = exc
    failed = failed_ranks(error is not None)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(
            f"Saving the checkpoint {os.fspath(path)!r} failed on rank(s) {failed} (their traceback says why); the "
            "previous checkpoint under that name, if any, is unchanged."
        )
    if rank == 0:
        publish(tmp, path)


def remove(path: str | os.PathLike) -> None:
    """Remove a checkpoint written by :func:`save_sharded` (the link and the version it names)."""
    final = Path(path)
    if final.is_symlink():
        target = final.parent / os.readlink(final)
        final.unlink()
        shutil.rmtree(target, ignore_errors=True)
    elif final.is_dir():
        shutil.rmtree(final)
    elif final.exists():
        final.unlink()
