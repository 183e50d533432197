"""Loading a full (unsharded) state dict into a partitioned model without materialising it.

Each rank reads the tensors it needs straight from the file, one stage-3 unit at a time: a
``.safetensors`` file is opened lazily (``safe_open``), a ``.pt`` file is memory-mapped
(``torch.load(mmap=True)``), so only the unit being filled and this rank's shards are ever
resident. No collective is involved: every rank reads the same values.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_zero.core.engine import ZeroEngine


class _SafetensorsFile(Mapping[str, torch.Tensor]):
    """A read-only mapping over a ``.safetensors`` file that loads one tensor per access."""

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


def open_state_dict(source: str | Path | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A lazily loading mapping for a path (``.safetensors`` or ``torch.save`` file) or a dict."""
    if isinstance(source, Mapping):
        return source
    path = str(source)
    if path.endswith(".safetensors"):
        return _SafetensorsFile(path)
    loaded: Any = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    return loaded


@torch.no_grad()
def load_full_state_dict(
    engine: ZeroEngine, source: str | Path | Mapping[str, torch.Tensor], prefix: str = "", strict: bool = True
) -> None:
    """Copy whole tensors into ``engine``'s partitioned parameters (and the module's buffers).

    Args:
        engine: the attached engine of the model to fill.
        source: a path or a mapping of key -> tensor.
        prefix: keys in ``source`` start with this prefix followed by the module's own names
            (e.g. ``"model."``); keys without it are ignored.
        strict: raise when a parameter or buffer of the module has no key, or a key under
            ``prefix`` matches nothing.
    """
    state = open_state_dict(source)
    keys = {k[len(prefix):]: k for k in state if k.startswith(prefix)}
    names_of: dict[torch.Tensor, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(p, []).append(name)
    buffers = dict(engine.module.named_buffers())
    key_of = {p: next((keys[n] for n in names if n in keys), None) for p, names in names_of.items()}
    missing = [names[0] for p, names in names_of.items() if key_of[p] is None]
    missing += [n for n in buffers if n not in keys]
    known = {n for names in names_of.values() for n in names} | set(buffers)
    unexpected = sorted(set(keys) - known)
    if strict and (missing or unexpected):
        raise ValueError(
            f"The state dict does not match the module: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. Pass `prefix=` when the keys are "
            "nested (e.g. 'model.'), or `strict=False` to load what matches."
        )

    def fill(p: torch.Tensor, dest: torch.Tensor) -> None:
        key = key_of.get(p)
        if key is not None:
            value = state[key]
            if tuple(value.shape) != tuple(dest.shape):
                raise ValueError(f"{key!r} has shape {tuple(value.shape)} in the state dict, {tuple(dest.shape)} here.")
            dest.copy_(value)

    if engine.runtime is not None:
        for unit in engine.units:
            released = not unit.persistent and unit.state.value == "sharded"
            if released:
                unit.allocate()
            for g in unit.groups:
                for slot, view in zip(g.slots, g.views(g.flat)):
                    fill(slot.param, view)
                start, end = g.shard_range()
                g.shard.copy_(g.flat[start:end])
            if released:
                unit.free_storage()
    else:
        for p in names_of:
            fill(p, p.data)
    if engine.sharded is not None:
        engine.sharded.write_masters_from_params(engine.groups)
    for name, b in buffers.items():
        if name in keys:
            b.copy_(state[keys[name]])
