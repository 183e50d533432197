"""The optimizer step's gradient preparation, an object :class:`~lightning_zero.core.zero.engine.ZeroEngine` holds.

Once per optimizer step, after the last backward: the gradients the optimizer steps on are cast
into the master dtype, unscaled, measured (one global norm over every shard and pipeline stage),
checked for overflow with one agreement across ranks, and clipped by norm or value. The state of
the step (prepared, skipped, the norm) lives here (Note [step preparation] in engine.py).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup, overlap
from lightning_zero.core.offload.shard_store import StreamedGrads
from lightning_zero.core.precision.loss_scaler import any_rank, local_sum_of_squares, non_finite
from lightning_zero.core.precision.nonfinite import agree_over_model_parallel, first_nonfinite_parameter
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.grad_reducer import GradReducer
from lightning_zero.core.zero.optimizer import ShardedOptimizer

NormExcess = Callable[[list[torch.Tensor], list[FlatParamGroup], float], float]


def weighted_norm_excess(weight: Callable[[nn.Parameter], float]) -> NormExcess:
    """A ``norm_excess`` leaving out ``weight(param)`` of each parameter's ``|g|^p`` terms on this rank.

    Note [counting a parameter once]
        The global norm sums every rank's terms over the data group, then over the model-parallel ranks
        (pipeline stages, tensor-parallel ranks). A parameter held by ``k`` of those ranks with the same
        gradient (a weight tied across stages, a parameter replicated over a tensor-parallel group) is then
        counted ``k`` times; each holder subtracting ``weight`` of its terms before the sums makes it count
        once (a tie: 1 on every stage but its owner; a replicated parameter: ``1 - 1/tp`` everywhere). The
        maximum norm needs no correction. Zero weights cost nothing: the pipeline's and tensor parallel's
        weights compose as their maximum (``parallel/zero.py``).
    """

    def excess(grads: list[torch.Tensor], groups: list[FlatParamGroup], norm_type: float) -> float:
        if math.isinf(norm_type):
            return 0.0
        total = 0.0
        for g, t in zip(groups, grads):
            start, end = (0, g.padded_numel) if t.numel() == g.padded_numel else g.shard_range()
            for s in g.slots:
                share = weight(s.param)
                lo, hi = overlap(s.offset, s.offset + s.numel, start, end)
                if share and hi > lo:
                    total += share * float(t[lo - start : hi - start].float().abs().pow(norm_type).sum())
        return total

    return excess


class StepState(enum.Enum):
    """Where one optimizer step of the engine stands (Note [step states])."""

    IDLE = "idle"
    """No gradient of this step yet: after ``zero_grad`` / ``after_step``."""
    BACKWARD = "backward"
    """A backward announced by ``before_backward`` runs: gradients arrive in the reducer's hooks."""
    ACCUMULATED = "accumulated"
    """Backwards finished that were not the step's last (``no_sync``): stages 0-1 hold local sums, stages 2-3
    shards of part of the micro-steps. Stepping now would use partial gradients."""
    REDUCED = "reduced"
    """The step's last backward finished: the gradients are reduced (a self-reducing optimizer's are complete
    locally). The optimizer may step when it steps on the reduced buffers themselves (``master_grad_is_view``)."""
    PREPARED = "prepared"
    """``prepare_step`` ran: gradients cast, unscaled and measured; the optimizer may step."""
    SKIPPED = "skipped"
    """The step is skipped on every rank (overflow, non-finite gradient, no backward): the parameters stay. Later
    backwards of the step change nothing; ``zero_grad`` ends it."""


