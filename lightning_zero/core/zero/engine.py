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

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.offload.config import OffloadConfig
from lightning_zero.core.offload.store import OptimizerOffload, swap_bytes
from lightning_zero.core.reliability.agreement import check_same_everywhere
from lightning_zero.core.stage3 import gathered
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.stage3.runtime import Stage3Runtime, apply_stage3
from lightning_zero.core.stage3.sharded_unit import ShardedUnit
from lightning_zero.core.zero.config import DtypePolicy, ZeroConfig, ZeroStage
from lightning_zero.core.zero.engine_step import StepPreparation
from lightning_zero.core.zero.engine_views import WholeModelViews
from lightning_zero.core.zero.flat_param import FlatParamGroup
from lightning_zero.core.zero.grad_reducer import BackwardState, GradReducer
from lightning_zero.core.zero.memory import ModelStateBytes, StorageCounter
from lightning_zero.core.zero.optimizer import ShardedOptimizer, check_optimizer, trainable_groups
from lightning_zero.core.zero.optimizer_state import broadcast_master_init


class ZeroEngine(WholeModelViews, StepPreparation):
    """Partitions ``module``'s training state over the data-parallel ranks of ``comm``.

    Args:
        module: the model; its parameters become views into flat buffers.
        optimizer: a ``torch.optim`` optimizer over (a subset of) ``module``'s parameters;
            ``None`` for evaluation only (stage 3: parameters sharded and gathered per unit in
            forward, nothing trained).
        config: the ZeRO policy (stage 0-3).
        comm: the data-parallel collectives (world size 1 without a process group).
        dtypes: parameter / gradient / master dtypes (default: the module's dtype, fp32 master).
        master_init: initial master values per parameter when the master is a separate copy (the
            weights before the module was cast to 16 bits, so the master starts exact).
        param_init_fn: stage 3, parameters built on the meta device: ``fn(module, name)``
            initialises a module's own parameters (default ``reset_parameters``).
        init_seed: base seed of that initialisation (Note [sharded construction] in materialize.py).
        setup_settings: settings that must agree across ranks (the resolved config), compared with the
            parameter names / shapes / dtypes before the first collective (``core/reliability/agreement.py``).
        offload: where the optimizer shards live (docs/offload.md); default: with the parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        config: ZeroConfig,
        comm: DataParallelComm | None = None,
        dtypes: DtypePolicy | None = None,
        master_init: Mapping[nn.Parameter, torch.Tensor] | None = None,
        param_init_fn: ParamInitFn | None = None,
        init_seed: int = 0,
        setup_settings: Mapping[str, str] | None = None,
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
        # an optimizer that averages over the ranks itself once it compresses (1-bit Adam): stage 0 only
        self._self_reducing: SelfReducingOptimizer | None = _self_reducing(optimizer, config.stage, self.comm)
        self._grads_local = False  # this step's gradients were left unreduced for that optimizer
        if optimizer is not None:
            check_optimizer(optimizer, config.stage, config.elementwise_optimizers)
        self.names: dict[nn.Parameter, str] = {}  # every module parameter -> qualified name, module order
        for name, p in module.named_parameters():
            self.names.setdefault(p, name)
        self._check_same_structure(setup_settings or {})
        groups = trainable_groups(optimizer, self.names) if optimizer is not None else []
        managed = {p for g in groups for p in g}
        # trainable parameters no optimizer group holds: they are never updated nor reduced
        self.unmanaged: list[nn.Parameter] = [p for p in self.names if p.requires_grad and p not in managed]
        self.frozen_at_setup: list[nn.Parameter] = [p for p in self.names if not p.requires_grad]
        self.units: list[ShardedUnit] = []  # stage 3 only
        self.runtime: Stage3Runtime | None = None  # stage 3's gather / release hooks
        if config.stage.shards_parameters:
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
        if optimizer is not None and (config.stage.shards_optimizer or separate_master):
            if separate_master and master_init:  # rank 0's values everywhere, as for the parameters
                master_init = broadcast_master_init(master_init, [p for p in self.names if p in managed],
                                                    self.dtypes.master_dtype, self.comm)
            store = None
            if self.offload_config.optimizer_device != "none":
                need = swap_bytes(self.offload_config, self.groups, self.units, self.dtypes.master_dtype)
                self.offload_config.check_path(need)
                store = OptimizerOffload(self.offload_config, self.comm.rank, self.units)
            self.sharded = ShardedOptimizer(optimizer, self.groups, self.dtypes.master_dtype,
                                            whole=not config.stage.shards_optimizer, master_init=master_init,
                                            offload=store)
        if optimizer is None:
            self.offload_config.warn_unused()
        if optimizer is not None:
            self._user_zero_grad = optimizer.zero_grad
            optimizer.zero_grad = self._zero_grad_hook  # type: ignore[method-assign]
        self.last_grad_norm: float | None = None  # global gradient norm of the last step that computed one
        # Note [step preparation]: ``prepare_step`` runs once per optimizer step, after the last
        # backward; ``step_skipped`` (an overflow on any rank) makes ``after_step`` leave params alone.
        self._prepared = False
        self.step_skipped = False
        self._norm: torch.Tensor | None = None
        # Pipelines (Note [deferred reduction]): the ranks holding the other pipeline stages, over which
        # gradient norms and the overflow decision are combined, and the norm share to leave out
        # (``fn(grads, groups, norm_type)``: tied parameters another stage counts).
        self.model_parallel: DataParallelComm | None = None
        self.norm_excess: Callable[[list[torch.Tensor], list[FlatParamGroup], float], float] | None = None
        # stage 0 without a separate master, gradients accumulated in another dtype than the params:
        # prepare_step casts them into these param-dtype buffers, which the params' .grad views
        self._cast_grads: list[torch.Tensor] | None = None

    @property
    def master_grad_is_view(self) -> bool:
        """Whether the optimizer steps on the reduced gradient buffers themselves (no cast, no offload)."""
        return self.dtypes.master_grad_is_view and self.offload_config.optimizer_device == "none"

    # ------------------------------------------------------------------ setup
    def _check_same_structure(self, settings: Mapping[str, str]) -> None:
        entries = [(f"parameter {n!r}", f"shape={tuple(p.shape)} dtype={p.dtype} requires_grad={p.requires_grad}")
                   for p, n in self.names.items()]
        if self.optimizer is not None:
            entries.append(("optimizer param groups (parameters per group)",
                            repr([len(g["params"]) for g in self.optimizer.param_groups])))
        entries += [(f"setting {k}", str(v)) for k, v in settings.items()]
        check_same_everywhere(
            entries, self.comm,
            "Build the same model with the same configuration on every rank: set the seed before constructing "
            "it, do not make layers or settings depend on the rank, and give every node the same config.",
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
        if (self._self_reducing is not None and self.reducer.sync and not self.config.stage.shards_optimizer
                and self._self_reducing.reduces_gradients_itself()):
            self._grads_local = True
            self.reducer.sync = False  # the boundary backward accumulates locally, like no_sync
        # stage 0 hands the optimizer per-parameter views of the reduced gradients; detach them
        # so the next backward's gradients arrive fresh (grad_reducer adds them to the buffer)
        if not self.config.stage.shards_gradients:
            for g in self.groups:
                for s in g.slots:
                    s.param.grad = None

    @contextmanager
    def deferred_reduction(self) -> Iterator[None]:
        """Note [deferred reduction]
            A pipeline schedule runs the backward of every micro-batch of a step, interleaved with
            forwards, inside one call. In this window nothing is reduced: at stages 0-1 the hooks add
            each gradient into the whole flat buffer (as under ``no_sync``); at stages 2-3 they leave
            it in ``param.grad``, where autograd accumulates the micro-batches (the whole gradient of
            this rank's stage: the memory a pipeline costs there, docs/pipeline.md), and stage 3
            gathers every unit once and keeps it until the window ends, instead of once per
            micro-batch. :meth:`reduce_deferred` then reduces once over the data-parallel group
            (Lightning's ``zero_grad``, which runs between the step and its backward, leaves the
            window's ``.grad`` alone).
        """
        self.before_backward()
        self.reducer.deferred = True
        if self.runtime is not None:
            self.runtime.hold_all()
        try:
            yield
        finally:
            if self.runtime is not None:
                self.runtime.holding = False

    def reduce_deferred(self) -> None:
        """End of a deferred window: reduce the accumulated gradients (as one backward would)."""
        self.reducer.reduce_deferred()
        self.finish_backward()

    def finish_backward(self) -> None:
        self.reducer.finish()
        if self._grads_local:
            self.reducer.sync = True  # the local gradients are complete: hand them on as reduced ones
        if self.runtime is not None:
            self.runtime.end_backward()
        if self.reducer.communicating and self.reducer.whole_grads_valid():
            for g, flat in zip(self.groups, self.reducer.flat_grads):
                if flat is None or flat.dtype != g.dtype:  # accumulated in another dtype: no .grad views
                    continue
                for s, view in zip(g.slots, g.views(flat)):
                    s.param.grad = view
        self.link_master_grads()

    def link_master_grads(self) -> None:
        """Point the masters' gradients at the reduced buffers (after a backward, or a kept ``zero_grad``)."""
        if self.sharded is not None and self.reducer.communicating and self.master_grad_is_view:
            self.sharded.set_grads(self._reduced_for_masters())

    def _reduced_for_masters(self) -> list[torch.Tensor]:
        """The reduced gradients laid out like the masters (whole buffers at stage 0, else shards)."""
        if self.sharded is not None and self.sharded.whole:
            return [g for g in self.reducer.flat_grads if g is not None]
        return [self.reducer.shard_grad(i) for i in range(len(self.groups))]

    # ------------------------------------------------------------------ step

    def before_step(self) -> None:
        if self.reducer.state is not BackwardState.IDLE:
            raise RuntimeError(
                "A backward ran that the strategy did not finish, so gradients were not reduced. In manual "
                "optimization call `self.manual_backward(loss)` instead of `loss.backward()`."
            )
        if self.sharded is not None:
            self.sharded.check_unchanged()
        unfrozen = [self.names[p] for p in self.frozen_at_setup if p.requires_grad]
        if unfrozen:
            raise RuntimeError(
                f"Parameters {unfrozen[:5]} were frozen (requires_grad=False) when ZeRO partitioned the model at "
                "setup and have been unfrozen since; their gradients would not be reduced across ranks (stage 0: "
                "the ranks would diverge; stage >= 1: the updates would be dropped). Set requires_grad before "
                "`trainer.fit` (e.g. in `configure_model`), or train each phase as its own fit: save a checkpoint, "
                "change requires_grad, and fit again from it."
            )
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
        if not self.reducer.deferred:
            self._user_zero_grad(set_to_none=set_to_none)

    def zero_grad(self) -> None:
        """Clear gradients: the reduced buffers, the per-parameter views and the shards' grads."""
        if not self.reducer.deferred:  # a deferred window's gradients await reduce_deferred()
            self.reducer.zero()
            for p in self.names:
                p.grad = None
        if self.sharded is not None:
            self.sharded.clear_grads()
        self._prepared = False
        self.step_skipped = False
        self._norm = None
        self._grads_local = False
        self._cast_grads = None

    # ------------------------------------------------------------------ accounting
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of params / grads / optimizer / comm_buffers, counted from live tensors."""
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
        return counter.result()


class SelfReducingOptimizer(Protocol):
    """An optimizer that averages over the ranks itself once :meth:`reduces_gradients_itself` says so
    (:class:`~lightning_zero.core.comm.onebit_adam.OneBitAdam`); until then the engine reduces as usual."""

    def bind_comm(self, comm: DataParallelComm) -> None: ...

    def reduces_gradients_itself(self) -> bool: ...


def _self_reducing(optimizer: Optimizer, stage: ZeroStage, comm: DataParallelComm) -> SelfReducingOptimizer | None:
    if not (hasattr(optimizer, "reduces_gradients_itself") and hasattr(optimizer, "bind_comm")):
        return None
    if stage.shards_optimizer:
        raise ValueError(
            f"{type(optimizer).__name__} compresses the all-reduce of every rank's whole momentum, which needs "
            f"whole local gradients and optimizer state on each rank: use it with ZeRO stage 0, not {stage} "
            "(stages 1-3 partition that state; a compressed stage 1 is not built)."
        )
    optimizer.bind_comm(comm)  # type: ignore[attr-defined]
    return optimizer  # type: ignore[return-value]


def _module_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
