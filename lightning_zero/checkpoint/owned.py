"""Loading a sharded checkpoint into an attached engine: each rank reads only what it keeps.

Note [owned slices]
    For every flat group of the engine the elements to fill are the ones this rank keeps: the
    whole padded buffer where the group is whole (stages 1-2, stage 3's persistent unit), else
    the rank's shard range (stage 3). For each parameter overlapping that range, the overlapping
    elements of its value are read from the checkpoint's rank files (whatever world size, stage
    or layout wrote them: parameters are matched by state-dict key) straight into the
    destination, converting the dtype a bounded piece at a time. Separate fp32 masters are
    filled the same way (from the checkpoint's masters where it has them, so they stay exact).
    The optimizer state of a flat group is one 1-D tensor per key covering the master range,
    filled the same way and handed to the optimizer as views, one per master piece (no copy).
    So resuming holds nothing beyond the training state itself and one bounded read buffer,
    and no collective is needed: each rank reads its own slices. A tensor-parallel slice reads its part
    of the whole tensor, whatever TP size wrote it (Note [TP slices in checkpoints] in slices.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero.checkpoint.reader import (
    LazyOptimizerState,
    LazyStateDict,
    ShardedCheckpoint,
    materialize_optimizer_state,
)
from lightning_zero.checkpoint.slices import slice_ref
from lightning_zero.core.common.flat_param import overlap

if TYPE_CHECKING:
    from lightning_zero.core.common.flat_param import FlatParamGroup
    from lightning_zero.core.zero.engine import ZeroEngine

RefOf = Callable[[nn.Parameter], "Mapping[str, Any] | None"]


def _target(g: FlatParamGroup) -> tuple[int, int, torch.Tensor]:
    """``(lo, hi, destination)``: the part of ``g``'s layout this rank keeps, and where."""
    if g.shard is None:
        return 0, g.padded_numel, g.flat  # stages 1-2: whole
    start, end = g.shard_range()
    if g.flat.untyped_storage().size() > 0 and g.shard.data_ptr() == g.flat[start:end].data_ptr():
        return 0, g.padded_numel, g.flat  # stage 3's persistent unit: whole, the shard is a view of it
    return start, end, g.shard


