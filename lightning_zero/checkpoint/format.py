"""The sharded checkpoint directory: what each rank writes, how it is published, how it is read.

Note [sharded checkpoint format]
    A checkpoint named ``NAME`` is a symlink ``NAME -> NAME.v<K>`` to a directory holding

        metadata.json             format name and version, stage, world size, the layout of
                                  every flat group, where each state-dict key and optimizer
                                  state lives, and the plain Lightning state (loops, callbacks,
                                  LR schedulers, loss scaler, hyper-parameters; Note [plain
                                  checkpoint data])
        extra.safetensors         the tensors inside that Lightning state
        rank-RRRRR.safetensors    one per rank: that rank's shards ``g<i>.param``,
                                  ``g<i>.master`` (separate master only), ``g<i>.opt.<key>``
                                  (per-element optimizer state), ``g<i>.scalar.<key>`` (e.g.
                                  ``step``); rank 0 also holds whole tensors (``sd.<key>``:
                                  buffers and parameters outside flat groups; with stage 0 or
                                  without an engine: everything); the header's metadata holds
                                  the rank's RNG states

    Flat group ``i``'s shard of rank ``r`` covers elements ``[r*S, (r+1)*S)`` of its padded
    buffer (Note [flat shard layout]); ``metadata.json`` lists every parameter's names, offset
    and shape, so a parameter's whole value (or any slice of it) is read back from the shards
    that overlap it, with ``safe_open(...).get_slice``, at any world size or stage. The
    canonical optimizer layout is torch's per-parameter ``state_dict`` (the one
    ``full_optimizer_state`` produces), assembled lazily the same way.

    Saving is atomic: every rank writes into ``NAME.tmp-<uuid>``; the ranks agree that all of
    them succeeded; rank 0 renames the directory to ``NAME.v<K>`` and replaces the symlink
    ``NAME`` with ``os.replace`` (atomic), then removes the version it replaced. A crash or an
    error before that leaves ``NAME`` pointing at the previous complete version.

    Reading never unpickles: JSON and safetensors only; any other file in the directory, a
    metadata file that is not JSON, a shard that is not safetensors are refused.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero.checkpoint.plain import CheckpointError, from_plain, to_plain

if TYPE_CHECKING:
    from lightning_zero.core.engine import ZeroEngine

FORMAT_NAME = "lightning_zero.sharded_checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
EXTRA = "extra.safetensors"
_MODEL_KEYS = ("state_dict", "optimizer_states")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"Unknown dtype {name!r} in the checkpoint's metadata.")
    return dtype


# ---------------------------------------------------------------------------------------------- RNG
def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# ---------------------------------------------------------------------------------------------- writing
def collect(
    checkpoint: Mapping[str, Any], engine: ZeroEngine | None, rank: int, world_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, torch.Tensor]]:
    """This rank's tensors, and on rank 0 the metadata and the Lightning state's tensors.

    With an engine at stage >= 1 the model and optimizer come from the shards; otherwise (stage
    0, or no engine) rank 0 writes ``checkpoint['state_dict']`` / ``['optimizer_states']`` whole.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": world_size,
                            "files": [rank_file(r) for r in range(world_size)], "groups": []}
    with_optimizer = "optimizer_states" in checkpoint
    if engine is not None and engine.config.stage >= 1:
        meta["stage"] = engine.config.stage
        _collect_shards(engine, rank, world_size, with_optimizer, tensors, meta)
    else:
        meta["stage"] = engine.config.stage if engine is not None else None
        if rank == 0:
            _collect_whole(checkpoint, with_optimizer, tensors, meta)
    rng_tensors: dict[str, torch.Tensor] = {}
    rng_plain = to_plain(capture_rng(), rng_tensors, "RNG state")
    tensors.update({f"rng.{k}": v for k, v in rng_tensors.items()})
    header = {"rng": json.dumps(rng_plain), "format": FORMAT_NAME, "version": str(FORMAT_VERSION)}
    if rank != 0:
        return tensors, None, {"__header__": header}  # type: ignore[dict-item]
    extra: dict[str, torch.Tensor] = {}
    rest = {k: v for k, v in checkpoint.items() if k not in _MODEL_KEYS}
    meta["lightning"] = to_plain(rest, extra, "checkpoint")
    return tensors, meta, {"__header__": header, **extra}  # type: ignore[dict-item]


