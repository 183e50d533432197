"""ZeRO stages 0-3 applied to one module and its optimizer: the core the strategy drives.

Lifecycle, per optimizer step (the strategy calls these; plain PyTorch code can too)::

    engine.zero_grad()                  # start of an accumulation window
    with engine.no_sync():              # micro-steps before the last: stages 0-1 do not talk
        loss.backward(); engine.finish_backward()
    loss.backward(); engine.finish_backward()   # last micro-step: gradients reduced
    if not engine.prepare_step(loss_scale):     # unscaled master gradients; False: no overflow
        engine.clip_grad_norm_(1.0)     # optional, global norm over all shards
        optimizer.step()                # steps this rank's master shards (stage >= 1)
    engine.after_step()                 # shards written back and all-gathered into the params

``prepare_step`` may be left out when the optimizer can step on the reduced gradient buffers
themselves (``master_grad_is_view``, no loss scale, no offload): fp32 and bf16-true training.

What each stage keeps whole on a rank (Note [flat shard layout] in flat_param.py):
stage 0: params, grads, optimizer state; stage 1: params, grads; stage 2: params; stage 3:
nothing (units are gathered just in time, see ``stage3.py``).
Mixed precision adds a master copy in ``dtypes.master_dtype`` (whole at stage 0, else a shard)
that the optimizer steps and that is cast back into the 16-bit parameters (Note [master shards]).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core import gathered
from lightning_zero.core.checkpointing import apply_activation_checkpointing
from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.config import DtypePolicy, ZeroConfig
from lightning_zero.core.flat_param import FlatParamGroup
from lightning_zero.core.grad_reducer import BackwardState, GradReducer
from lightning_zero.core.loss_scaler import any_rank, local_sum_of_squares, non_finite
from lightning_zero.core.materialize import ParamInitFn
from lightning_zero.core.memory import ModelStateBytes, StorageCounter
from lightning_zero.core.offload import OffloadConfig
from lightning_zero.core.offload_store import OptimizerOffload
from lightning_zero.core.optimizer import (
    ShardedOptimizer,
    check_optimizer,
    trainable_groups,
)
from lightning_zero.core.optimizer_state import broadcast_master_init, full_optimizer_state
from lightning_zero.core.sharded_unit import ShardedUnit, UnitState
from lightning_zero.core.stage3 import Stage3Runtime, apply_stage3
from lightning_zero.core.units import plan_units


class ZeroEngine:
    """Partitions ``module``'s training state over the data-parallel ranks of ``comm``.

    Args:
        module: the model; its parameters become views into flat buffers.
        optimizer: a ``torch.optim`` optimizer over (a subset of) ``module``'s parameters.
        config: the ZeRO policy (stage 0-3).
        comm: the data-parallel collectives (world size 1 without a process group).
        dtypes: parameter / gradient / master dtypes (default: the module's dtype, fp32 master).
        master_init: initial master values per parameter when the master is a separate copy (the
            weights before the module was cast to 16 bits, so the master starts exact).
        param_init_fn: stage 3, parameters built on the meta device: ``fn(module, name)``
            initialises a module's own parameters (default ``reset_parameters``).
        init_seed: base seed of that initialisation (Note [sharded construction] in materialize.py).
        offload: where the optimizer shards (and at stage 3 the parameter shards) live
            (docs/offload.md); default: with the parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        config: ZeroConfig,
        comm: DataParallelComm | None = None,
        dtypes: DtypePolicy | None = None,
        master_init: Mapping[nn.Parameter, torch.Tensor] | None = None,
        param_init_fn: ParamInitFn | None = None,
        init_seed: int = 0,
        offload: OffloadConfig | None = None,
    ) -> None:
        self.offload_config = offload or OffloadConfig()
        self.offload_config.check(config.stage)
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.comm = comm or DataParallelComm(collective=config.collective)
        self.dtypes = dtypes or DtypePolicy(param_dtype=_module_dtype(module))
        if self.dtypes.param_dtype != _module_dtype(module):
            raise ValueError(
                f"The module's parameters are {_module_dtype(module)} but the dtype policy says "
                f"{self.dtypes.param_dtype}. Cast the module first (the precision plugin's convert_module does)."
            )
        check_optimizer(optimizer, config.stage, config.elementwise_optimizers)
        self.names: dict[nn.Parameter, str] = {}  # every module parameter -> qualified name, module order
        for name, p in module.named_parameters():
            self.names.setdefault(p, name)
        self._check_same_structure()
        groups = trainable_groups(optimizer, self.names)
        managed = {p for g in groups for p in g}
        # trainable parameters no optimizer group holds: they are never updated nor reduced
        self.unmanaged: list[nn.Parameter] = [p for p in self.names if p.requires_grad and p not in managed]
        self.units: list[ShardedUnit] = []  # stage 3 only
        self.runtime: Stage3Runtime | None = None  # stage 3's gather / release hooks
        if config.stage == 3:
            # binds, initialises (meta-built models), broadcasts and shards one unit at a time
            self.units, self.runtime, self.all_groups = apply_stage3(
                module, self.names, groups, self.comm, config, param_init_fn, init_seed
            )
        else:
            self.all_groups = [FlatParamGroup(g, self.comm.world_size, self.comm.rank) for g in groups]
            for i, g in enumerate(self.all_groups):
                g.optimizer_group = i
                g.bind()
        # the flat groups of trainable parameters (stage 3 also has groups of frozen ones)
        self.groups: list[FlatParamGroup] = [g for g in self.all_groups if g.optimizer_group >= 0]
        self._broadcast_from_rank0()
        self._undo_checkpointing = (
            apply_activation_checkpointing(self._unit_modules()) if config.activation_checkpointing else None
        )
        gathered.register(self)
        self.reducer = GradReducer(
            self.groups,
            self.comm,
            config.stage,
            config.reduce_bucket_size,
            config.overlap_comm,
            self.dtypes.grad_dtype,
            {p: n for p, n in self.names.items() if p in managed},
            self.dtypes.grad_accum_dtype,
        )
        # stage >= 1: the optimizer steps this rank's master shards; stage 0: the whole params, or
        # with a separate master (mixed precision) per-parameter views of a whole master
        separate_master = not self.dtypes.master_is_param_view
        self.sharded: ShardedOptimizer | None = None
        if config.stage >= 1 or separate_master:
            if separate_master and master_init:  # rank 0's values everywhere, as for the parameters
                master_init = broadcast_master_init(master_init, [p for p in self.names if p in managed],
                                                    self.dtypes.master_dtype, self.comm)
            store = None
            if self.offload_config.optimizer_device != "none":
                self.offload_config.check_path(self._offloaded_bytes())
                store = OptimizerOffload(self.offload_config, self.comm.rank)
            self.sharded = ShardedOptimizer(optimizer, self.groups, self.dtypes.master_dtype,
                                            whole=config.stage == 0, master_init=master_init, offload=store)
        self._user_zero_grad = optimizer.zero_grad
        optimizer.zero_grad = self._zero_grad_hook  # type: ignore[method-assign]
        self.last_grad_norm: float | None = None  # global gradient norm of the last step that computed one
        # Note [step preparation]: ``prepare_step`` runs once per optimizer step, after the last
        # backward; ``step_skipped`` (an overflow on any rank) makes ``after_step`` leave params alone.
        self._prepared = False
        self.step_skipped = False
        self._norm: torch.Tensor | None = None

    # ------------------------------------------------------------------ setup
    def _check_same_structure(self) -> None:
        signature = repr([(n, tuple(p.shape), str(p.dtype), p.requires_grad) for p, n in self.names.items()])
        signature += repr([len(g["params"]) for g in self.optimizer.param_groups])
        self.comm.raise_unless_same(
            zlib.crc32(signature.encode()),
            "The module's parameter names, shapes, dtypes or requires_grad flags (or the optimizer's groups)",
            "Build the same model on every rank: set the seed before constructing it and do not make "
            "layers depend on the rank.",
        )

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Make parameters and buffers identical on every rank (as DDP does at construction)."""
        if not self.comm.active:
            return
        for g in self.all_groups:
            if g.shard is None:  # stage 3 broadcast its units while sharding them
                self.comm.broadcast(g.flat)
        in_flat = {s.param for g in self.all_groups for s in g.slots}
        for p in self.names:
            if p not in in_flat:
                self.comm.broadcast(p.data)
        for b in self.module.buffers():
            self.comm.broadcast(b)

    def detach(self, keep_optimizer_state: bool = True, gather_params: bool = True) -> None:
        """Undo the binding: hooks removed, parameters own their storage, optimizer restored.

        Args:
            keep_optimizer_state: gather the sharded optimizer state (a collective: every rank
                must call this together) and load it into the restored optimizer, so that it can
                be saved or stepped after fit; else the shard state is dropped (after an error).
            gather_params: stage 3: give the module its whole parameters back. ``False`` leaves
                them released (NaN placeholders of the right shapes, Note [released parameters])
                and drops the optimizer state: for models that do not fit on one rank.
        """
        self.reducer.remove_hooks()
        gathered.unregister(self)
        if self._undo_checkpointing is not None:
            self._undo_checkpointing()
        self.optimizer.zero_grad = self._user_zero_grad  # type: ignore[method-assign]
        if self.runtime is not None and not gather_params:
            self.runtime.remove_hooks()
            self.runtime.release_all()
            if self.sharded is not None:
                self.sharded.restore()
            for p in self.names:
                p.grad = None
            return
        if self.runtime is not None:
            self.runtime.remove_hooks()
            if keep_optimizer_state:  # the parameters come back whole (a collective)
                self.runtime.gather_all()
            else:  # no collective after an error: each rank keeps its shard, the rest is zero
                self._fill_from_shards()
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
    def master_grad_is_view(self) -> bool:
        """Whether the optimizer steps on the reduced gradient buffers themselves (no cast, no offload)."""
        return self.dtypes.master_grad_is_view and self.offload_config.optimizer_device == "none"

    def _offloaded_bytes(self) -> int:
        """This rank's bytes in the swap files: master and state shards (AdamW's two moments; one
        more element per parameter is kept free for other optimizers' state)."""
        size = torch.empty((), dtype=self.dtypes.master_dtype).element_size()
        return sum(g.shard_numel for g in self.groups) * size * 4

    @property
    def separate_master(self) -> bool:
        """Whether the optimizer steps a master copy in another dtype than the parameters."""
        return not self.dtypes.master_is_param_view

    @torch.no_grad()
    def full_master_params(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each trainable parameter's master value, whole (a collective for stage >= 1: every rank
        calls it). Without a separate master these are the parameters themselves."""
        if self.sharded is None or not self.separate_master:
            return {s.param: s.param.detach() for g in self.groups for s in g.slots}
        out = {}
        for g, full in zip(self.groups, self.sharded.full_masters(self.comm)):
            out.update({s.param: v for s, v in zip(g.slots, g.views(full))})
        return out

    def _unit_modules(self) -> list[nn.Module]:
        if self.runtime is not None:
            return [m for mods in self.runtime.unit_modules for m in mods]
        plans = plan_units(self.module, self.names, self.config.unit_classes)
        modules = [m for plan in plans for m in plan.modules]
        if not modules:
            raise ValueError(
                f"activation_checkpointing found no unit in {type(self.module).__name__}: it checkpoints the "
                "children of nn.ModuleLists, or the modules of `unit_classes`. Name the block class in `unit_classes`."
            )
        return modules

    @contextmanager
    def gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
        """See :func:`lightning_zero.gathered_parameters` (every rank must call it together)."""
        wanted = set(params)
        groups = [g for g in self.all_groups if any(s.param in wanted for s in g.slots)]
        in_groups = {s.param for g in groups for s in g.slots}
        loose = [p for p in params if p not in in_groups]  # stages 0-2: frozen parameters, kept whole
        opened = [u for u in self.units if u.state is UnitState.SHARDED and any(g in u.groups for g in groups)]
        if self.runtime is not None:
            for unit in opened:
                self.runtime.gather_one(unit)
            for unit in opened:
                unit.wait()
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for g in groups:
                    self.comm.broadcast(g.flat, modifier_rank)
                    if g.shard is not None:
                        start, end = g.shard_range()
                        g.shard.copy_(g.flat[start:end])
                for p in loose:
                    self.comm.broadcast(p.data, modifier_rank)
                if self.sharded is not None:
                    self.sharded.write_masters_from_params(groups)
        if self.runtime is not None:
            for unit in opened:
                self.runtime.release_one(unit)

    @torch.no_grad()
    def _fill_from_shards(self) -> None:
        for unit in self.units:
            unit.allocate()
            for g in unit.groups:
                g.flat.zero_()
                start, end = g.shard_range()
                g.flat[start:end].copy_(g.shard)

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

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before the accumulation boundary (stages 0-1 skip communication)."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    def before_backward(self) -> None:
        # stage 0 hands the optimizer per-parameter views of the reduced gradients; detach them
        # so the next backward's gradients arrive fresh (grad_reducer adds them to the buffer)
        if self.config.stage < 2:
            for g in self.groups:
                for s in g.slots:
                    s.param.grad = None

    def finish_backward(self) -> None:
        self.reducer.finish()
        if self.runtime is not None:
            self.runtime.end_backward()
        if self.reducer.communicating and self.reducer.whole_grads_valid():
            for g, flat in zip(self.groups, self.reducer.flat_grads):
                if flat is None or flat.dtype != g.dtype:  # accumulated in another dtype: no .grad views
                    continue
                for s, view in zip(g.slots, g.views(flat)):
                    s.param.grad = view
        if self.sharded is not None and self.reducer.communicating and self.master_grad_is_view:
            self.sharded.set_grads(self._reduced_for_masters())

    def _reduced_for_masters(self) -> list[torch.Tensor]:
        """The reduced gradients laid out like the masters (whole buffers at stage 0, else shards)."""
        if self.sharded is not None and self.sharded.whole:
            return [g for g in self.reducer.flat_grads if g is not None]
        return [self.reducer.shard_grad(i) for i in range(len(self.groups))]

    # ------------------------------------------------------------------ step
    def _grads_to_scale(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps on (unscaling and clipping act on these)."""
        if self.sharded is not None and not self.master_grad_is_view:
            return self.sharded.master_grads()
        return self._all_reduced_grads()

    def _grads_for_norm(self) -> list[torch.Tensor]:
        """This rank's share of the gradients; summed over ranks at stage >= 1 they are all of them.
        (An offload's uncast copies hold the same values: the norm is taken as without offload.)"""
        if self.sharded is not None and not self.dtypes.master_grad_is_view:
            return self.sharded.master_grads()
        return self.reducer.local_grads()

    @torch.no_grad()
    def prepare_step(self, loss_scale: float = 1.0, check_overflow: bool = False) -> bool:
        """Get the optimizer's gradients ready, once per step: cast into the master dtype (a
        transient copy with a separate master), divide by ``loss_scale``, measure the global norm
        (:attr:`last_grad_norm`) and, with ``check_overflow``, agree across ranks whether any
        rank's gradients hold inf / nan. Returns whether the step must be skipped (then the
        master gradients are dropped and :meth:`after_step` leaves the parameters alone).
        """
        if self._prepared:
            return self.step_skipped
        if self.sharded is not None and not self.master_grad_is_view:
            self.sharded.set_grads(self._reduced_for_masters())
        self._prepared = True
        if loss_scale != 1.0:
            for t in self._grads_to_scale():
                t.mul_(1.0 / loss_scale)
        sumsq = torch.tensor([local_sum_of_squares(self._grads_for_norm())], dtype=torch.float32,
                             device=self.comm.device)
        if check_overflow and any_rank(non_finite(float(sumsq)), self.comm):
            self.skip_step()
            self.last_grad_norm = math.inf
            return True
        if self.config.stage >= 1:
            self.comm.all_reduce_sum(sumsq)
        self._norm = sumsq.sqrt().reshape(())
        self.last_grad_norm = float(self._norm)
        return False

    def skip_step(self) -> None:
        """Skip this optimizer step on this rank (every rank must agree): no parameter changes."""
        self._prepared = True
        self.step_skipped = True
        if self.sharded is not None:
            self.sharded.clear_grads()

    def _require_prepared(self, what: str) -> None:
        if self.sharded is not None and not self.master_grad_is_view and not self._prepared:
            raise RuntimeError(
                f"{what} needs the master gradients: call `engine.prepare_step(loss_scale)` after the last "
                "backward of the step (the precision plugin does this under ZeroStrategy)."
            )

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all shards (every rank gets the same value)."""
        self._require_prepared("The gradient norm")
        local = [t.float() for t in self._grads_for_norm() if t.numel()]
        if norm_type == math.inf:
            value = torch.stack([t.abs().max() for t in local]).max() if local else torch.zeros(())
            if self.config.stage >= 1:
                self.comm_max(value)
            return value
        parts = torch.stack([torch.linalg.vector_norm(t, norm_type) for t in local]) if local else torch.zeros(1)
        total = parts.pow(norm_type).sum()
        if self.config.stage >= 1 and self.comm.active:
            self.comm.all_reduce_sum(total)
        return total.pow(1.0 / norm_type)

    def comm_max(self, value: torch.Tensor) -> None:
        self.comm.all_reduce_max(value)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the optimizer's gradients so their global norm is at most ``max_norm`` (a no-op on a
        skipped step, whose norm stays ``inf``)."""
        if self.step_skipped:  # every rank agreed on the skip: no collective here on any of them
            return torch.tensor(math.inf)
        cached = self._norm if self._prepared and norm_type == 2.0 else None
        total = cached if cached is not None else self.grad_norm(norm_type)
        self.last_grad_norm = float(total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for t in self._grads_to_scale():
            t.mul_(coef.to(device=t.device, dtype=t.dtype))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        self._require_prepared("Clipping")
        for t in self._grads_to_scale():
            t.clamp_(-clip_value, clip_value)

    def _all_reduced_grads(self) -> list[torch.Tensor]:
        if self.reducer.whole_grads_valid():
            return [g for g in self.reducer.flat_grads if g is not None]
        return self.reducer.local_grads()

    def before_step(self) -> None:
        if self.reducer.state is not BackwardState.IDLE:
            raise RuntimeError(
                "A backward ran that the strategy did not finish, so gradients were not reduced. In manual "
                "optimization call `self.manual_backward(loss)` instead of `loss.backward()`."
            )
        if self.sharded is not None:
            self.sharded.check_unchanged()
        strays = [self.names[p] for p in self.unmanaged if p.grad is not None]
        if strays:
            raise RuntimeError(
                f"Parameters {strays[:5]} received gradients but are in no optimizer param group at setup (or "
                "were frozen then); their gradients would not be averaged across ranks. Put them in the "
                "optimizer in `configure_optimizers`, or freeze them (`requires_grad_(False)`) before fit."
            )

    @torch.no_grad()
    def after_step(self) -> None:
        """Write the stepped master shards into the parameters, gather them on every rank and clear
        the gradients (as DeepSpeed's ``engine.step()`` does: they never outlive their step). After
        a skipped step only the gradients are cleared."""
        if not self.step_skipped:
            self._require_prepared("The optimizer step")
        if self.sharded is not None and not self.step_skipped:
            self.sharded.write_back()
            if self.runtime is not None:  # stage 3: only the persistent unit is kept whole
                handles = [h for u in self.units if u.persistent for h in u.refresh_persistent(self.comm)]
            elif not self.sharded.whole:
                handles = [self.comm.all_gather_flat(g.flat, *g.shard_range(), async_op=True) for g in self.groups]
            else:
                handles = []
            for h in handles:
                h.wait()
        self.zero_grad()

    def _zero_grad_hook(self, set_to_none: bool = True) -> None:
        self.zero_grad()
        self._user_zero_grad(set_to_none=set_to_none)

    def zero_grad(self) -> None:
        """Clear gradients: the reduced buffers, the per-parameter views and the shards' grads."""
        self.reducer.zero()
        for p in self.names:
            p.grad = None
        if self.sharded is not None:
            self.sharded.clear_grads()
        self._prepared = False
        self.step_skipped = False
        self._norm = None

    # ------------------------------------------------------------------ accounting
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of params / grads / optimizer / buffers, counted from live tensors."""
        counter = StorageCounter()
        if self.runtime is not None:
            # gathered units are working memory; the persistent model state is the shards
            counter.add("buffers", [g.flat for u in self.units if not u.persistent for g in u.groups])
            counter.add("params", [g.own_shard() for g in self.all_groups])
            counter.add("params", [g.flat for u in self.units if u.persistent for g in u.groups])
        else:
            counter.add("params", list(self.names))
        counter.add("grads", [p.grad for p in self.names])
        counter.add("grads", [t for t in (*self.reducer.flat_grads, *self.reducer.grad_shards)])
        if self.sharded is not None:
            counter.add("grads", self.sharded.master_grads())
            counter.add("optimizer", self.sharded.masters)
        for state in self.optimizer.state.values():
            counter.add("optimizer", [v for v in state.values() if isinstance(v, torch.Tensor)])
        counter.add("buffers", list(self.reducer.live_buffers()))
        return counter.result()


def _module_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
