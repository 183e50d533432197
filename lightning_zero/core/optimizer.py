"""Re-pointing a user's ``torch.optim`` optimizer at this rank's master shards.

The optimizer object the user built (and that LR schedulers hold) is kept; for stage >= 1 each
of its param groups is made to hold this rank's master shard of the group's flat buffer (Note
[flat shard layout]), as consecutive 1-D pieces of at most ``MASTER_PIECE_NUMEL`` elements. Its
hyper-parameters, schedulers and ``step()`` are unchanged, and its state is created for the
shard only.

Note [master pieces]
    The pieces are views of one contiguous master shard per group, so writing back and
    gathering still move one buffer. Splitting only bounds the temporaries that ``foreach``
    optimizers allocate per tensor: one 40 MB temporary per step is served by ``mmap`` and
    page-faulted afresh every step (AdamW on a 10M-element shard: 80 ms whole, 28 ms in 1M
    pieces, docs/benchmarks.md). Element-wise optimizers give the same result either way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.flat_param import FlatParamGroup

MASTER_PIECE_NUMEL = 1 << 20  # elements per optimizer tensor (Note [master pieces])

# Optimizers whose update of an element depends only on that element's own history, so that
# stepping a 1-D shard equals stepping the whole tensors.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def check_optimizer(optimizer: Optimizer, stage: int, extra_allowed: tuple[type, ...] = ()) -> None:
    """Refuse, with the fix, an optimizer whose update is not element-wise under stage >= 1."""
    if stage == 0:
        return
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS or isinstance(optimizer, tuple(extra_allowed)):
        return
    if getattr(optimizer, "_zero_elementwise", False):
        return
    raise ValueError(
        f"ZeRO stage {stage} steps each rank's 1-D shard of the parameters, which is only correct for an "
        f"element-wise optimizer; {type(optimizer).__name__} is not known to be one (LBFGS, Adafactor, "
        "Muon and other optimizers that mix elements of a tensor are not). Use stage 0, an optimizer from "
        f"{[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}, or, if yours is element-wise, pass "
        f"`ZeroStrategy(..., elementwise_optimizers=({type(optimizer).__name__},))`."
    )


def trainable_groups(optimizer: Optimizer, module_params: dict[nn.Parameter, str]) -> list[list[nn.Parameter]]:
    """The trainable module parameters of each param group, in module order.

    Raises when the optimizer holds a tensor that is not a parameter of the module.
    """
    position = {p: i for i, p in enumerate(module_params)}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in position:
                raise ValueError(
                    f"Param group {gi} of {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the LightningModule. Build the optimizer in "
                    "`configure_optimizers` from `self.parameters()` (or a subset of them)."
                )
        trainable = [p for p in group["params"] if p.requires_grad]
        groups.append(sorted(trainable, key=position.__getitem__))
    return groups


class ShardedOptimizer:
    """Binds an optimizer to master shards and writes the stepped shards back.

    Args:
        optimizer: the user's optimizer.
        groups: the flat groups, bound; ``group.optimizer_group`` names the param group each
            belongs to (one per param group for stages 0-2, one per unit and param group for
            stage 3). Every param group must have at least one flat group.
        master_dtype: dtype of the master shards; when it equals the parameter dtype the master
            is a view of the parameter shard (no copy).
    """

    def __init__(self, optimizer: Optimizer, groups: list[FlatParamGroup], master_dtype: torch.dtype) -> None:
        self.optimizer = optimizer
        self.groups = groups
        self.original_params: list[list[torch.Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        self.masters: list[torch.Tensor] = []  # 1-D master shard of this rank, per flat group
        self.pieces_of: list[list[torch.Tensor]] = []  # the optimizer's tensors, per flat group
        new_params: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for fg in groups:
            own = fg.own_shard()
            master = own if master_dtype == fg.dtype else own.detach().to(master_dtype).clone()
            self.masters.append(master)
            pieces = list(master.split(MASTER_PIECE_NUMEL))  # views (Note [master pieces])
            self.pieces_of.append(pieces)
            new_params[fg.optimizer_group].extend(pieces)
        for pg, params in zip(optimizer.param_groups, new_params):
            pg["params"] = params
        self._expected = [list(map(id, params)) for params in new_params]

    def groups_of(self, param_group: int) -> list[int]:
        """Indices of the flat groups of one optimizer param group."""
        return [i for i, fg in enumerate(self.groups) if fg.optimizer_group == param_group]

    def set_grads(self, shard_grads: list[torch.Tensor]) -> None:
        for master, grad, pieces in zip(self.masters, shard_grads, self.pieces_of):
            grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
            for piece, g in zip(pieces, grad.split(MASTER_PIECE_NUMEL)):
                piece.grad = g

    def master_grads(self) -> list[torch.Tensor | None]:
        """The gradient tensors handed to the optimizer (for accounting)."""
        return [p.grad for pieces in self.pieces_of for p in pieces]

    def write_back(self) -> None:
        """Copy stepped masters into the parameter shards (when not a view)."""
        for master, fg in zip(self.masters, self.groups):
            own = fg.own_shard()
            if own.data_ptr() != master.data_ptr():
                own.copy_(master)

    def write_masters_from_params(self, changed: list[FlatParamGroup]) -> None:
        """After parameters were changed outside the optimizer: refresh the master copies of the
        ``changed`` groups (where they are not views of the parameter shards)."""
        ids = {id(g) for g in changed}
        for master, fg in zip(self.masters, self.groups):
            own = fg.own_shard()
            if id(fg) in ids and own.data_ptr() != master.data_ptr():
                master.copy_(own)

    def clear_grads(self) -> None:
        for pieces in self.pieces_of:
            for p in pieces:
                p.grad = None

    def check_unchanged(self) -> None:
        current = [list(map(id, pg["params"])) for pg in self.optimizer.param_groups]
        if current != self._expected:
            raise NotImplementedError(
                "The optimizer's param groups changed after setup (e.g. `add_param_group`, as BaseFinetuning "
                "does when it unfreezes layers). ZeRO stage >= 1 partitions the groups at setup: create every "
                "group in `configure_optimizers` and keep `requires_grad` as it was at setup, or use stage 0."
            )

    def restore(self) -> None:
        """Put the original parameters back into the param groups (shard state is dropped)."""
        for pg, params in zip(self.optimizer.param_groups, self.original_params):
            for piece in pg["params"]:
                self.optimizer.state.pop(piece, None)
            pg["params"] = params

    def shard_state(self, flat_group: int) -> dict:
        """The optimizer state of one flat group's master shard, pieces joined into 1-D tensors."""
        pieces = self.pieces_of[flat_group]
        states = [self.optimizer.state.get(p, {}) for p in pieces]
        out: dict = {}
        for key in states[0] if states else ():
            values = [st[key] for st in states]
            if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, pieces)):
                out[key] = torch.cat(values) if len(values) > 1 else values[0]
            else:
                out[key] = values[0]  # per-tensor scalar (e.g. ``step``), equal on every piece
        return out