# Note [step states]
#     The one table of the transitions a step may take; ``StepPreparation.move`` checks every change against it
#     and raises ``StepStateError`` naming both states. ``zero_grad`` (-> IDLE) and ``skip_step`` (-> SKIPPED) are
#     allowed from anywhere but PREPARED -> BACKWARD and the like: a backward after the gradients were unscaled
#     and measured, or a step prepared from partial (ACCUMULATED) or unfinished (BACKWARD) gradients.
_S = StepState
ALLOWED_TRANSITIONS: dict[StepState, frozenset[StepState]] = {
    _S.IDLE: frozenset({_S.IDLE, _S.BACKWARD, _S.ACCUMULATED, _S.REDUCED, _S.PREPARED, _S.SKIPPED}),
    _S.BACKWARD: frozenset({_S.IDLE, _S.BACKWARD, _S.ACCUMULATED, _S.REDUCED, _S.SKIPPED}),
    _S.ACCUMULATED: frozenset({_S.IDLE, _S.BACKWARD, _S.ACCUMULATED, _S.REDUCED, _S.SKIPPED}),
    _S.REDUCED: frozenset({_S.IDLE, _S.BACKWARD, _S.ACCUMULATED, _S.REDUCED, _S.PREPARED, _S.SKIPPED}),
    _S.PREPARED: frozenset({_S.IDLE, _S.SKIPPED}),
    _S.SKIPPED: frozenset({_S.IDLE, _S.SKIPPED}),
}


class GradReduction(enum.Enum):
    """Who averages this step's gradients over the data-parallel group."""

    BY_ENGINE = "by_engine"
    """The engine's reducer (the default): every rank steps on the averaged gradient or its shard of it."""
    BY_OPTIMIZER = "by_optimizer"
    """Left local on each rank for an optimizer that reduces them itself (1-bit Adam after its warm-up):
    the gradient norm is then that of the local gradients (Note [norm of local gradients])."""


class StepStateError(RuntimeError):
    """A step took a transition the table of Note [step states] does not allow."""


