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

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup, overlap
from lightning_zero.core.offload.shard_store import DeviceStore, ShardStore, SubGroup

MASTER_PIECE_NUMEL = 1 << 20  # elements per optimizer tensor (Note [master pieces])


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
        store: where the masters, their gradients and the optimizer state live (Note [one storage
            interface] in ``core/offload/shard_store.py``; default: on the device, with the parameters).
            An offloaded store (stage >= 1; docs/offload.md) keeps the masters as a separate copy and
            runs the optimizer's ``step`` (fused CPU kernels, sub-groups for ``"nvme"``).

    Note [master shards]
        ``masters[i]`` is the 1-D master of flat group ``i`` covering ``master_range(i)`` of the
        flat layout: this rank's shard (stage >= 1) or the whole padded buffer (``whole``). The
        optimizer's param groups hold ``stepped[j]``: the master pieces (Note [master pieces]) of
        every flat group of param group ``j``, or with ``whole`` the per-parameter views.
        Stepping never touches the module: :meth:`write_back` casts the masters into the
        parameter shards. Every step calls :attr:`store` the same way, wherever the shards live.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        groups: list[FlatParamGroup],
        master_dtype: torch.dtype,
        whole: bool = False,
        master_init: Mapping[nn.Parameter, torch.Tensor] | None = None,
        store: ShardStore | None = None,
    ) -> None:
        store = store if store is not None else DeviceStore()
        if store.offloaded and whole:
            raise ValueError("Optimizer offload needs ZeRO stage >= 1 (it offloads this rank's shard).")
        self.optimizer = optimizer
        self.groups = groups
        self.whole = whole
        self.store: ShardStore = store
        self._written_back = False  # the store's step already cast the masters into the params
        self.piece_numel = MASTER_PIECE_NUMEL
        self.original_params: list[list[torch.Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        self.masters: list[torch.Tensor] = []  # 1-D master of this rank, per flat group
        self.pieces_of: list[list[torch.Tensor]] = []  # the optimizer's tensors, per flat group
        self.stepped: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]  # per param group
        for fi, fg in enumerate(groups):
            own = self._own(fi)
            master = store.new_master(fi, own, master_dtype)
            if master is not own:
                _fill_master(master, fg, own, *self.master_range(fi), master_init, store.released(fi))
            self.masters.append(master)
            if whole:  # stage 0: one flat group per param group
                views = {s.param: v for s, v in zip(fg.slots, fg.views(master))}
                pg = optimizer.param_groups[fg.optimizer_group]
                pieces = [views.get(p, p) for p in pg["params"]]  # frozen members stay as they are
            else:
                pieces = list(master.split(self.piece_numel))  # views (Note [master pieces])
            self.pieces_of.append(pieces)
            self.stepped[fg.optimizer_group].extend(pieces)
        for pg, stepped in zip(optimizer.param_groups, self.stepped):
            pg["params"] = list(stepped)
        self._fused_before: dict[int, tuple] = store.use_kernels(optimizer)
        self._own_step = optimizer.__dict__.get("step")  # e.g. an LR scheduler's wrapper
        if store.runs_step:
            self._user_step = optimizer.step

            def step(closure: Callable[[], Any] | None = None) -> Any:
                return self._offloaded_step(closure)

            if hasattr(self._user_step, "_wrapped_by_lr_sched"):  # still counts for the LR scheduler's check
                step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            optimizer.step = step  # type: ignore[method-assign]
        self._settle()  # the masters' fill read the parameter shards (offload_param: their files)

    @property
    def offload(self) -> ShardStore | None:
        """The store when the shards are offloaded (its ``counters``, docs/offload.md), else ``None``."""
        return self.store if self.store.offloaded else None

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
            grad = self.store.receive_grad(fi, grad, master)
            if grad is None:  # the store keeps it and hands it to the pieces in its step (grad_files.py)
                continue
            if self.whole:
                master.grad = grad
                fg = self.groups[fi]
                views = dict(zip((s.param for s in fg.slots), fg.views(grad)))
                for stepped, original in zip(self.pieces_of[fi], self.original_params[fg.optimizer_group]):
                    if stepped is not original:
                        stepped.grad = views[original]
            else:
                for piece, g in zip(self.pieces_of[fi], grad.split(self.piece_numel)):
                    piece.grad = g
        self.store.grads_ready()  # pinned copies from the device: landed before the CPU reads them

    def master_grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer steps on (unscaling, norms and clipping act on these)."""
        if self.whole:
            return [m.grad for m in self.masters if m.grad is not None]
        return [p.grad for pieces in self.pieces_of for p in pieces if p.grad is not None]

    def write_back(self) -> None:
        """Copy (cast) stepped masters into the parameter shards (when not a view)."""
        if self._written_back:  # the store's step did it, sub-group by sub-group
            self._written_back = False
            return
        for fi, master in enumerate(self.masters):
            own = self._own(fi)
            if own.data_ptr() != master.data_ptr():
                self.store.write_back(own, master, self.groups[fi], 0)

    def write_masters_from_params(self, changed: list[FlatParamGroup]) -> None:
        """After parameters were changed outside the optimizer: refresh the master copies of the
        ``changed`` groups (where they are not views of the parameter shards)."""
        ids = {id(g) for g in changed}
        self.store.masters_free()  # the last write-backs have read the masters (Note [asynchronous host copies])
        for fi, (master, fg) in enumerate(zip(self.masters, self.groups)):
            own = self._own(fi)
            if id(fg) in ids and own.data_ptr() != master.data_ptr():
                master.copy_(own)
        self._settle()

    # ------------------------------------------------------------------ a step the store runs
    def _offloaded_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's ``step`` where the store runs it: the user's step per sub-group of master
        pieces, each stepped sub-group's state moved into the store and cast back into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sub_groups = self.store.sub_groups([m.numel() for m in self.masters], self.piece_numel)
        self.store.step(sub_groups, self._step_sub_group, self._piece_of)
        self._written_back = True
        return loss

    def _step_sub_group(self, sg: SubGroup) -> None:
        n = self.piece_numel
        pieces = [(fi, k) for fi, lo, hi in sg for k in range(lo // n, -(-hi // n))]
        everything = len(pieces) == sum(len(p) for p in self.pieces_of)
        if everything:
            self._user_step()
        else:
            members: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
            for fi, k in pieces:
                members[self.groups[fi].optimizer_group].append(self.pieces_of[fi][k])
            for pg, chosen in zip(self.optimizer.param_groups, members):
                pg["params"] = chosen
            try:
                self._user_step()
            finally:
                for pg, stepped in zip(self.optimizer.param_groups, self.stepped):
                    pg["params"] = list(stepped)
        for fi, k in pieces:
            self._home(fi, k)
        for fi, lo, hi in sg:
            own = self._own(fi)
            first = self.pieces_of[fi][lo // n]  # the stepped values: where the store pointed the pieces
            self.store.write_back(own[lo:hi], first.as_strided((hi - lo,), (1,)), self.groups[fi], lo)

    def _piece_of(self, fi: int, k: int) -> tuple[torch.Tensor, dict]:
        """Piece ``k`` of flat group ``fi``'s master and its optimizer state (created empty if none yet)."""
        piece = self.pieces_of[fi][k]
        return piece, self.optimizer.state[piece]

    def _home(self, fi: int, k: int) -> None:
        """Move piece ``k`` of flat group ``fi``'s per-element state into the store (Note [swap files])."""
        piece = self.pieces_of[fi][k]
        state = self.optimizer.state.get(piece)
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor) and value.shape == piece.shape and key not in SCALAR_STATE_KEYS:
                state[key] = self.store.place(fi, key, k * self.piece_numel, value, self.masters[fi].numel())

    def group_options(self, index: int) -> dict:
        """Param group ``index``'s options (no ``params``) as the user's optimizer holds them: what a state
        dict or checkpoint saves, without the offload's switch to the fused kernel (``fused``, ``foreach``)."""
        out = {k: v for k, v in self.optimizer.param_groups[index].items() if k != "params"}
        if index in self._fused_before:
            out["fused"], out["foreach"] = self._fused_before[index]
        return out

    def adopt_loaded_state(self) -> None:
        """After ``optimizer.load_state_dict``: move the loaded state into the store; the loaded ``fused`` /
        ``foreach`` become the user's flags (restored after fit) and the store's kernel is used."""
        self._fused_before = self.store.use_kernels(self.optimizer)
        for fi, pieces in enumerate(self.pieces_of):
            for k in range(len(pieces)):
                self._home(fi, k)
        self._settle()

    def _settle(self) -> None:
        """After reading or writing swapped tensors outside a step: take them out of memory again."""
        self.store.release_all()

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
        """Put the original parameters back into the param groups (master state is dropped, and an
        store's buffers and swap files with it)."""
        for pg, params, stepped in zip(self.optimizer.param_groups, self.original_params, self.stepped):
            for t in stepped:
                if not any(t is p for p in params):
                    self.optimizer.state.pop(t, None)
            pg["params"] = params
        if self.store.runs_step:
            self.optimizer.__dict__.pop("step", None)  # the class's step again, or the wrapper it had
            if self._own_step is not None:
                self.optimizer.step = self._own_step  # type: ignore[method-assign]
        for i, (fused, foreach) in self._fused_before.items():
            self.optimizer.param_groups[i]["fused"], self.optimizer.param_groups[i]["foreach"] = fused, foreach
        self.store.close()

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
        self._settle()
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
            comm.of(fg.experts).all_gather_flat(full, start, end)
            out.append(full)
        self._settle()
        return out


