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
nothing (units are gathered just in time, see ``core/stage3/runtime.py``).
Mixed precision adds a master copy in ``dtypes.master_dtype`` (whole at stage 0, else a shard)
that the optimizer steps and that is cast back into the 16-bit parameters (Note [master shards]).

Note [construction order]
    The engine builds each of its parts once, in one order, each from what the steps before it handed down, and
    nothing built later calls back into an earlier step's module:
    1. the checks (``engine_setup.py``): the settings' rules, this rank's dtypes and optimizer, then the same
       model and settings on every rank, before the first collective that a mismatch could hang;
    2. the partition (``core/stage3/sharding.py``): the units planned once (stage 3 shards them, activation
       checkpointing wraps them), the flat groups bound, rank 0's values broadcast;
    3. the gradient reduction over those groups (``partitioned_reducer.py``; buckets in ``exchange.py``);
    4. the optimizer over this rank's masters, in the store that keeps them (``optimizer_state.py``);
    5. the step's preparation (``engine_step.py``) and the whole-model views (``engine_views.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Set
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.common.memory import ModelStateBytes
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.rules import check_settings
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3 import gathered
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit
from lightning_zero.core.stage3.sharding import partition_module
from lightning_zero.core.zero.engine_setup import SelfReducingOptimizer, StageCoupling, check_construction, open_store
from lightning_zero.core.zero.engine_step import GradReduction, NormExcess, StepPreparation
from lightning_zero.core.zero.engine_views import WholeModelViews
from lightning_zero.core.zero.grad_reducer import BackwardState, ReductionMode
from lightning_zero.core.zero.optimizer import ShardedOptimizer
from lightning_zero.core.zero.optimizer_state import sharded_optimizer
from lightning_zero.core.zero.partitioned_reducer import make_reducer