def _flat_ref(gi: int, kind: str, slot: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    return {"flat": gi, "kind": kind, "offset": slot.offset, "numel": slot.numel, "shape": list(slot.shape),
            "dtype": _dtype_name(dtype) if dtype is not None else None}


def _collect_shards(
    engine: ZeroEngine, rank: int, world_size: int, with_optimizer: bool,
    tensors: dict[str, torch.Tensor], meta: dict[str, Any],
) -> None:
    from lightning_zero.core.optimizer import _index_of_original

    sharded, module = engine.sharded, engine.module
    separate = engine.separate_master
    master_dtype = engine.dtypes.master_dtype
    trainable = {id(g): fi for fi, g in enumerate(engine.groups)}
    index = _index_of_original(sharded) if sharded is not None else {}
    where: dict[torch.Tensor, dict[str, Any]] = {}  # parameter -> its state-dict ref
    opt_state: dict[str, dict[str, Any]] = {}
    for gi, g in enumerate(engine.all_groups):
        fi = trainable.get(id(g))
        has_master = separate and fi is not None and sharded is not None
        tensors[f"g{gi}.param"] = g.own_shard()
        if has_master:
            tensors[f"g{gi}.master"] = sharded.masters[fi]
        opt_keys: list[str] = []
        scalars: dict[str, Any] = {}
        if with_optimizer and fi is not None and sharded is not None:
            for key, value in sorted(sharded.shard_state(fi).items()):
                if isinstance(value, torch.Tensor) and value.shape == sharded.masters[fi].shape:
                    tensors[f"g{gi}.opt.{key}"] = value
                    opt_keys.append(key)
                elif isinstance(value, torch.Tensor):
                    tensors[f"g{gi}.scalar.{key}"] = value
                    scalars[key] = {"file": 0, "key": f"g{gi}.scalar.{key}"}
                else:
                    scalars[key] = {"value": to_plain(value, {}, f"optimizer state {key!r}")}
        meta["groups"].append({
            "padded_numel": g.padded_numel,
            "shards": [[r, *g.shard_range(r)] for r in range(world_size)],
            "dtype": _dtype_name(g.dtype),
            "master": has_master,
            "optimizer_group": g.optimizer_group,
            "params": [{"name": engine.names.get(s.param), "offset": s.offset, "shape": list(s.shape)}
                       for s in g.slots],
        })
        for s in g.slots:
            cast = master_dtype if separate and not has_master and g.dtype.is_floating_point else None
            where[s.param] = _flat_ref(gi, "master" if has_master else "param", s, cast)
            if opt_keys or scalars:
                opt_state[str(index[s.param])] = {**{k: _flat_ref(gi, f"opt.{k}", s) for k in opt_keys}, **scalars}
    params = dict(module.named_parameters(remove_duplicate=False))
    entries = []
    for key, value in module.state_dict().items():
        p = params.get(key)
        if p is not None and p in where:
            entries.append([key, where[p]])
            continue
        if rank == 0:
            if separate and value.is_floating_point():
                value = value.to(master_dtype)
            tensors[f"sd.{key}"] = value
        entries.append([key, {"file": 0, "key": f"sd.{key}"}])
    meta["state_dict"] = entries
    meta["optimizers"] = []
    if with_optimizer and sharded is not None:
        groups = [{**{k: v for k, v in pg.items() if k != "params"}, "params": [index[p] for p in params_]}
                  for pg, params_ in zip(sharded.optimizer.param_groups, sharded.original_params)]
        meta["optimizers"].append({"param_groups": to_plain(groups, {}, "optimizer param_groups"),
                                   "state": opt_state})


def _collect_whole(
    checkpoint: Mapping[str, Any], with_optimizer: bool, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    entries = []
    for key, value in checkpoint.get("state_dict", {}).items():
        tensors[f"sd.{key}"] = value
        entries.append([key, {"file": 0, "key": f"sd.{key}"}])
    meta["state_dict"] = entries
    meta["optimizers"] = []
    for j, state in enumerate(checkpoint.get("optimizer_states", []) if with_optimizer else []):
        refs: dict[str, dict[str, Any]] = {}
        for idx, per_param in state.get("state", {}).items():
            refs[str(idx)] = {}
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"o{j}.{idx}.{key}"] = value
                    refs[str(idx)][key] = {"file": 0, "key": f"o{j}.{idx}.{key}"}
                else:
                    refs[str(idx)][key] = {"value": to_plain(value, {}, f"optimizer state {key!r}")}
        meta["optimizers"].append({"param_groups": to_plain(state.get("param_groups", []), {}, "param_groups"),
                                   "state": refs})


def _save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, header: dict[str, str]) -> None:
    from safetensors.torch import save_file

    # own, contiguous CPU copies: shards are views into flat buffers (safetensors refuses shared storage)
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, str(path),
              metadata=header)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank(directory: Path, rank: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None,
               extra: dict[str, Any]) -> None:
    """Write this rank's file (and rank 0's metadata and extra tensors) into ``directory``."""
    header = extra.pop("__header__")
    directory.mkdir(parents=True, exist_ok=True)
    _save_safetensors(tensors, directory / rank_file(rank), header)
    if meta is not None:
        _save_safetensors(extra, directory / EXTRA, {"format": FORMAT_NAME})
        path = directory / METADATA
        with open(path, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())


