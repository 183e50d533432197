"""The sharded optimizer's state in ``torch.optim``'s per-parameter layout, and back.

:func:`full_optimizer_state` gathers every rank's master-shard state into the state a plain
optimizer over the original parameters would hold (world-size independent: it loads at any world
size or stage, or into a plain optimizer); :func:`load_full_optimizer_state` cuts such a state
into this rank's shards (and hands it to an offload's storage); :func:`broadcast_master_init`
makes the masters' initial values rank 0's; :func:`sharded_optimizer` re-points the optimizer at this rank's masters,
in the store that keeps them (the engine's construction step 4, Note [construction order] in engine.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.offload.shard_store import ShardStore
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.optimizer import SCALAR_STATE_KEYS, ShardedOptimizer, original_index


@torch.no_grad()
def full_optimizer_state(sharded: ShardedOptimizer, comm: DataParallelComm) -> dict:
    """The optimizer's state as ``torch.optim`` would hold it for the original parameters.

    Every rank contributes its shards (all ranks must call this together); the result does not
    depend on the world size, so it loads at any world size or stage, or into a plain optimizer.
    """
    if sharded.whole:  # per-parameter views in the original order: already a plain optimizer's state
        return sharded.optimizer.state_dict()
    index = original_index(sharded)
    state: dict[int, dict] = {}
    groups = []
    for i, params in enumerate(sharded.original_params):  # the user's options, not the offload's kernel flags
        groups.append({**sharded.group_options(i), "params": [index[p] for p in params]})
    for fi, fg in enumerate(sharded.groups):
        shard_state = sharded.shard_state(fi)
        for key in sorted(shard_state):
            value = shard_state[key]
            if isinstance(value, torch.Tensor) and value.shape == sharded.masters[fi].shape:
                full = torch.zeros(fg.padded_numel, dtype=value.dtype, device=value.device)
                start, end = fg.shard_range()
                full[start:end].copy_(value)
                comm.of(fg.experts).all_gather_flat(full, start, end)
                for slot in fg.slots:
                    per_param = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                    state.setdefault(index[slot.param], {})[key] = per_param
            else:
                for slot in fg.slots:
                    v = value.clone() if isinstance(value, torch.Tensor) else value
                    state.setdefault(index[slot.param], {})[key] = v
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_full_optimizer_state(sharded: ShardedOptimizer, full: dict) -> None:
    """Load a state made by :func:`full_optimizer_state` (or a plain optimizer) into the shards."""
    if sharded.whole:
        sharded.optimizer.load_state_dict(full)
        return
    index = original_index(sharded)
    saved_groups = full.get("param_groups", [])
    if len(saved_groups) != len(sharded.optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one "
            f"{len(sharded.optimizer.param_groups)}. Resume with the same `configure_optimizers`."
        )
    saved_state = full.get("state", {})
    # optimizer state_dict ids number the tensors of all param groups consecutively
    ids_of: dict[int, int] = {}
    shard_sd: dict = {"state": {}, "param_groups": []}
    next_id = 0
    for pg, saved in zip(sharded.optimizer.param_groups, saved_groups):
        ids = []
        for piece in pg["params"]:
            ids_of[id(piece)] = next_id
            ids.append(next_id)
            next_id += 1
        shard_sd["param_groups"].append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    for fi, fg in enumerate(sharded.groups):
        per_slot = [saved_state.get(index[s.param], saved_state.get(str(index[s.param]), {})) for s in fg.slots]
        start, end = fg.shard_range()
        out: dict = {}
        per_element_keys = set()
        for key in sorted({k for st in per_slot for k in st}):
            sample = next(st[key] for st in per_slot if key in st)
            per_element = key not in SCALAR_STATE_KEYS and all(
                isinstance(st[key], torch.Tensor) and st[key].shape == s.shape
                for s, st in zip(fg.slots, per_slot) if key in st
            )
            if per_element:
                flat = torch.zeros(fg.padded_numel, dtype=sample.dtype)
                for s, st in zip(fg.slots, per_slot):
                    if key in st:
                        flat[s.offset : s.offset + s.numel].copy_(st[key].reshape(-1))
                out[key] = flat[start:end]
                per_element_keys.add(key)
            else:
                out[key] = sample
        if not out:
            continue
        lo = 0
        for piece in sharded.pieces_of[fi]:
            shard_sd["state"][ids_of[id(piece)]] = {
                key: value[lo : lo + piece.numel()].clone() if key in per_element_keys
                else value.clone() if isinstance(value, torch.Tensor) else value  # own ``step`` per piece
                for key, value in out.items()
            }
            lo += piece.numel()
    sharded.optimizer.load_state_dict(shard_sd)
    sharded.adopt_loaded_state()


@torch.no_grad()
def broadcast_master_init(
    init: Mapping[nn.Parameter, torch.Tensor], params: list[nn.Parameter], dtype: torch.dtype,
    comm: DataParallelComm, experts: Set[nn.Parameter] = frozenset(),
) -> dict[nn.Parameter, torch.Tensor]:
    """Rank 0's initial master values of ``params`` (same order on every rank) on every rank, in
    ``dtype``; one parameter at a time on the parameter's device (the collective's). ``experts``: over their
    expert-data group."""
    out = {p: init[p] for p in params if p in init}
    if comm.active:
        for p in out:
            t = out[p].to(device=p.device, dtype=dtype).contiguous()
            comm.of(p in experts).broadcast(t)
            out[p] = t.to(init[p].device)
    return out


def sharded_optimizer(optimizer: Optimizer | None, config: ZeroConfig, dtypes: DtypePolicy,
                      comm: DataParallelComm, groups: list[FlatParamGroup], managed: list[nn.Parameter],
                      master_init: Mapping[nn.Parameter, torch.Tensor] | None, store: ShardStore | None,
                      experts: Set[nn.Parameter] = frozenset()) -> ShardedOptimizer | None:
    """Stage >= 1: the optimizer over this rank's master shards in ``store``; stage 0: over per-parameter views of
    a whole separate master (mixed precision), or ``None`` when the optimizer steps the parameters themselves
    (then ``store`` is ``None`` too: ``open_store`` in ``engine_setup.py`` chose it before the partition)."""
    if optimizer is None or store is None:
        return None
    separate_master = not dtypes.master_is_param_view
    if separate_master and master_init:  # rank 0's values everywhere, as for the parameters
        master_init = broadcast_master_init(master_init, managed, dtypes.master_dtype, comm, experts)
    return ShardedOptimizer(optimizer, groups, dtypes.master_dtype, whole=not config.stage.shards_optimizer,
                            master_init=master_init, store=store)