class ZeroEngine:
    """Partitions ``module``'s training state over the data-parallel ranks of ``comm``.

    It composes two objects it builds: ``preparation`` (:class:`StepPreparation`: the step's gradients and
    state) and ``views`` (:class:`WholeModelViews`: whole views of the sharded model, ``detach``); its
    methods of the same names delegate to them.

    Args:
        module: the model; its parameters become views into flat buffers.
        optimizer: a ``torch.optim`` optimizer over (a subset of) ``module``'s parameters;
            ``None`` for evaluation only (stage 3: parameters sharded and gathered per unit in
            forward, nothing trained).
        config: the ZeRO policy (stage 0-3).
        comm: the data-parallel collectives, made by the caller once, with ``config``'s collective: the strategy's
            mesh's (``parallel/mesh.py``), or ``DataParallelComm()`` (``from lightning_zero import
            DataParallelComm``) for the default process group (one rank without one).
        dtypes: parameter / gradient / master dtypes (default: the module's dtype, fp32 master).
        master_init: initial master values per parameter when the master is a separate copy (the
            weights before the module was cast to 16 bits, so the master starts exact).
        param_init_fn: stage 3, parameters built on the meta device: ``fn(module, name)``
            initialises a module's own parameters (default ``reset_parameters``).
        init_seed: base seed of that initialisation (Note [sharded construction] in materialize.py).
        setup_settings: settings that must agree across ranks (the resolved config), compared with the
            parameter names / shapes / dtypes before the first collective (``core/comm/agreement.py``).
        offload: where the optimizer shards live (docs/offload.md); default: with the parameters.
        coupling: a pipeline stage's engine: how its step combines with the other stages' (default: none).
        experts: expert parameters (expert parallelism): their flat groups are reduced and partitioned over
            ``comm.expert_data``, the rest over ``comm`` (Note [expert axes] in core/mesh/dims.py, Note
            [partitioned reduction] in core/zero/partitioned_reducer.py).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        config: ZeroConfig,
        comm: DataParallelComm,
        dtypes: DtypePolicy | None = None,
        master_init: Mapping[nn.Parameter, torch.Tensor] | None = None,
        param_init_fn: ParamInitFn | None = None,
        init_seed: int = 0,
        setup_settings: Mapping[str, str] | None = None,
        offload: OffloadConfig | None = None,
        coupling: StageCoupling | None = None,
        experts: Set[nn.Parameter] = frozenset(),
    ) -> None:
        self.module, self.optimizer, self.config = module, optimizer, config
        self.offload_config = offload or OffloadConfig()
        self.experts: frozenset[nn.Parameter] = frozenset(experts)
        # Note [construction order]: each part once, from what the steps before it handed down
        # 1. the checks: the settings' rules; then this rank's dtypes and optimizer, then every rank's structure
        check_settings(Settings(zero=config, offload=self.offload_config))  # Note [one rule, many spellings]
        self.comm = comm
        checked = check_construction(module, optimizer, config, self.comm, dtypes, self.experts, setup_settings or {})
        self.dtypes, self.names = checked.dtypes, checked.names  # names: every parameter, module order
        self._self_reducing: SelfReducingOptimizer | None = checked.self_reducing
        managed = {p for g in checked.optimizer_groups for p in g}
        # trainable parameters no optimizer group holds: they are never updated nor reduced
        self.unmanaged: list[nn.Parameter] = [p for p in self.names if p.requires_grad and p not in managed]
        self.frozen_at_setup: list[nn.Parameter] = [p for p in self.names if not p.requires_grad]
        # 2. the partition: stage 3's units (sharded one at a time) and the runtime's gather / release hooks, else
        #    whole flat groups; rank 0's values everywhere; activation checkpointing of the units. Where the
        #    optimizer's shards live is chosen first, once: stage 3's parameter shards go there unit by unit
        store = open_store(optimizer, config, self.dtypes, self.offload_config, self.comm, checked.optimizer_groups)
        part = partition_module(module, self.names, checked.optimizer_groups, self.comm, config, param_init_fn,
                                init_seed, self.experts, store.adopt_unit if store is not None else None)
        self.units: list[ShardedUnit] = part.units
        self.runtime: Stage3Runtime | None = part.runtime
        self.all_groups: list[FlatParamGroup] = part.all_groups  # stage 3 also has groups of frozen parameters
        self.groups: list[FlatParamGroup] = [g for g in self.all_groups if g.optimizer_group >= 0]  # trainable
        # 3. the gradient reduction over the trainable groups (its buckets planned in exchange.py), writing through
        #    the store's gradient home where the reduced shards live on disk
        grad_home = store.grad_home(config.stage.shards_parameters, self.dtypes.grad_accum_dtype) if store else None
        self.reducer = make_reducer(self.groups, self.comm, config.stage, config.reduce_bucket_size,
                                    config.overlap_comm, self.dtypes.grad_dtype,
                                    {p: n for p, n in self.names.items() if p in managed}, self.dtypes.grad_accum_dtype,
                                    grad_home)
        # 4. stage >= 1: the optimizer steps this rank's master shards (in the offload's store); stage 0: the whole
        #    params (None), or with a separate master (mixed precision) per-parameter views of a whole master
        self.sharded: ShardedOptimizer | None = sharded_optimizer(
            optimizer, config, self.dtypes, self.comm, self.groups, [p for p in self.names if p in managed],
            master_init, store, self.experts)
        if optimizer is None:
            self.offload_config.warn_unused()
        # 5. the step (Note [step preparation]: ``prepare_step`` runs once per optimizer step, after the last
        #    backward; ``step_skipped``, an overflow on any rank, makes ``after_step`` leave params alone) and the
        #    whole-model views, over all of the above
        coupling = coupling or StageCoupling()
        self.preparation = StepPreparation(config, self.comm, self.dtypes, self.names, self.groups, self.reducer,
                                           self.sharded, coupling.model_parallel, coupling.norm_excess)
        self._user_zero_grad: Callable[..., None] | None = optimizer.zero_grad if optimizer is not None else None
        self.views = WholeModelViews(module, optimizer, self.comm, self.dtypes, self.names, self.groups,
                                     self.all_groups, self.units, self.runtime, self.reducer, self.sharded,
                                     part.undo_checkpointing, self._user_zero_grad)
        gathered.register(self)
        if optimizer is not None:
            optimizer.zero_grad = self._zero_grad_hook  # type: ignore[method-assign]

    @property
    def master_grad_is_view(self) -> bool:
        """Whether the optimizer steps on the reduced gradient buffers themselves: no cast, and its store keeps the
        shards with the parameters (the store is asked: Note [one storage interface])."""
        return self.preparation.master_grad_is_view

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before the accumulation boundary (stages 0-1 skip communication)."""
        previous = self.reducer.boundary_mode
        self.reducer.set_boundary_mode(ReductionMode.AT_BOUNDARY)
        try:
            yield
        finally:
            self.reducer.set_boundary_mode(previous)

    def before_backward(self) -> None:
        self.preparation.begin_backward()
        if (self._self_reducing is not None and self.reducer.sync and not self.config.stage.shards_optimizer
                and self._self_reducing.reduces_gradients_itself()):
            self.preparation.grad_reduction = GradReduction.BY_OPTIMIZER
            self.reducer.set_boundary_mode(ReductionMode.AT_BOUNDARY)  # accumulates locally, like no_sync
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
        self.reducer.defer()
        if self.runtime is not None:
            self.runtime.hold_all()
        try:
            yield
        finally:
            if self.runtime is not None:
                self.runtime.stop_holding()

    def reduce_deferred(self) -> None:
        """End of a deferred window: reduce the accumulated gradients (as one backward would)."""
        self.reducer.reduce_deferred()
        self.finish_backward()

    def finish_backward(self) -> None:
        self.reducer.finish()
        if self.preparation.grad_reduction is GradReduction.BY_OPTIMIZER:
            self.reducer.set_boundary_mode(ReductionMode.IMMEDIATE)  # complete: handed on as reduced ones
        self.preparation.end_backward(boundary=self.reducer.sync)
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
            self.sharded.set_grads(self.preparation.reduced_for_masters())

    # ------------------------------------------------------------------ step

    def before_step(self) -> None:
        if self.reducer.state is not BackwardState.IDLE:
            raise RuntimeError(
                "A backward ran that the strategy did not finish, so gradients were not reduced. In manual "
                "optimization call `self.manual_backward(loss)` instead of `loss.backward()`."
            )
        if self.sharded is not None:
            self.sharded.check_unchanged()
        if self.runtime is not None:  # units a forward kept with no backward after it (Note [kept tail]) are
            self.runtime.release_all()  # released: gathered through the step, they would keep the old weights
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
            self.preparation.check_can_step("The optimizer step")
        if self.sharded is not None and not self.step_skipped:
            self.sharded.write_back()
            if self.runtime is not None:  # stage 3: only the persistent unit is kept whole
                handles = [h for u in self.units if u.persistent for h in u.refresh_persistent(self.comm)]
            elif not self.sharded.whole:
                handles = [self.comm.of(g.experts).all_gather_flat(g.flat, *g.shard_range(), async_op=True)
                           for g in self.groups]
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
        self.preparation.reset()

    # ------------------------------------------------------------------ the step's gradients (engine_step.py)
    @property
    def step_skipped(self) -> bool:
        """Whether this optimizer step is skipped (an overflow or a non-finite gradient on any rank)."""
        return self.preparation.step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step that computed one."""
        return self.preparation.last_grad_norm

    @property
    def model_parallel(self) -> DataParallelComm | None:
        """Pipelines: the ranks of the other stages, over which norms and the overflow decision are combined."""
        return self.preparation.model_parallel


    @property
    def norm_excess(self) -> NormExcess | None:
        """Pipelines: ``fn(grads, groups, norm_type)``, the norm share of tied parameters another stage counts."""
        return self.preparation.norm_excess


    def prepare_step(self, loss_scale: float = 1.0, check_overflow: bool = False) -> bool:
        """See :meth:`StepPreparation.prepare_step`: returns whether the step must be skipped."""
        return self.preparation.prepare_step(loss_scale, check_overflow)

    def first_nonfinite_gradient(self) -> str | None:
        """See :meth:`StepPreparation.first_nonfinite_gradient` (a collective)."""
        return self.preparation.first_nonfinite_gradient()

    def skip_step(self) -> None:
        """Skip this optimizer step on this rank (every rank must agree): no parameter changes."""
        self.preparation.skip_step()

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all shards (every rank gets the same value)."""
        return self.preparation.grad_norm(norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """See :meth:`StepPreparation.clip_grad_norm_`."""
        return self.preparation.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        self.preparation.clip_grad_value_(clip_value)

    def comm_max(self, value: torch.Tensor) -> None:
        self.preparation.comm_max(value)

    # ------------------------------------------------------------------ whole views (engine_views.py)
    def detach(self, keep_optimizer_state: bool = True, gather_params: bool = True) -> None:
        """See :meth:`WholeModelViews.detach` (a collective unless ``gather_params`` and the state are off)."""
        gathered.unregister(self)
        self.views.detach(keep_optimizer_state, gather_params)

    @property
    def separate_master(self) -> bool:
        """Whether the optimizer steps a master copy in another dtype than the parameters."""
        return self.views.separate_master

    def full_master_params(self) -> dict[nn.Parameter, torch.Tensor]:
        """See :meth:`WholeModelViews.full_master_params` (a collective for stage >= 1)."""
        return self.views.full_master_params()

    def gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> AbstractContextManager[None]:
        """See :func:`lightning_zero.gathered_parameters` (every rank must call it together)."""
        return self.views.gathered(params, modifier_rank)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with whole tensors (stage 3 gathers; a collective)."""
        return self.views.full_state_dict()

    def end_forward_only(self) -> None:
        """After an evaluation step under stage 3: free the units it gathered."""
        self.views.end_forward_only()

    # ------------------------------------------------------------------ accounting
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of params / grads / optimizer / comm_buffers, counted from live tensors."""
        return self.views.model_state_bytes()