def new_temporary(path: str | os.PathLike) -> str:
    return f"{os.fspath(path)}.tmp-{uuid.uuid4().hex[:12]}"


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rank 0, after every rank wrote ``tmp``: make it the checkpoint ``path`` atomically."""
    final = Path(path)
    refuse_plain_directory(final)
    _fsync_dir(Path(tmp))  # the rank files' directory entries are durable before the rename publishes them
    parent = final.parent
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


def refuse_plain_directory(final: Path) -> None:
    """A directory (not this format's symlink) at the checkpoint's name is the user's: never replace it."""
    if final.is_dir() and not final.is_symlink():
        raise CheckpointError(f"{os.fspath(final)!r} is a directory that this checkpoint format did not write (it "
                              "publishes NAME as a symlink to NAME.v<K>); it is left as it is. Move it away, or save "
                              "the checkpoint under another name.")


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
) -> None:
    """Every rank calls this together (Note [sharded checkpoint format]).

    Args:
        broadcast: rank 0's temporary directory name (a str) on every rank (the strategy's
            ``DataParallelComm.broadcast_text``: its own group and timeout, no pickling).
        failed_ranks: all-gather of one flag per rank; the ranks where it is true.
    """
    tmp = broadcast(new_temporary(path) if rank == 0 else None)
    error: BaseException | None = None
    try:
        if rank == 0:
            refuse_plain_directory(Path(path))  # agreed on below: every rank raises
        tensors, meta, extra = collect(checkpoint, engine, rank, world_size)
        write_rank(Path(tmp), rank, tensors, meta, extra)
        _test_hook(rank, Path(tmp))
    except Exception as exc:  # agreed on below, so that no rank waits for a rank that failed
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


def _test_hook(rank: int, directory: Path) -> None:
    """Fault injection for the tests: ``LIGHTNING_ZERO_TEST_SAVE_FAULT=<rank>:<raise|kill>``."""
    spec = os.environ.get("LIGHTNING_ZERO_TEST_SAVE_FAULT")
    if not spec:
        return
    who, _, what = spec.partition(":")
    if int(who) != rank:
        return
    if what == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(f"injected writer failure on rank {rank} (LIGHTNING_ZERO_TEST_SAVE_FAULT)")


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