# per-parameter scalars of torch.optim optimizers (all other tensor states are per element)
_SCALAR_STATE_KEYS = frozenset({"step", "eta", "mu"})


def _index_of_original(sharded: ShardedOptimizer) -> dict[torch.Tensor, int]:
    out: dict[torch.Tensor, int] = {}
    for params in sharded.original_params:
        for p in params:
            out[p] = len(out)
    return out


@torch.no_grad()
def full_optimizer_state(sharded: ShardedOptimizer, comm: DataParallelComm) -> dict:
    """The optimizer's state as ``torch.optim`` would hold it for the original parameters.

    Every rank contributes its shards (all ranks must call this together); the result does not
    depend on the world size, so it loads at any world size or stage, or into a plain optimizer.
    """
    index = _index_of_original(sharded)
    state: dict[int, dict] = {}
    groups = []
    for pg, params in zip(sharded.optimizer.param_groups, sharded.original_params):
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": [index[p] for p in params]})
    for fi, fg in enumerate(sharded.groups):
        shard_state = sharded.shard_state(fi)
        for key in sorted(shard_state):
            value = shard_state[key]
            if isinstance(value, torch.Tensor) and value.shape == sharded.masters[fi].shape:
                full = torch.zeros(fg.padded_numel, dtype=value.dtype, device=value.device)
                start, end = fg.shard_range()
                full[start:end].copy_(value)
                comm.all_gather_flat(full, start, end)
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
    index = _index_of_original(sharded)
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
            per_element = key not in _SCALAR_STATE_KEYS and all(
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
        for k, piece in enumerate(sharded.pieces_of[fi]):
            lo = k * MASTER_PIECE_NUMEL
            shard_sd["state"][ids_of[id(piece)]] = {
                key: value[lo : lo + piece.numel()].clone() if key in per_element_keys
                else value.clone() if isinstance(value, torch.Tensor) else value  # own ``step`` per piece
                for key, value in out.items()
            }
    sharded.optimizer.load_state_dict(shard_sd)
