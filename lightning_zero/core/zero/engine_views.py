"""Whole-model views of a :class:`~lightning_zero.core.zero.engine.ZeroEngine` and undoing it (an object it holds).

What a user or a checkpoint needs whole: the master values, the bytes of model state, a full state dict
(stage 3 gathers unit by unit), parameters gathered for reading or editing (``gathered_parameters``), and
``detach``, which gives the module back its own parameters and the optimizer its original param groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.common.memory import ModelStateBytes, StorageCounter
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit, UnitState
from lightning_zero.core.zero.grad_reducer import GradReducer
from lightning_zero.core.zero.optimizer import ShardedOptimizer
from lightning_zero.core.zero.optimizer_state import full_optimizer_state


class WholeModelViews:
    """Whole views of the sharded model (masters, state dict, gathered parameters), and ``detach``.

    Args:
        module: the model.
        optimizer: the user's optimizer (``None``: evaluation only).
        comm: the data-parallel collectives.
        dtypes: parameter / gradient / master dtypes.
        names: every module parameter -> qualified name, module order.
        groups: the flat groups of trainable parameters; ``all_groups`` adds stage 3's frozen ones.
        units: stage 3's units (empty below stage 3); ``runtime`` their gather / release hooks.
        reducer: the gradient hooks to remove at ``detach``.
        sharded: the optimizer re-pointed at master shards, or ``None``.
        undo_checkpointing: removes activation checkpointing, when it was applied.
        user_zero_grad: the optimizer's own ``zero_grad``, put back at ``detach``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        comm: DataParallelComm,
        dtypes: DtypePolicy,
        names: dict[nn.Parameter, str],
        groups: list[FlatParamGroup],
        all_groups: list[FlatParamGroup],
        units: list[ShardedUnit],
        runtime: Stage3Runtime | None,
        reducer: GradReducer,
        sharded: ShardedOptimizer | None,
        undo_checkpointing: Callable[[], None] | None,
        user_zero_grad: Callable[..., None] | None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.comm = comm
        self.dtypes = dtypes
        self.names = names
        self.groups = groups
        self.all_groups = all_groups
        self.units = units
        self.runtime = runtime
        self.reducer = reducer
        self.sharded = sharded
        self._undo_checkpointing = undo_checkpointing
        self._user_zero_grad = user_zero_grad

    def detach(self, keep_optimizer_state: bool = True, gather_params: bool = True) -> None:
        """Undo the binding: hooks removed, parameters own their storage, optimizer restored.

        Args:
            keep_optimizer_state: gather the sharded optimizer state (a collective: every rank
                must call this together) and load it into the restored optimizer, so that it can
                be saved or stepped after fit; else the shard state is dropped (after an error).
            gather_params: stage 3: give the module its whole parameters back (a collective).
                ``False`` leaves them released (NaN placeholders of the right shapes, Note
                [released parameters]) and drops the optimizer state: for models that do not fit
                on one rank, and after an error (no collective). ``plan_teardown`` in
                ``core/zero/teardown.py`` decides both flags for the strategy (Note [teardown gather]).
        """
        self.reducer.remove_hooks()
        if self._undo_checkpointing is not None:
            self._undo_checkpointing()
        if self.optimizer is not None and self._user_zero_grad is not None:
            self.optimizer.zero_grad = self._user_zero_grad  # type: ignore[method-assign]
        if self.runtime is not None and not gather_params:
            self.runtime.remove_hooks()
            self.runtime.release_all()
            for unit in self.units:
                unit.park_on_cpu()
            if self.sharded is not None:
                self.sharded.restore()
            for p in self.names:
                p.grad = None
            return
        if self.runtime is not None:  # the parameters come back whole (a collective)
            self.runtime.remove_hooks()
            self.runtime.gather_all()
        full, masters = None, None
        if self.sharded is not None:
            if self.separate_master and (keep_optimizer_state or self.sharded.whole):
                masters = self.sharded.full_masters(self.comm)
            full = full_optimizer_state(self.sharded, self.comm) if keep_optimizer_state else None
            self.sharded.restore()
        for g in self.all_groups:
            g.unbind()
            g.shard = None
        if self.separate_master:
            # The master holds the trained values: the parameters take its dtype and values back
            # (after an error at stage >= 1 only the 16-bit values are at hand). The caller casts
            # the rest of the module (frozen parameters, buffers); the precision plugin does.
            with torch.no_grad():
                for gi, g in enumerate(self.groups):
                    views = g.views(masters[gi]) if masters is not None else [None] * len(g.slots)
                    for s, v in zip(g.slots, views):
                        s.param.data = v.clone() if v is not None else s.param.data.to(self.dtypes.master_dtype)
        if full is not None:
            self.optimizer.load_state_dict(full)
        for p in self.names:
            p.grad = None

    @property
    def separate_master(self) -> bool:
        """Whether the optimizer steps a master copy in another dtype than the parameters."""
        return not self.dtypes.master_is_param_view

    @torch.no_grad()
    def full_master_params(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each trainable parameter's master value, whole (a collective for stage >= 1: every rank
        calls it). Without a separate master these are the parameters themselves."""
        if (self.sharded is None or not self.separate_master) and self.runtime is not None:
            full = self.full_state_dict()  # stage 3: the parameters are released placeholders; gather
            return {s.param: full[self.names[s.param]] for g in self.groups for s in g.slots}
        if self.sharded is None or not self.separate_master:
            return {s.param: s.param.detach() for g in self.groups for s in g.slots}
        out = {}
        for g, full in zip(self.groups, self.sharded.full_masters(self.comm)):
            out.update({s.param: v for s, v in zip(g.slots, g.views(full))})
        return out

    @contextmanager
    def gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
        """See :func:`lightning_zero.gathered_parameters` (every rank must call it together)."""
        wanted = set(params)
        groups = [g for g in self.all_groups if any(s.param in wanted for s in g.slots)]
        if modifier_rank is not None and any(g.experts for g in groups):
            raise NotImplementedError("gathered_parameters(modifier_rank=...) over expert parameters is not built (a "
                                      "data rank's experts are not every rank's): modify dense parameters only, or "
                                      "load new expert weights with load_full_state_dict")
        in_groups = {s.param for g in groups for s in g.slots}
        loose = [p for p in params if p not in in_groups]  # stages 0-2: frozen parameters, kept whole
        opened = [u for u in self.units if u.state is UnitState.SHARDED and any(g in u.groups for g in groups)]
        if self.runtime is not None:
            for unit in opened:
                self.runtime.gather_one(unit)
            for unit in opened:
                unit.wait()
        try:
            yield  # an exception in the block skips the scatter but still releases the units
            if modifier_rank is not None:
                with torch.no_grad():
                    for g in groups:
                        self.comm.broadcast(g.flat, modifier_rank)  # no expert group: refused above
                        if g.shard is not None:
                            start, end = g.shard_range()
                            g.shard.copy_(g.flat[start:end])
                    for p in loose:
                        self.comm.broadcast(p.data, modifier_rank)
                    if self.sharded is not None:
                        self.sharded.write_masters_from_params(groups)
        finally:
            if self.runtime is not None:
                for unit in opened:
                    self.runtime.release_one(unit)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with whole tensors (stage 3 gathers; a collective)."""
        if self.runtime is None:
            return self.module.state_dict()
        self.runtime.gather_all()
        try:
            return {k: v.clone() for k, v in self.module.state_dict().items()}
        finally:
            self.runtime.release_all()

    def end_forward_only(self) -> None:
        """After an evaluation step under stage 3: free the units it gathered."""
        if self.runtime is not None:
            self.runtime.end_forward_only()

    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of params / grads / optimizer / comm_buffers / pooled, counted from live tensors."""
        counter = StorageCounter()
        if self.runtime is not None:
            # gathered units are working memory; the persistent model state is the shards
            counter.add("comm_buffers", [g.flat for u in self.units if not u.persistent for g in u.groups])
            counter.add("params", [g.own_shard() for g in self.all_groups])
            counter.add("params", [g.flat for u in self.units if u.persistent for g in u.groups])
        else:
            counter.add("params", list(self.names))
        counter.add("grads", [p.grad for p in self.names])
        counter.add("grads", [t for t in (*self.reducer.flat_grads, *self.reducer.grad_shards)])
        if self.sharded is not None:
            counter.add("grads", self.sharded.master_grads())
            counter.add("optimizer", self.sharded.masters)
        for state in self.optimizer.state.values() if self.optimizer is not None else ():
            counter.add("optimizer", [v for v in state.values() if isinstance(v, torch.Tensor)])
        counter.add("comm_buffers", list(self.reducer.live_buffers()))
        counter.add("pooled", self.reducer.idle_buffers())
        if self.runtime is not None:
            counter.add("pooled", self.runtime.pool.spares())
        return counter.result()