class StepPreparation:
    """Prepare, measure and clip one optimizer step's gradients; the step's state.

    Args:
        config: the ZeRO policy (its stage).
        comm: the data-parallel collectives.
        dtypes: parameter / gradient / master dtypes.
        names: every module parameter -> qualified name, module order.
        groups: the flat groups of trainable parameters.
        reducer: the gradient buffers the backward filled.
        sharded: the optimizer re-pointed at master shards (``None``: it steps the parameters).
        model_parallel: the ranks holding the rest of the model (other pipeline stages, other TP ranks), over
            which norms, the overflow decision and the non-finite check are combined (Note [deferred reduction]
            in engine.py).
        norm_excess: pipelines: ``fn(grads, groups, norm_type)``, the norm share another stage counts (tied
            parameters).
    """

    def __init__(
        self,
        config: ZeroConfig,
        comm: DataParallelComm,
        dtypes: DtypePolicy,
        names: dict[nn.Parameter, str],
        groups: list[FlatParamGroup],
        reducer: GradReducer,
        sharded: ShardedOptimizer | None,
        model_parallel: DataParallelComm | None = None,
        norm_excess: NormExcess | None = None,
    ) -> None:
        self.config = config
        self.shares = norm_shares(groups, comm, config)
        self.comm = comm
        self.dtypes = dtypes
        self.names = names
        self.groups = groups
        self.reducer = reducer
        self.sharded = sharded
        # the optimizer steps on the reduced buffers themselves: no cast, and its store keeps the shards with the
        # parameters (the store is asked: Note [one storage interface])
        self.master_grad_is_view = dtypes.master_grad_is_view and (sharded is None or not sharded.store.offloaded)
        self.model_parallel = model_parallel
        self.norm_excess = norm_excess
        self.last_grad_norm: float | None = None  # global gradient norm of the last step that computed one
        self.state = StepState.IDLE
        self._norm: torch.Tensor | None = None
        self.grad_reduction = GradReduction.BY_ENGINE  # who averages this step's gradients
        # stage 0 without a separate master, gradients accumulated in another dtype than the params:
        # prepare_step casts them into these param-dtype buffers, which the params' .grad views
        self._cast_grads: list[torch.Tensor] | None = None

    def reset(self) -> None:
        """A new step: nothing prepared, nothing skipped (``zero_grad``)."""
        self.move(StepState.IDLE)
        self._norm = None
        self.grad_reduction = GradReduction.BY_ENGINE
        self._cast_grads = None

    def move(self, new: StepState) -> None:
        """Go to ``new``, or raise :class:`StepStateError` naming both states (Note [step states])."""
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise StepStateError(
                f"ZeRO step: {self.state.name} -> {new.name} is not a valid transition. {_WHY.get(new, '')}".rstrip()
            )
        self.state = new

    def begin_backward(self) -> None:
        """``before_backward``: a backward starts (a skipped step stays skipped)."""
        if self.state is not StepState.SKIPPED:
            self.move(StepState.BACKWARD)

    def end_backward(self, boundary: bool) -> None:
        """``finish_backward``: the step's last backward (``boundary``), or one of its micro-steps."""
        if self.state is not StepState.SKIPPED:
            self.move(StepState.REDUCED if boundary else StepState.ACCUMULATED)

    @property
    def step_skipped(self) -> bool:
        return self.state is StepState.SKIPPED

    @property
    def _prepared(self) -> bool:
        return self.state in (StepState.PREPARED, StepState.SKIPPED)

    def check_can_step(self, what: str) -> None:
        """Refuse an optimizer step on gradients that are partial or unfinished (and, without
        ``master_grad_is_view``, not prepared)."""
        if self.state in (StepState.BACKWARD, StepState.ACCUMULATED):
            raise StepStateError(f"{what} in step state {self.state.name}: {_WHY[StepState.PREPARED]}")
        self.require_prepared(what)

    def reduced_for_masters(self) -> list[torch.Tensor]:
        """The reduced gradients laid out like the masters (whole buffers at stage 0, else shards)."""
        if self.sharded is not None and self.sharded.whole:
            return [g for g in self.reducer.flat_grads if g is not None]
        return [self.reducer.shard_grad(i) for i in range(len(self.groups))]

    def _grads_to_scale(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps on (unscaling and clipping act on these)."""
        if self._cast_grads is not None:
            return self._cast_grads
        if self.sharded is not None and not self.master_grad_is_view:
            return self.sharded.master_grads()
        return self._all_reduced_grads()

    def _grads_for_norm(self) -> list[torch.Tensor]:
        """This rank's share of the gradients; summed over ranks at stage >= 1 they are all of them.
        (An offload's uncast copies hold the same values: the norm is taken as without offload.)"""
        stream = self._stream()
        if stream is not None:  # Note [gradients on disk] in core/offload/grad_files.py
            if not self.dtypes.master_grad_is_view:
                raise NotImplementedError(
                    "With the gradients in swap files and mixed precision, a pipeline's or tensor parallel's norm "
                    "correction (tied or replicated parameters) is not built. Fix: precision fp32 or bf16-true, or "
                    "offload_optimizer='cpu'.")
            stream.materialize()
        if self.sharded is not None and not self.dtypes.master_grad_is_view:
            return self.sharded.master_grads()
        return self.reducer.local_grads()

    def _stream(self) -> StreamedGrads | None:
        """The gradients when the offload keeps them in files (Note [gradients on disk]), else ``None``."""
        return self.sharded.store.streamed_grads() if self.sharded is not None else None

    def _scale(self, op: Callable[[torch.Tensor], object]) -> None:
        """Run ``op`` in place on the gradients the optimizer steps on (unscaling, clipping)."""
        stream = self._stream()
        if stream is not None:
            stream.apply(op)
            return
        for t in self._grads_to_scale():
            op(t)

    def _sum_of_squares(self) -> float:
        """This rank's sum of squared gradients (``local_sum_of_squares`` of :meth:`_grads_for_norm`'s tensors)."""
        if self._stream() is None:
            return self._local_sumsq()
        parts = self._per_grad(lambda t: torch.linalg.vector_norm(t, 2, dtype=torch.float32))
        return float(torch.stack(parts).square().sum()) if parts else 0.0  # as local_sum_of_squares does

    def _per_grad(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """``fn`` of each non-empty gradient tensor of :meth:`_grads_for_norm`, in its order."""
        stream = self._stream()
        if stream is not None:
            return stream.norms(fn, self.dtypes.master_grad_is_view, self.sharded.piece_numel)  # type: ignore[union-attr]
        return [fn(t) for t in self._grads_for_norm() if t.numel()]

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
        self.move(StepState.PREPARED)
        if self.sharded is not None and not self.master_grad_is_view:
            self.sharded.set_grads(self.reduced_for_masters())
        elif not self.dtypes.master_grad_is_view:  # stage 0, the params are the master: cast for them
            self._cast_grads = self._param_dtype_grads()
        if loss_scale != 1.0:
            self._scale(lambda t: t.mul_(1.0 / loss_scale))
        sumsq = torch.tensor([self._sum_of_squares() - self._norm_excess(2.0)], dtype=torch.float32,
                             device=self.comm.device)
        if check_overflow and self._any_rank(non_finite(float(sumsq))):
            self.skip_step()
            self.last_grad_norm = math.inf
            return True
        if self._norm_is_partial:
            self.comm.all_reduce_sum(sumsq)
            if self.grad_reduction is GradReduction.BY_OPTIMIZER:
                sumsq /= self.comm.world_size  # Note [norm of local gradients]
        if self.model_parallel is not None:
            self.model_parallel.all_reduce_sum(sumsq)
        self._norm = sumsq.sqrt().reshape(())
        self.last_grad_norm = float(self._norm)
        return False

    def _local_sumsq(self) -> float:
        """This rank's squared norm terms, each group's weighted by its share when ``shares`` are given."""
        grads = self._grads_for_norm()
        if self.shares is None:
            return local_sum_of_squares(grads)
        return sum(share * local_sum_of_squares([g]) for share, g in zip(self.shares, grads, strict=True))

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any data-parallel rank, or any rank of the other pipeline stages."""
        flag = any_rank(flag, self.comm)
        return any_rank(flag, self.model_parallel) if self.model_parallel is not None else flag

    def _norm_excess(self, norm_type: float) -> float:
        return self.norm_excess(self._grads_for_norm(), self.groups, norm_type) if self.norm_excess else 0.0

    def _param_dtype_grads(self) -> list[torch.Tensor]:
        """The reduced whole gradients cast into the params' dtype, as the params' ``.grad`` views."""
        out = []
        for g, flat in zip(self.groups, self.reducer.flat_grads):
            if flat is not None:
                cast = flat.to(g.dtype)
                for s, view in zip(g.slots, g.views(cast)):
                    s.param.grad = view
                out.append(cast)
        return out

    @torch.no_grad()
    def first_nonfinite_gradient(self) -> str | None:
        """After the last backward of a step: the name of the first parameter (module order) whose reduced
        gradient holds ``nan`` / ``inf`` on any rank of data x tensor x pipeline x sequence, or ``None`` (a
        collective; Note [non-finite policy])."""
        stream = self._stream()
        if stream is not None and self.dtypes.master_grad_is_view:  # the optimizer's gradients are the shards
            stream.materialize()
        grads: list[tuple[torch.Tensor, int] | None] = []
        for i, g in enumerate(self.groups):
            if not self.config.stage.shards_optimizer:
                flat = self.reducer.flat_grads[i]
                grads.append(None if flat is None else (flat, 0))
            else:
                grads.append((self.reducer.shard_grad(i), g.shard_range()[0]))
        order = list(self.names)
        first = first_nonfinite_parameter(self.groups, grads, order, self.comm)
        name = None if first is None else self.names[order[first]]
        if self.model_parallel is not None:  # the other stages / TP ranks too: every rank decides alike
            name = agree_over_model_parallel(name, self.model_parallel)
        return name

    def skip_step(self) -> None:
        """Skip this optimizer step on this rank (every rank must agree): no parameter changes."""
        self.move(StepState.SKIPPED)
        if self.sharded is not None:
            self.sharded.clear_grads()
        for p in self.names:  # an optimizer stepping the parameters themselves skips those without .grad
            p.grad = None

    def require_prepared(self, what: str) -> None:
        if not self.master_grad_is_view and not self._prepared:
            raise RuntimeError(
                f"{what} needs the master gradients: call `engine.prepare_step(loss_scale)` after the last "
                "backward of the step (the precision plugin does this under ZeroStrategy)."
            )

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all shards (every rank gets the same value)."""
        self.require_prepared("The gradient norm")
        if norm_type == math.inf:
            maxima = self._per_grad(lambda t: t.float().abs().max())
            value = torch.stack(maxima).max() if maxima else torch.zeros(())
            if self._norm_is_partial:
                self.comm_max(value)
            if self.model_parallel is not None:
                self.model_parallel.all_reduce_max(value)
            return value
        norms = self._per_grad(lambda t: torch.linalg.vector_norm(t.float(), norm_type))
        parts = torch.stack(norms) if norms else torch.zeros(1)
        if self.shares is not None:
            grads = self._grads_for_norm()
            parts = torch.stack([torch.linalg.vector_norm(t.float(), norm_type) for t in grads])
            parts = parts * torch.tensor(self.shares, dtype=parts.dtype) ** (1.0 / norm_type)
        total = parts.pow(norm_type).sum() - self._norm_excess(norm_type)
        if self._norm_is_partial and self.comm.active:
            self.comm.all_reduce_sum(total)
            if self.grad_reduction is GradReduction.BY_OPTIMIZER:
                total /= self.comm.world_size  # Note [norm of local gradients]
        if self.model_parallel is not None:
            self.model_parallel.all_reduce_sum(total)
        return total.pow(1.0 / norm_type)

    @property
    def _norm_is_partial(self) -> bool:
        """Whether this rank's gradients are only part of the norm (shards, or unreduced local gradients).

        Note [norm of local gradients]
            When the optimizer reduces the gradients itself (1-bit Adam after its warm-up), each
            rank holds its own local gradient. Clipping then measures the root mean square of the
            ranks' local norms, sqrt(mean_r ||g_r||^2): one scalar all-reduce, the same value on
            every rank (so every rank clips by the same factor), and never below the norm of the
            averaged gradient, so clipping is at least as strict as before the freeze.
        """
        return (self.config.stage.shards_optimizer or self.grad_reduction is GradReduction.BY_OPTIMIZER
                or self.shares is not None)

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
        self._scale(lambda t: t.mul_(coef.to(device=t.device, dtype=t.dtype)))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        self.require_prepared("Clipping")
        self._scale(lambda t: t.clamp_(-clip_value, clip_value))

    def _all_reduced_grads(self) -> list[torch.Tensor]:
        if self.reducer.whole_grads_valid():
            return [g for g in self.reducer.flat_grads if g is not None]
        return self.reducer.local_grads()


_WHY = {
    StepState.PREPARED: "The step's gradients must come from a finished backward that was the step's last (not "
                        "one inside no_sync, not one still running): call engine.finish_backward() after it.",
    StepState.BACKWARD: "A backward after prepare_step would mix new gradients into prepared (unscaled, measured) "
                        "ones: finish the step (optimizer.step(); engine.after_step()) or call engine.zero_grad().",
}
_WHY[StepState.ACCUMULATED] = _WHY[StepState.REDUCED] = _WHY[StepState.BACKWARD]


def norm_shares(groups: list[FlatParamGroup], comm: DataParallelComm, config: ZeroConfig) -> list[float] | None:
    """Stages 0 with expert groups: each flat group's share of its whole-gradient norm terms on this rank (1 / the
    ranks holding the same whole gradient: the data group for dense groups, the expert-data group for the
    experts'), so that one sum over the data group counts every parameter once (Note [counting a parameter
    once]); ``None`` otherwise (shards: every element is held by one data rank)."""
    if config.stage.shards_optimizer or not any(g.experts for g in groups):
        return None
    return [1.0 / comm.of(g.experts).world_size for g in groups]