# ---------------------------------------------------------------------------------------------- reading
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
        if meta.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{os.fspath(path)!r} has sharded checkpoint format version {meta.get('version')!r}; this version of "
                f"lightning_zero reads version {FORMAT_VERSION}. Convert it with the lightning_zero that wrote it "
                "(`lightning-zero convert`)."
            )
        self.meta = meta
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
        self._files = [self._open(directory / name) for name in files]
        self._keys = [set(f.keys()) for f in self._files]
        extra = self._open(directory / EXTRA)
        self._extra = {k: extra.get_tensor(k) for k in extra.keys()}  # noqa: SIM118 - safe_open has no __iter__

    @staticmethod
    def _open(path: Path) -> Any:
        from safetensors import safe_open

        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as err:  # SafetensorError and friends
            raise CheckpointError(
                f"{path} is not a valid safetensors file ({err}); refused. lightning_zero never unpickles checkpoint "
                "files."
            ) from err

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def stage(self) -> int | None:
        return self.meta.get("stage")

    # -------------------------------------------------------------------------------- tensors
    def read(self, ref: Mapping[str, Any]) -> Any:
        if "value" in ref:
            return from_plain(ref["value"], {})
        if "file" in ref:
            file = self._files[ref["file"]]
            if ref["key"] not in self._keys[ref["file"]]:
                raise CheckpointError(f"{rank_file(ref['file'])} lacks the tensor {ref['key']!r}.")
            value = file.get_tensor(ref["key"])
        else:
            value = self._read_flat(ref)
        dtype = _dtype(ref.get("dtype"))
        return value.to(dtype) if dtype is not None else value

    def _read_flat(self, ref: Mapping[str, Any]) -> torch.Tensor:
        gi, offset, numel = ref["flat"], ref["offset"], ref["numel"]
        key = f"g{gi}.{ref['kind']}"
        pieces = []
        for rank, start, end in self.meta["groups"][gi]["shards"]:
            lo, hi = max(offset, start), min(offset + numel, end)
            if hi > lo:
                file = self._files[rank]
                if key not in self._keys[rank]:
                    raise CheckpointError(f"{rank_file(rank)} lacks the shard {key!r}.")
                pieces.append(file.get_slice(key)[lo - start : hi - start])
        flat = torch.cat(pieces) if len(pieces) != 1 else pieces[0]
        if flat.numel() != numel:
            raise CheckpointError(f"The shards of flat group {gi} do not cover elements [{offset}, {offset + numel}).")
        return flat.reshape(ref["shape"])

    def state_dict(self) -> LazyStateDict:
        return LazyStateDict(self, [(k, ref) for k, ref in self.meta["state_dict"]])

    def optimizer_states(self) -> list[dict[str, Any]]:
        """Per optimizer: ``{"state": idx -> lazily read per-parameter state, "param_groups": [...]}``."""
        return [{"param_groups": from_plain(o["param_groups"], {}), "state": _LazyOptimizerState(self, o["state"])}
                for o in self.meta.get("optimizers", [])]

    def lightning_state(self) -> dict[str, Any]:
        return from_plain(self.meta.get("lightning", {}), self._extra)

    def rng_state(self, rank: int) -> dict[str, Any] | None:
        if rank >= len(self._files):
            return None
        header = self._files[rank].metadata() or {}
        if "rng" not in header:
            return None
        tensors = {k.removeprefix("rng."): self._files[rank].get_tensor(k)
                   for k in self._files[rank].keys() if k.startswith("rng.")}  # noqa: SIM118
        return from_plain(json.loads(header["rng"]), tensors)

    def to_lightning(self, rank: int = 0) -> dict[str, Any]:
        """The Lightning checkpoint dict, with lazy ``state_dict`` and ``optimizer_states``."""
        out = self.lightning_state()
        out["state_dict"] = self.state_dict()
        out["optimizer_states"] = self.optimizer_states()
        return out


class LazyStateDict(Mapping[str, torch.Tensor]):
    """The whole state dict of a sharded checkpoint, each tensor read on access."""

    def __init__(self, checkpoint: ShardedCheckpoint, entries: list[tuple[str, Mapping[str, Any]]]) -> None:
        self._checkpoint = checkpoint
        self._refs = dict(entries)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._checkpoint.read(self._refs[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def materialize(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self}


class _LazyParamState(Mapping[str, Any]):
    def __init__(self, checkpoint: ShardedCheckpoint, refs: Mapping[str, Any]) -> None:
        self._checkpoint, self._refs, self._cache = checkpoint, refs, {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._cache:
            self._cache[key] = self._checkpoint.read(self._refs[key])
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


class _LazyOptimizerState(Mapping[int, Mapping[str, Any]]):
    """Parameter index -> its optimizer state, read when asked for (one parameter at a time)."""

    def __init__(self, checkpoint: ShardedCheckpoint, refs: Mapping[str, Any]) -> None:
        self._checkpoint = checkpoint
        self._refs = {int(k): v for k, v in refs.items()}

    def __getitem__(self, key: int | str) -> Mapping[str, Any]:
        return _LazyParamState(self._checkpoint, self._refs[int(key)])

    def __contains__(self, key: object) -> bool:
        try:
            return int(key) in self._refs  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return False

    def __iter__(self) -> Iterator[int]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


def materialize_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``torch.optim`` state dict from one of :meth:`ShardedCheckpoint.optimizer_states`."""
    return {"state": {int(i): dict(s) for i, s in state["state"].items()}, "param_groups": state["param_groups"]}
