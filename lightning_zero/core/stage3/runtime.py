"""Stage 3: parameters live as 1/N shards and are gathered one unit at a time, just in time.

Communication plan, per micro-step with units U_1..U_k (Note [units]) on N ranks:

* forward: before U_i runs, its flat buffers are all-gathered (from each rank's shard) into
  storage allocated for the occasion; the gathers of the next units in the recorded order are
  issued asynchronously while U_i computes (prefetch), within ``prefetch_bucket_size`` elements
  in flight and ``max_live_parameters`` gathered. After U_i's forward the storage is freed (the
  ``nn.Parameter`` objects and the autograd graph keep views of it).
* backward: when the gradient of U_i's output arrives, U_i is gathered again into the same
  storage (the saved views become valid again) unless it stayed gathered (Note [kept tail]),
  U_{i-1} is prefetched; once every trainable
  parameter of U_i has its gradient, the gradients are reduced in buckets as in stage 2 (into
  this rank's gradient shard) and U_i's storage is freed.
* the root unit is gathered on first use and freed after backward (or after an evaluation
  step); the persistent unit is never freed and is all-gathered after each optimizer step.

Note [kept tail]
    Backward starts with the units forward ran last. Once the forward order is recorded, the last
    units of it whose elements add up to at most ``prefetch_bucket_size``, and with the root to at
    most ``max_live_parameters``, are not released after their forward: backward finds them
    gathered, which saves one gather (a shard copy and N broadcasts) per kept unit per micro-step.
    Memory: those units stay gathered from their forward to their backward, within the bound the
    prefetch settings already allow (``live_bound``), so the gathered peak stays within
    ``max_live_parameters`` whenever the running unit does; docs/tuning.md.
    Reuse distance (``max_reuse_distance``, DeepSpeed's ``stage3_max_reuse_distance``): a unit U of the
    tail is released after its forward and reused by its backward; in between run the forwards and then
    the backwards of the units after U in forward order, which are the units before U in backward order.
    U's reuse distance is the elements gathered from its release point to its reuse, its own included:
    numel(U) plus the numel of every unit after it in forward order. U is kept only if that is at most
    ``max_reuse_distance`` (besides the two bounds above), so the whole kept tail's numel is too; 0 keeps
    no unit (backward gathers every unit again), one unit's numel keeps the last unit at most. The
    default, DeepSpeed's 1e9, leaves the tail to the two bounds above.

Note [gather agreement]
    While a pass's unit order is being recorded (the first step, and after a re-trace) every
    gather is preceded by one tiny all-reduce in which all ranks compare the index of the unit
    they are about to gather. Collectives are matched by their order, so if a rank took a branch
    another did not, the ranks would otherwise exchange buffers of different units; with the
    check every rank raises the same error instead. Once recorded, the order is the same on
    every rank (it was checked), prefetches follow it, and the check is skipped: a synchronous
    collective per unit was 3-5% of a stage-3 step on gloo (docs/benchmarks.md). When the order
    a rank actually runs differs from the recorded one, the prefetched units are dropped and the
    order is recorded afresh (re-tracing, with the check again), which costs memory only. Ranks
    that all change their order together (a step-dependent branch) re-trace together; a rank
    that alone leaves a recorded order is caught by its agreement all-reduce meeting the others'
    gathers, which fails or times out (``timeout_s``) rather than raising the named error.
    ``Stage3Runtime.agreement`` selects ``ALWAYS`` (every gather, the behaviour before) or
    ``OFF`` (never; benchmarks/ measures the check's cost that way).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.stage3.gather_pool import GatherPool
from lightning_zero.core.stage3.sharded_unit import ShardedUnit, UnitState
from lightning_zero.core.stage3.units import PERSISTENT, ROOT


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Agreement(enum.Enum):
    """When ranks compare the unit they gather (Note [gather agreement])."""

    WHILE_RECORDING = "while_recording"  # the default
    ALWAYS = "always"
    OFF = "off"


class Stage3Runtime:
    """Hooks that gather, prefetch and release units around forward and backward.

    Args:
        module: the whole model (hooks go on the units' modules and the root's owners).
        units: every unit; the one named ``ROOT`` has no module of its own.
        unit_modules: the top modules of each unit (same order as ``units``).
        root_owners: modules owning root-unit parameters directly.
        comm: the data-parallel collectives.
        prefetch_numel: elements that may be in flight ahead of the running unit.
        max_live_numel: prefetch only while fewer elements than this are gathered.
        max_reuse_distance: keep a unit gathered into backward only within this reuse distance, in elements
            (Note [kept tail]).
    """

    def __init__(
        self,
        units: list[ShardedUnit],
        unit_modules: list[list[nn.Module]],
        root_owners: list[nn.Module],
        comm: DataParallelComm,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int = 1_000_000_000,
    ) -> None:
        self.units = units
        self.unit_modules = unit_modules  # the top module(s) of each unit
        self.comm = comm
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.root: ShardedUnit | None = next((u for u in units if u.name == ROOT), None)
        self.blocks: list[ShardedUnit] = [u for u in units if u.name not in (ROOT, PERSISTENT)]
        self._unit_of: dict[nn.Parameter, ShardedUnit] = {p: u for u in units for p in u.trainable}
        self.live_numel: int = 0  # elements of non-persistent units gathered or being gathered
        self.peak_live_numel: int = 0  # the most ever gathered at once (Note: a peak, not a snapshot)
        self.traces: dict[Phase, list[int]] = {Phase.FORWARD: [], Phase.BACKWARD: []}  # recorded unit order
        self._current: dict[Phase, list[int]] = {Phase.FORWARD: [], Phase.BACKWARD: []}  # this pass so far
        self.retraces: int = 0
        self.holding: bool = False  # hold_all(): nothing is released until release_held()
        self.agreement: Agreement = Agreement.WHILE_RECORDING  # Note [gather agreement]
        self.agreements: int = 0  # agreement all-reduces issued (tests count them)
        self._tail: tuple[list[int], frozenset[int]] = ([], frozenset())  # Note [kept tail]: (trace, its kept units)
        self.pool = GatherPool()  # Note [gather buffer pool]
        for unit in units:
            if not unit.persistent:
                unit.pool = self.pool
        self._hooks: list[RemovableHandle] = []
        for unit, mods in zip(units, unit_modules):
            for m in mods:
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._post_forward_hook(unit)))
        if self.root is not None:
            for m in root_owners:
                self._hooks.append(m.register_forward_pre_hook(lambda *_: self.use_root()))
        for p in self._unit_of:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        """Teardown: the hooks go, and the gather pool frees what it kept (Note [gather buffer pool])."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.pool.close()

    # ---------------------------------------------------------------- gather / release
    def _gather(self, unit: ShardedUnit, recording: bool = True, may_lend: bool = True) -> None:
        if unit.state not in (UnitState.SHARDED, UnitState.READING):
            return
        check = self.agreement is Agreement.ALWAYS or (recording and self.agreement is Agreement.WHILE_RECORDING)
        if self.comm.active and check:  # Note [gather agreement]
            self.agreements += 1
            largest, smallest = self.comm.extremes(unit.index)
            if largest != smallest:
                raise RuntimeError(
                    f"ZeRO stage 3: this rank is about to gather unit {unit.name!r} (#{unit.index}) while another "
                    f"data-parallel rank gathers unit #{largest} or #{smallest}: the ranks ran "
                    "different modules (a branch that depends on the rank or its data). Every rank must run the "
                    "same units in the same order: make the branch the same on every rank, or keep the branch's "
                    "modules out of the units (`unit_classes`) so that they belong to the root unit."
                )
        if unit.state is UnitState.SHARDED:
            self._count_live(unit)
        unit.start_gather(self.comm, may_lend)

    def _count_live(self, unit: ShardedUnit) -> None:
        self.live_numel += unit.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _release(self, unit: ShardedUnit) -> None:
        if self.holding or unit.persistent or unit.state is UnitState.SHARDED:
            return
        unit.release()
        self.live_numel -= unit.numel

    def gather_one(self, unit: ShardedUnit) -> None:
        """Start gathering ``unit`` outside forward / backward (e.g. ``gathered_parameters``): never lent,
        because the optimizer's masters may be read meanwhile (Note [one rank])."""
        self._gather(unit, may_lend=False)

    def release_one(self, unit: ShardedUnit) -> None:
        self._release(unit)

    def use_root(self) -> None:
        """Gather the root unit if it is not (first use in a step)."""
        if self.root is not None and self.root.state is not UnitState.GATHERED:
            self._gather(self.root, recording=not self.traces[Phase.FORWARD])
            self.root.wait()

    def _use(self, unit: ShardedUnit, phase: Phase) -> None:
        current = self._current[phase]
        trace = self.traces[phase]
        position = len(current)
        if trace and (position >= len(trace) or trace[position] != unit.index):
            self._drop_prefetched(keep=unit)  # the order changed: re-trace (Note [gather agreement])
            self.traces[phase] = trace = []
            self.retraces += 1
        current.append(unit.index)
        self._gather(unit, recording=not trace)
        unit.wait()
        if trace:
            self._prefetch(trace[position + 1 :])

    def _prefetch(self, upcoming: list[int]) -> None:
        """Note [read ahead]
            Units whose shards live in swap files (``ShardedUnit.reads_ahead``) are prefetched in two hooks:
            when a unit enters the window ahead of the running one its shards' reads start (READING, on the
            offload's reader thread, straight into its gather buffer), and at the next unit's hook its
            all-gather is issued (after waiting for the reads, which had the running unit's compute to
            finish). Collectives are matched by their order, so when a gather is issued must not depend on
            when a read finishes: it depends only on the hook, the same on every rank. With a window of two
            units or more the read of unit k+2 and the all-gather of unit k+1 both overlap unit k's compute;
            with one, the read does and the all-gather waits at unit k+1's own hook. A unit being read holds
            its gather buffer and counts against ``prefetch_bucket_size`` and ``max_live_parameters`` like a
            gathered one.
        """
        in_flight = 0
        for index in upcoming:
            unit = self.units[index]
            if unit.persistent or unit is self.root:
                continue
            if unit.state is UnitState.READING:  # read since an earlier hook: its all-gather goes now
                self._gather(unit, recording=False)
            if unit.state is not UnitState.SHARDED:  # prefetched earlier: counts against the budget
                in_flight += unit.numel
                continue
            if in_flight + unit.numel > self.prefetch_numel or self.live_numel + unit.numel > self.max_live_numel:
                break
            if unit.reads_ahead:
                self._count_live(unit)
                unit.start_read()
            else:
                self._gather(unit, recording=False)  # the recorded order, agreed on while it was recorded
            in_flight += unit.numel

    def live_bound(self) -> int:
        """The most elements gathered at once that the prefetch settings allow: the root, the
        largest unit running, and what may be in flight ahead of it (capped by
        ``max_live_numel``, which never stops the running unit itself)."""
        root = self.root.numel if self.root is not None else 0
        blocks = sorted((u.numel for u in self.blocks), reverse=True)
        if not blocks:
            return root
        running = root + blocks[0]
        ahead = min(self.prefetch_numel, sum(blocks[1:]))
        return max(running, min(running + ahead, self.max_live_numel))

    def _kept(self, unit: ShardedUnit) -> bool:
        """Whether ``unit`` stays gathered from its forward into its backward (Note [kept tail])."""
        trace = self.traces[Phase.FORWARD]
        if not trace or not torch.is_grad_enabled():
            return False
        if self._tail[0] is not trace:
            root = self.root.numel if self.root else 0
            budget = min(self.prefetch_numel, self.max_live_numel - root, self.max_reuse_distance)
            kept: set[int] = set()
            for index in reversed(trace):
                u = self.units[index]
                if u.persistent or u is self.root or trace.count(index) > 1 or u.numel > budget:
                    break
                budget -= u.numel
                kept.add(index)
            self._tail = (trace, frozenset(kept))
        return unit.index in self._tail[1]

    def _drop_prefetched(self, keep: ShardedUnit) -> None:
        for u in self.blocks:
            if u is not keep and u.state is not UnitState.SHARDED:
                self._release(u)

    # ---------------------------------------------------------------- forward hooks
    def _pre_forward_hook(self, unit: ShardedUnit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            self.use_root()
            self._use(unit, Phase.FORWARD)
            if torch.is_grad_enabled():
                unit.pending_grads = len(unit.trainable)
                unit.inputs_done = False
                args = tuple(
                    _PostBackward.apply(self, unit, a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                    for a in args
                )
            return args, kwargs

        return hook

    def _post_forward_hook(self, unit: ShardedUnit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not self._kept(unit):
                self._release(unit)
            if torch.is_grad_enabled():
                tensors = [t for t in _tensors(output) if t.requires_grad]
                fired = [False]

                def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                    if not fired[0]:
                        fired[0] = True
                        self._use(unit, Phase.BACKWARD)
                    return grad

                for t in tensors:
                    t.register_hook(pre_backward)
            return output

        return hook

    # ---------------------------------------------------------------- backward hooks
    def _on_grad(self, param: torch.Tensor) -> None:
        unit = self._unit_of[param]
        unit.pending_grads -= 1
        self._maybe_done(unit)

    def inputs_backward_done(self, unit: ShardedUnit) -> None:
        unit.inputs_done = True
        self._maybe_done(unit)

    def _maybe_done(self, unit: ShardedUnit) -> None:
        # frozen parameters may still be needed for the inputs' gradient (Note [units])
        if unit.pending_grads <= 0 and (unit.inputs_done or not unit.has_frozen) and unit is not self.root:
            self._release(unit)

    def end_backward(self) -> None:
        """After backward: free every unit still gathered (root, units with unused parameters)."""
        self.release_all()
        for phase in Phase:
            if not self.traces[phase]:
                self.traces[phase] = self._current[phase]
            self._current[phase] = []

    def end_forward_only(self) -> None:
        """After an evaluation step (no backward follows)."""
        self.release_all()
        if not self.traces[Phase.FORWARD]:
            self.traces[Phase.FORWARD] = self._current[Phase.FORWARD]
        self._current = {Phase.FORWARD: [], Phase.BACKWARD: []}

    def shadow_forward(self) -> None:
        """Take part in the gathers of one evaluation forward without computing: for a rank that
        has run out of batches while others have not (each gather is a collective)."""
        self.use_root()
        for index in self.traces[Phase.FORWARD]:
            unit = self.units[index]
            self._gather(unit, recording=False)  # as the other ranks' forward along the recorded order
            unit.wait()
            self._release(unit)
        self.release_all()

    def release_all(self) -> None:
        for u in self.units:
            self._release(u)

    def hold_all(self) -> None:
        """Pipelines: gather every unit once and keep it through all micro-batches of a step (one
        gather per unit per step instead of one per micro-batch); ``release_held`` ends it."""
        self.gather_all()
        self.holding = True

    def release_held(self) -> None:
        self.holding = False
        self.release_all()

    def stop_holding(self) -> None:
        """End ``hold_all`` without releasing: the units are released as the backward passes them."""
        self.holding = False

    def gather_all(self) -> None:
        """Gather every unit (state dicts, teardown); collective. Not counted in the peak, which
        tracks training and evaluation."""
        peak = self.peak_live_numel
        for u in self.units:
            self._gather(u, may_lend=False)  # Note [one rank]: the masters may be read while gathered
        for u in self.units:
            u.wait()
        self.peak_live_numel = peak


class _PostBackward(torch.autograd.Function):
    """Identity whose backward tells the runtime that a unit's input gradient was computed."""

    @staticmethod
    def forward(ctx: Any, runtime: Stage3Runtime, unit: ShardedUnit, x: torch.Tensor) -> torch.Tensor:
        ctx.runtime, ctx.unit = runtime, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.runtime.inputs_backward_done(ctx.unit)
        return None, None, grad


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
