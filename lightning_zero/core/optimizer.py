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

from collections.abc import Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.flat_param import FlatParamGroup, overlap

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
            stage 3).
        master_dtype: dtype of the master shards; when it equals the parameter dtype the master
            is a view of the parameter shard (no copy).
        whole: stage 0 with a separate master (mixed precision): the master covers the whole flat
            buffer and the optimizer steps per-parameter views of it, shaped like the parameters
            and in the group's original order, so any optimizer works and its ``state_dict()`` is
            that of a plain optimizer.
        master_init: initial master values per parameter (e.g. the fp32 weights before the module
            was cast to 16 bits); parameters not in it start from their current values.

    Note [master shards]
        ``masters[i]`` is the 1-D master of flat group ``i`` covering ``master_range(i)`` of the
        flat layout: this rank's shard (stage >= 1) or the whole padded buffer (``whole``). The
        optimizer's param groups hold ``stepped[j]``: the master pieces (Note [master pieces]) of
        every flat group of param group ``j``, or with ``whole`` the per-parameter views.
        Stepping never touches the module: :meth:`write_back` casts the masters into the
        parameter shards.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        groups: list[FlatParamGroup],
        master_dtype: torch.dtype,
        whole: bool = False,
        master_init: Mapping[nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.groups = groups
        self.whole = whole
        self.original_params: list[list[torch.Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        self.masters: list[torch.Tensor] = []  # 1-D master of this rank, per flat group
        self.pieces_of: list[list[torch.Tensor]] = []  # the optimizer's tensors, per flat group
        self.stepped: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]  # per param group
        for fi, fg in enumerate(groups):
            own = self._own(fi)
            master = own if master_dtype == fg.dtype else _initial_master(fg, own, *self.master_range(fi),
                                                                           master_dtype, master_init)
            self.masters.append(master)
            if whole:  # stage 0: one flat group per param group
                views = {s.param: v for s, v in zip(fg.slots, fg.views(master))}
                pg = optimizer.param_groups[fg.optimizer_group]
                pieces = [views.get(p, p) for p in pg["params"]]  # frozen members stay as they are
            else:
                pieces = list(master.split(MASTER_PIECE_NUMEL))  # views (Note [master pieces])
            self.pieces_of.append(pieces)
            self.stepped[fg.optimizer_group].extend(pieces)
        for pg, stepped in zip(optimizer.param_groups, self.stepped):
            pg["params"] = list(stepped)

    def master_range(self, flat_group: int) -> tuple[int, int]:
        fg = self.groups[flat_group]
        return (0, fg.padded_numel) if self.whole else fg.shard_range()

    def _own(self, flat_group: int) -> torch.Tensor:
        """The parameter elements the master of a flat group mirrors."""
        fg = self.groups[flat_group]
        return fg.flat if self.whole else fg.own_shard()

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        """Give the masters these gradients (1-D, laid out like the masters; cast when needed)."""
        for fi, (master, grad) in enumerate(zip(self.masters, grads)):
            grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
            if self.whole:
                master.grad = grad
                fg = self.groups[fi]
                views = dict(zip((s.param for s in fg.slots), fg.views(grad)))
                for stepped, original in zip(self.pieces_of[fi], self.original_params[fg.optimizer_group]):
                    if stepped is not original:
                        stepped.grad = views[original]
            else:
                for piece, g in zip(self.pieces_of[fi], grad.split(MASTER_PIECE_NUMEL)):
                    piece.grad = g

    def master_grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer steps on (unscaling, norms and clipping act on these)."""
        if self.whole:
            return [m.grad for m in self.masters if m.grad is not None]
        return [p.grad for pieces in self.pieces_of for p in pieces if p.grad is not None]

    def write_back(self) -> None:
        """Copy (cast) stepped masters into the parameter shards (when not a view)."""
        for fi, master in enumerate(self.masters):
            own = self._own(fi)
            if own.data_ptr() != master.data_ptr():
                own.copy_(master)

    def write_masters_from_params(self, changed: list[FlatParamGroup]) -> None:
        """After parameters were changed outside the optimizer: refresh the master copies of the
        ``changed`` groups (where they are not views of the parameter shards)."""
        ids = {id(g) for g in changed}
        for fi, (master, fg) in enumerate(zip(self.masters, self.groups)):
            own = self._own(fi)
            if id(fg) in ids and own.data_ptr() != master.data_ptr():
                master.copy_(own)

    def clear_grads(self) -> None:
        for m, pieces in zip(self.masters, self.pieces_of):
            m.grad = None
            for t in pieces:
                t.grad = None

    def check_unchanged(self) -> None:
        if len(self.optimizer.param_groups) != len(self.stepped) or any(
            len(pg["params"]) != len(st) or any(a is not b for a, b in zip(pg["params"], st))
            for pg, st in zip(self.optimizer.param_groups, self.stepped)
        ):
            raise NotImplementedError(
                "The optimizer's param groups changed after setup (e.g. `add_param_group`, as BaseFinetuning "
                "does when it unfreezes layers). ZeRO partitions the groups at setup: create every "
                "group in `configure_optimizers` and keep `requires_grad` as it was at setup, or use stage 0 "
                "with precision='32-true'."
            )

    def restore(self) -> None:
        """Put the original parameters back into the param groups (master state is dropped)."""
        for pg, params, stepped in zip(self.optimizer.param_groups, self.original_params, self.stepped):
            for t in stepped:
                if not any(t is p for p in params):
                    self.optimizer.state.pop(t, None)
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

    @torch.no_grad()
    def full_masters(self, comm: DataParallelComm) -> list[torch.Tensor]:
        """Every flat group's whole padded master buffer (a collective for stage >= 1: all ranks call it)."""
        out = []
        for fi, (master, fg) in enumerate(zip(self.masters, self.groups)):
            if self.whole:
                out.append(master)
                continue
            full = torch.zeros(fg.padded_numel, dtype=master.dtype, device=master.device)
            start, end = self.master_range(fi)
            full[start:end].copy_(master)
            comm.all_gather_flat(full, start, end)
            out.append(full)
        return out


@torch.no_grad()
def broadcast_master_init(
    init: Mapping[nn.Parameter, torch.Tensor], params: list[nn.Parameter], dtype: torch.dtype,
    comm: DataParallelComm,
) -> dict[nn.Parameter, torch.Tensor]:
    """Rank 0's initial master values of ``params`` (same order on every rank) on every rank, in
    ``dtype``; one parameter at a time on the parameter's device (the collective's)."""
    out = {p: init[p] for p in params if p in init}
    if comm.active:
        for p in out:
            t = out[p].to(device=p.device, dtype=dtype).contiguous()
            comm.broadcast(t)
            out[p] = t.to(init[p].device)
    return out


def _initial_master(
    fg: FlatParamGroup, own: torch.Tensor, start: int, end: int, dtype: torch.dtype,
    init: Mapping[nn.Parameter, torch.Tensor] | None,
) -> torch.Tensor:
    """A new master for ``[start, end)`` of ``fg``'s layout (``own`` holds those parameter
    elements): from ``init`` where given, else the parameters' values."""
    master = own.to(dtype, copy=True)
    for s in fg.slots if init else ():
        source = init.get(s.param)
        lo, hi = overlap(s.offset, s.offset + s.numel, start, end)
        if source is not None and hi > lo:
            master[lo - start : hi - start].copy_(source.reshape(-1)[lo - s.offset : hi - s.offset])
    return master


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
    if sharded.whole:  # per-parameter views in the original order: already a plain optimizer's state
        return sharded.optimizer.state_dict()
    if sharded.whole:  # per-parameter views in the original order: already a plain optimizer's state
        return sharded.optimizer.state_dict()
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
    if sharded.whole:
        sharded.optimizer.load_state_dict(full)
        return
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
