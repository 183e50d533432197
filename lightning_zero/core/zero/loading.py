"""Loading a full (unsharded) state dict into a partitioned model without materialising it.

Each rank reads the tensors it needs from a mapping, one stage-3 unit at a time; with a lazily
loading mapping (``lightning_zero.lightning.state_files.open_state_dict``: a ``.safetensors`` file opened
with ``safe_open``, a ``.pt`` file memory-mapped) only the unit being filled and this rank's
shards are ever resident. No collective is involved: every rank reads the same values. Separate
master copies (mixed precision) take the loaded values themselves, not their 16-bit rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from lightning_zero.core.common.flat_param import overlap

if TYPE_CHECKING:
    from lightning_zero.core.zero.engine import ZeroEngine


@torch.no_grad()
def load_full_state_dict(
    engine: ZeroEngine, state: Mapping[str, torch.Tensor], prefix: str = "", strict: bool = True
) -> None:
    """Copy whole tensors into ``engine``'s partitioned parameters (and the module's buffers).

    Args:
        engine: the attached engine of the model to fill.
        state: a mapping of key -> tensor (see ``lightning_zero.lightning.state_files.open_state_dict`` for files).
        prefix: keys in ``source`` start with this prefix followed by the module's own names
            (e.g. ``"model."``); keys without it are ignored.
        strict: raise when a parameter or buffer of the module has no key, or a key under
            ``prefix`` matches nothing.
    """
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
        _fill_masters(engine, state, key_of)
    for name, b in buffers.items():
        if name in keys:
            b.copy_(state[keys[name]])


def _fill_masters(engine: ZeroEngine, state: Mapping[str, torch.Tensor], key_of: dict) -> None:
    """Write the loaded values (their own precision, cast to the master dtype) into the master copies
    that are not views of the parameters: each rank its master range of each flat group."""
    sharded = engine.sharded
    assert sharded is not None
    for fi, (master, fg) in enumerate(zip(sharded.masters, sharded.groups)):
        lo, hi = sharded.master_range(fi)
        own = fg.flat if sharded.whole else fg.own_shard()
        if own.data_ptr() == master.data_ptr():
            continue  # the master is the parameter itself
        for slot in fg.slots:
            start, end = overlap(slot.offset, slot.offset + slot.numel, lo, hi)
            key = key_of.get(slot.param)
            if start < end and key is not None:
                value = state[key].reshape(-1)[start - slot.offset:end - slot.offset]
                master[start - lo:end - lo].copy_(value)