def _fill(ckpt: ShardedCheckpoint, g: FlatParamGroup, lo: int, hi: int, dest: torch.Tensor, ref_of: RefOf) -> None:
    """Read the elements ``[lo, hi)`` of ``g``'s layout into ``dest`` (Note [owned slices])."""
    for s in g.slots:
        a, b = overlap(lo, hi, s.offset, s.offset + s.numel)
        ref = ref_of(s.param)
        if b <= a or ref is None:
            continue
        shape = ckpt.ref_shape(ref)
        if tuple(shape) != tuple(s.shape):
            raise ValueError(
                f"{ref.get('key', ref)!r} has shape {tuple(shape)} in the checkpoint, {tuple(s.shape)} here."
            )
        ckpt.read_range(ref, a - s.offset, b - s.offset, dest[a - lo : b - lo])


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (non-persistent ones are not saved, so never missing)."""
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}


def _key_of(engine: ZeroEngine, keys: set[str], strict: bool) -> dict[nn.Parameter, str | None]:
    names_of: dict[nn.Parameter, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(p, []).append(name)
    buffers = _persistent_buffers(engine.module)
    key_of = {p: next((n for n in names if n in keys), None) for p, names in names_of.items()}
    missing = [names[0] for p, names in names_of.items() if key_of[p] is None] + [n for n in buffers if n not in keys]
    unexpected = sorted(keys - {n for names in names_of.values() for n in names} - set(buffers))
    if strict and (missing or unexpected):
        raise ValueError(
            f"The checkpoint does not match the module: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. Resume with the same model, or "
            "load with `strict=False`."
        )
    return key_of


@torch.no_grad()
def load_owned_state_dict(engine: ZeroEngine, state: LazyStateDict, strict: bool = True) -> None:
    """Fill ``engine``'s parameter shards (and masters, buffers) from a sharded checkpoint's
    state dict, reading only this rank's slices (Note [owned slices]). No collective.

    Args:
        engine: the attached engine; stage-3 units released (as at the start of fit).
        state: ``ShardedCheckpoint(path).state_dict()``.
        strict: raise when a parameter or buffer has no key, or a key matches nothing.
    """
    ckpt, refs = state.checkpoint, state.refs
    key_of = _key_of(engine, set(refs), strict)

    def ref_of(p: nn.Parameter) -> Mapping[str, Any] | None:
        key = key_of.get(p)
        if key is None:
            return None
        return slice_ref(refs[key], p, ckpt.ref_shape(refs[key]))  # a TP slice: its part of the whole

    in_flat = set()
    for g in engine.all_groups:
        lo, hi, dest = _target(g)
        _fill(ckpt, g, lo, hi, dest, ref_of)
        in_flat.update(s.param for s in g.slots)
    if engine.sharded is not None and (engine.separate_master or engine.sharded.offload is not None):
        for fi, g in enumerate(engine.groups):  # an offloaded master is its own copy, whatever the dtypes
            lo, hi = engine.sharded.master_range(fi)
            _fill(ckpt, g, lo, hi, engine.sharded.masters[fi], ref_of)
    for p, key in key_of.items():
        if p not in in_flat and key is not None:  # outside the flat groups: small, whole on every rank
            p.data.copy_(ckpt.read(ref_of(p)))
    for name, b in _persistent_buffers(engine.module).items():
        if name in refs:
            b.copy_(ckpt.read(refs[name]))


@torch.no_grad()
def load_owned_optimizer_state(engine: ZeroEngine, state: Mapping[str, Any]) -> None:
    """Load one optimizer's state from a sharded checkpoint into ``engine``'s sharded optimizer,
    reading only this rank's slices (Note [owned slices]). No collective.

    Args:
        engine: the attached engine (stage >= 1).
        state: one of ``ShardedCheckpoint(path).optimizer_states()``.
    """
    from lightning_zero.core.zero.optimizer import SCALAR_STATE_KEYS, original_index

    sharded = engine.sharded
    lazy = state["state"]
    if sharded.whole:  # stage 0: the optimizer state is whole on every rank anyway
        from lightning_zero.core.zero.optimizer_state import load_full_optimizer_state

        load_full_optimizer_state(sharded, materialize_optimizer_state(state))
        return
    if not isinstance(lazy, LazyOptimizerState):
        raise TypeError("load_owned_optimizer_state reads a sharded checkpoint's lazy optimizer state.")
    ckpt, refs = lazy.checkpoint, lazy.refs
    saved_groups = state.get("param_groups", [])
    if len(saved_groups) != len(sharded.optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one "
            f"{len(sharded.optimizer.param_groups)}. Resume with the same `configure_optimizers`."
        )
    index = original_index(sharded)
    ids_of: dict[int, int] = {}
    shard_sd: dict[str, Any] = {"state": {}, "param_groups": []}
    for pg, saved in zip(sharded.optimizer.param_groups, saved_groups):
        ids = []
        for piece in pg["params"]:
            ids_of[id(piece)] = len(ids_of)
            ids.append(ids_of[id(piece)])
        shard_sd["param_groups"].append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    for fi, g in enumerate(sharded.groups):
        # a TP slice's moments: its part of the whole (Note [TP slices in checkpoints])
        per_slot = {s.param: {k: slice_ref(r, s.param, ckpt.ref_shape(r))
                              for k, r in refs.get(index[s.param], {}).items()} for s in g.slots}
        lo, hi = sharded.master_range(fi)
        master = sharded.masters[fi]
        values: dict[str, Any] = {}
        per_element: set[str] = set()
        for key in sorted({k for r in per_slot.values() for k in r}):
            sample = next(r[key] for r in per_slot.values() if key in r)
            if "value" in sample or key in SCALAR_STATE_KEYS or tuple(ckpt.ref_shape(sample)) != tuple(
                next(s.shape for s in g.slots if key in per_slot[s.param])
            ):
                values[key] = ckpt.read(sample)  # a per-tensor scalar (``step``): the same for every piece
                continue
            dtype = ckpt.ref_dtype(sample)
            buf = torch.zeros(hi - lo, dtype=master.dtype if dtype.is_floating_point else dtype, device=master.device)
            _fill(ckpt, g, lo, hi, buf, lambda p, key=key, refs_of=per_slot: refs_of[p].get(key))
            values[key] = buf
            per_element.add(key)
        if not values:
            continue
        at = 0
        for piece in sharded.pieces_of[fi]:
            n = piece.numel()
            shard_sd["state"][ids_of[id(piece)]] = {
                key: value[at : at + n] if key in per_element
                else value.clone() if isinstance(value, torch.Tensor) else value  # own ``step`` per piece
                for key, value in values.items()
            }
            at += n
    sharded.optimizer.load_state_dict(shard_sd)
    sharded.adopt_loaded_state()


@torch.no_grad()
def load_whole_module(module: nn.Module, state: LazyStateDict, strict: bool = True) -> None:
    """A module that is whole (before a stage 1-2 setup): copy the checkpoint's tensors into its
    parameters and buffers one at a time (never a whole second copy of the state dict)."""
    own = module.state_dict(keep_vars=True)  # what a state dict holds (no non-persistent buffers)
    missing = [k for k in own if k not in state.refs]
    unexpected = [k for k in state.refs if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, unexpected "
            f"keys {unexpected[:5]}. Resume with the same model, or load with `strict=False`."
        )
    for key, t in own.items():
        if key in state.refs:
            value = state[key]
            if tuple(value.shape) != tuple(t.shape):
                raise RuntimeError(f"{key!r} has shape {tuple(value.shape)} in the checkpoint, {tuple(t.shape)} here.")
            t.data.copy_(value)