def _fill_master(
    master: torch.Tensor, fg: FlatParamGroup, own: torch.Tensor, start: int, end: int,
    init: Mapping[nn.Parameter, torch.Tensor] | None, after_chunk: Callable[[int, int], Any] | None = None,
) -> torch.Tensor:
    """Fill ``master``, the master of ``[start, end)`` of ``fg``'s layout (``own`` holds those
    parameter elements), from ``init`` where given, else the parameters' values; one master piece
    at a time, calling ``after_chunk(lo, hi)`` after each (an offload releases the piece)."""
    step = MASTER_PIECE_NUMEL
    for lo in range(0, master.numel(), step):
        hi = min(lo + step, master.numel())
        if master.data_ptr() != own.data_ptr():
            master[lo:hi].copy_(own[lo:hi])
        for s in fg.slots if init else ():
            source = init.get(s.param)
            a, b = overlap(s.offset, s.offset + s.numel, start + lo, start + hi)
            if source is not None and b > a:
                master[a - start : b - start].copy_(source.reshape(-1)[a - s.offset : b - s.offset])
        if after_chunk is not None:
            after_chunk(lo, hi)
    return master


# per-parameter scalars of torch.optim optimizers (all other tensor states are per element)
SCALAR_STATE_KEYS = frozenset({"step", "eta", "mu"})


def original_index(sharded: ShardedOptimizer) -> dict[torch.Tensor, int]:
    """Each original parameter's index in ``torch.optim``'s ``state_dict`` numbering (param groups in
    order, parameters in group order): the ids a plain optimizer's state dict uses."""
    out: dict[torch.Tensor, int] = {}
    for params in sharded.original_params:
        for p in params:
            out[p] = len(out)
    return out


