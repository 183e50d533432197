"""Gradient reduction in buckets, overlapped with backward.

Communication plan, per optimizer step of A micro-steps on N data-parallel ranks:

* stages 0 and 1: a post-accumulate-grad hook adds each parameter's gradient into the whole
  flat gradient buffer of its group (so micro-steps accumulate locally, with no traffic). On the
  last micro-step (``sync`` true) a bucket is scaled by 1/N and all-reduced as soon as its last
  parameter reported; with ``collective="reduce_scatter"`` stage 1 reduce-scatters it instead and
  keeps only its own shard's part.
* stages 2 and 3: on every micro-step the hook copies the gradient into the staging buffer of its
  bucket's message (no rank keeps a whole gradient; ``exchange.py``); a message whose buckets are all
  complete is reduced asynchronously and this rank's part is written into (first reduction since
  ``zero()``, Note [written shard]) or added to its gradient shard. On gloo with ``collective="auto"``
  the reduction is an exchange to the owners and buckets of several units share a message (Note
  [owner exchange]); otherwise a reduce-scatter, or an all-reduce with ``collective="all_reduce"``, of
  one bucket. At most two messages are in flight; staging and receive buffers are reused (Note
  [reused buffers]).

Note [fixed launch order]
    Buckets are launched in one order computed from the module's parameter order, the same on
    every rank; a bucket that is complete early waits for its predecessors. Ranks whose autograd
    graphs differ (a branch taken on one rank only, unused parameters) therefore still issue the
    same collectives in the same order; unfinished buckets are launched, zero-filled where no
    gradient came, by :meth:`GradReducer.finish`.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm, Handle
from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.common.flat_param import Bucket, FlatParamGroup, overlap
from lightning_zero.core.zero.exchange import BufferPool, GradShards, Message, MessageStaging, Segment, plan_buckets

if TYPE_CHECKING:
    from lightning_zero.core.comm.grad_home import GradHome


class BackwardState(enum.Enum):
    """Whether gradients are arriving in the hooks."""

    IDLE = "idle"
    """No backward since the last :meth:`GradReducer.finish`."""
    RUNNING = "running"
    """A backward's gradients are arriving."""


class ReductionMode(enum.Enum):
    """When the gradient hooks reduce (Note [deferred reduction] in ``engine.py``)."""

    IMMEDIATE = "immediate"
    """Buckets are reduced as they fill; at stages 0-1 this backward is the step's last (the accumulation boundary)."""
    AT_BOUNDARY = "at_boundary"
    """Stages 0-1 add gradients into the whole local buffer with no traffic until a boundary backward reduces them
    (``no_sync``; the local gradients of a self-reducing optimizer); stages 2-3 reduce anyway."""
    PIPELINE_DEFERRED = "pipeline_deferred"
    """A pipeline schedule's window: nothing is reduced until :meth:`GradReducer.reduce_deferred` (stages 2-3 keep
    ``.grad``, stages 0-1 accumulate into the whole buffer), and ``zero_grad`` leaves the window's gradients alone;
    the mode before the window (``IMMEDIATE`` or ``AT_BOUNDARY``) applies when it ends."""


@dataclass
class _InFlight:
    bucket: Bucket
    handle: Handle
    source: torch.Tensor  # the reduced bucket (staging buffer, view of the flat gradient, or a cast copy)
    output: torch.Tensor | None  # reduce-scatter output (this rank's part), else None
    home: torch.Tensor | None = None  # flat-gradient slice that ``source`` is a cast copy of (stages 0-1)
    message: Message | None = None  # stages 2-3
    received: list[torch.Tensor] | None = None  # owner exchange: per rank, its part for this rank
    pooled: tuple[tuple[BufferPool, torch.Tensor], ...] = ()  # given back at retirement


class GradReducer:
    """Owns the gradient buffers and the per-parameter hooks of every stage.

    Args:
        groups: the flat groups (one per optimizer param group).
        comm: the data-parallel collectives.
        stage: ZeRO stage (0-3; stage 3 reduces like stage 2).
        bucket_numel: target elements per bucket.
        overlap: launch buckets from the hooks (else all at :meth:`finish`).
        grad_dtype: dtype gradients are reduced in.
        names: parameter -> qualified name, in module order (bucket order, error messages).
        accum_dtype: dtype the whole gradients (stages 0-1) and gradient shards (stage 2) are kept
            and accumulated in (``None``: ``grad_dtype``); see Note [gradient dtypes] in config.py.
        grad_home: where the gradient shards (stages 2-3) live when not in memory (``GradHome`` in
            ``exchange.py``: the offload's swap files); ``None``: in memory.
        average_over: the ranks the summed gradients are divided by (``None``: ``comm``'s); the experts' reducer
            sums over the expert-data group and divides by the data x sequence size (Note [expert axes]).
    """

    def __init__(
        self,
        groups: list[FlatParamGroup],
        comm: DataParallelComm,
        stage: int | ZeroStage,
        bucket_numel: int,
        overlap: bool,
        grad_dtype: torch.dtype,
        names: dict[nn.Parameter, str],
        accum_dtype: torch.dtype | None = None,
        grad_home: GradHome | None = None,
        average_over: int | None = None,
    ) -> None:
        self.groups = groups
        self.comm = comm
        self.average_over = comm.world_size if average_over is None else average_over
        self.stage = ZeroStage.of(stage)
        self.overlap = overlap
        self.grad_dtype = grad_dtype
        self.accum_dtype = accum_dtype or grad_dtype
        self.names = names
        self.mode = ReductionMode.IMMEDIATE
        self._mode_after_window = ReductionMode.IMMEDIATE  # what PIPELINE_DEFERRED returns to
        self.state = BackwardState.IDLE
        self._dirty = False  # whether any gradient buffer may be non-zero (zero() is a no-op otherwise)
        self.max_in_flight = 2 if self.stage.shards_gradients else 1 << 30
        # whole gradients of the accumulation window (stages 0-1), one per group, padded layout
        self.flat_grads: list[torch.Tensor | None] = [None] * len(groups)
        for i, g in enumerate(groups):
            if not self.stage.shards_gradients:
                self.flat_grads[i] = torch.zeros(g.padded_numel, dtype=self.accum_dtype, device=g.device)
        self.buckets, self._module_order = plan_buckets(groups, names, bucket_numel)  # Note [fixed launch order]
        # parameter -> (bucket order, slot index)
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for b in self.buckets:
            for s in b.slots:
                self._where[groups[b.group_index].slots[s].param] = (b.order, s)
        self._pending: list[int] = []  # parameters still to report, per bucket
        self._reported: set[nn.Parameter] = set()
        # gloo's send / receive read host memory only: gradients on a GPU keep the all-reduce
        on_host = all(g.device.type == "cpu" for g in groups)
        self._exchange = self.stage.shards_gradients and comm.use_owner_exchange and comm.world_size > 1 and on_host
        # stages 2-3: messages and their buffers, and this rank's gradient shards (core/zero/exchange.py)
        self.staged = MessageStaging(self.buckets if self.stage.shards_gradients else [], groups, bucket_numel,
                                     self._exchange, comm.rank, comm.world_size, grad_dtype, self.max_in_flight,
                                     self._module_order)
        self.messages: list[Message] = self.staged.messages
        self.shards = GradShards(groups, self.buckets, self.accum_dtype, grad_home)
        self.grad_shards: list[torch.Tensor | None] = self.shards.tensors  # one per group (stages 2-3)
        self._launched: list[bool] = []
        self._next_launch = 0
        self._in_flight: deque[_InFlight] = deque()
        self._reset_backward()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where
        ]

    # ---------------------------------------------------------------- setup
    def _reset_backward(self) -> None:
        self._pending = [len(b.slots) for b in self.buckets]
        self._reported.clear()
        self._launched = [False] * len(self.buckets)
        self._next_launch = 0

    def remove_hooks(self) -> None:
        """Teardown: the hooks go, and the reused message buffers are freed (Note [reused buffers])."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.staged.release()

    # ---------------------------------------------------------------- mode
    @property
    def boundary_mode(self) -> ReductionMode:
        """``IMMEDIATE`` or ``AT_BOUNDARY``: what the hooks do outside a pipeline window (or after this one)."""
        return self._mode_after_window if self.mode is ReductionMode.PIPELINE_DEFERRED else self.mode

    def set_boundary_mode(self, mode: ReductionMode) -> None:
        """Whether this backward is the step's last (``IMMEDIATE``) or not (``AT_BOUNDARY``); inside a pipeline
        window it applies when the window ends."""
        if mode is ReductionMode.PIPELINE_DEFERRED:
            raise ValueError("A pipeline window is opened with defer(), not as a boundary mode.")
        if self.mode is ReductionMode.PIPELINE_DEFERRED:
            self._mode_after_window = mode
        else:
            self.mode = mode

    @property
    def sync(self) -> bool:
        """Whether stages 0-1 reduce at the end of this backward (the accumulation boundary)."""
        return self.boundary_mode is ReductionMode.IMMEDIATE

    @property
    def deferred(self) -> bool:
        """Whether a pipeline window holds the reduction back."""
        return self.mode is ReductionMode.PIPELINE_DEFERRED

    def defer(self) -> None:
        """Open a pipeline window (nothing is reduced until :meth:`reduce_deferred` or :meth:`end_window`)."""
        if self.mode is not ReductionMode.PIPELINE_DEFERRED:
            self._mode_after_window, self.mode = self.mode, ReductionMode.PIPELINE_DEFERRED

    def end_window(self) -> None:
        """Close a pipeline window without reducing (its gradients were reduced already, or are to be kept)."""
        if self.mode is ReductionMode.PIPELINE_DEFERRED:
            self.mode = self._mode_after_window

    @property
    def communicating(self) -> bool:
        """Whether this backward reduces (stage 2 always; stages 0-1 on the boundary)."""
        return self.stage.shards_gradients or self.sync

    # ---------------------------------------------------------------- backward
    def _destination(self, bucket: Bucket, slot_index: int) -> torch.Tensor:
        slot = self.groups[bucket.group_index].slots[slot_index]
        flat = self.flat_grads[bucket.group_index]
        return flat[slot.offset : slot.offset + slot.numel]

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.deferred and self.stage.shards_gradients:  # autograd accumulates in .grad (Note [deferred reduction])
            return
        self.state = BackwardState.RUNNING
        order, slot_index = self._where[param]
        bucket = self.buckets[order]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if self._launched[order] and self.communicating:
            raise RuntimeError(
                f"The gradient of {self.names.get(param, '?')!r} arrived after its bucket was reduced. "
                "This happens when one backward reaches a parameter twice (reentrant activation "
                "checkpointing): use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        self._dirty = True
        if self.stage.shards_gradients:  # a reused staging buffer is written, not zero-filled
            slot = self.groups[bucket.group_index].slots[slot_index]
            self.staged.write(bucket, slot.offset, slot.offset + slot.numel, grad.reshape(-1),
                              param not in self._reported)
        else:
            dest = self._destination(bucket, slot_index)
            if grad.data_ptr() != dest.data_ptr():  # else autograd accumulated into our view in place
                dest.add_(grad.reshape(-1))
        if param not in self._reported:
            self._reported.add(param)
            self._pending[order] -= 1
        if self.overlap and self.communicating and not self.deferred:  # stages 0-1 deferred: accumulate only
            self._launch_ready(force=False)

    def reduce_deferred(self) -> None:
        """End a deferred window: hand every accumulated ``.grad`` to the buckets, in backward order
        (stages 0-1 accumulated into their whole buffers already; ``finish`` reduces them)."""
        self.end_window()
        for param in reversed(list(self._where)):
            if param.grad is not None:
                self._on_grad_ready(param)

    def _launch_ready(self, force: bool) -> None:
        if self.stage.shards_gradients:  # messages, in the fixed order (Note [owner-major message])
            while self._next_launch < len(self.messages) and (
                force or all(self._pending[o] == 0 for o in self.messages[self._next_launch].buckets)
            ):
                self._launch_message(self._next_launch)
                self._next_launch += 1
            return
        while self._next_launch < len(self.buckets) and (force or self._pending[self._next_launch] == 0):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch_message(self, index: int) -> None:
        """Stages 2-3: zero what no gradient wrote, scale by 1/N and reduce one message."""
        message = self.messages[index]
        for o in message.buckets:
            self._launched[o] = True
        source = self.staged.complete(index, self.buckets, self._reported)
        while len(self._in_flight) >= self.max_in_flight:  # first: its buffers serve this message
            self._retire(self._in_flight.popleft())
        if self.average_over > 1:
            source.mul_(1.0 / self.average_over)
        pooled: tuple[tuple[BufferPool, torch.Tensor], ...] = ((self.staged.staging_pool, source._base),)
        output = received = None
        ranges = message.owner_ranges
        lo, hi = ranges[self.comm.rank]
        if self._exchange:
            recv = self.staged.receive_pool.take((self.comm.world_size - 1) * (hi - lo))
            pooled += ((self.staged.receive_pool, recv._base),)
            peers = [q for q in range(self.comm.world_size) if q != self.comm.rank]
            received = [source[lo:hi]] * self.comm.world_size  # own entry: this rank's own part
            for i, q in enumerate(peers):
                received[q] = recv[i * (hi - lo) : (i + 1) * (hi - lo)]
            handle = self.comm.exchange_to_owners([source[a:b] for a, b in ranges], received, tag=index)
        elif self.comm.use_all_reduce:
            handle = self.comm.all_reduce_sum(source, async_op=True)
        else:
            output = torch.empty(hi - lo, dtype=source.dtype, device=source.device)
            handle = self.comm.reduce_scatter_pieces(output, [source[a:b] for a, b in ranges], async_op=True)
        self._in_flight.append(_InFlight(self.buckets[message.buckets[0]], handle, source, output,
                                         message=message, received=received, pooled=pooled))

    def _launch(self, bucket: Bucket) -> None:
        self._launched[bucket.order] = True
        source = self.flat_grads[bucket.group_index][bucket.start : bucket.end]
        if self.average_over > 1:
            source.mul_(1.0 / self.average_over)
        home = None
        if source.dtype != self.grad_dtype:  # accumulated in another dtype: reduce a cast copy
            home, source = source, source.to(self.grad_dtype)
        output = None
        if not self.stage.shards_optimizer or self.comm.use_all_reduce:
            handle = self.comm.all_reduce_sum(source, async_op=True)
        else:
            g = self.groups[bucket.group_index]
            pieces = [self._clip_to(source, bucket, g.shard_range(r)) for r in range(self.comm.world_size)]
            output = torch.empty_like(pieces[self.comm.rank])
            handle = self.comm.reduce_scatter_pieces(output, pieces, async_op=True)
        while len(self._in_flight) >= self.max_in_flight:
            self._retire(self._in_flight.popleft())
        self._in_flight.append(_InFlight(bucket, handle, source, output, home))

    @staticmethod
    def _clip_to(source: torch.Tensor, bucket: Bucket, rng: tuple[int, int]) -> torch.Tensor:
        lo, hi = overlap(bucket.start, bucket.end, *rng)
        return source[lo - bucket.start : max(hi, lo) - bucket.start]

    def _retire(self, item: _InFlight) -> None:
        item.handle.wait()
        if item.message is not None:
            try:
                self._write_shard(item, item.message)
            finally:
                for pool, buffer in item.pooled:
                    pool.give(buffer)
            return
        if item.home is not None and item.output is None:
            item.home.copy_(item.source)
        if not self.stage.shards_optimizer:
            return
        b = item.bucket
        g = self.groups[b.group_index]
        own_start, own_end = g.shard_range()
        lo, hi = overlap(b.start, b.end, own_start, own_end)
        if hi <= lo:
            return
        reduced = item.source[lo - b.start : hi - b.start] if item.output is None else item.output
        self._dirty = True
        if item.output is not None:
            self.flat_grads[b.group_index][lo:hi].copy_(reduced)

    def _write_shard(self, item: _InFlight, message: Message) -> None:
        """Stages 2-3: this rank's parts of a reduced message into its gradient shards (Note [written shard])."""
        self._dirty = True

        def terms(seg: Segment, lo: int) -> list[torch.Tensor]:
            hi = lo + seg.end - seg.start
            if item.received is not None:  # Note [owner exchange]: in rank order
                return [part[lo:hi] for part in item.received]
            if item.output is not None:
                return [item.output[lo:hi]]
            return [item.source[seg.offset : seg.offset + seg.end - seg.start]]

        self.shards.write(message, self.comm.rank, terms)

    def finish(self) -> None:
        """End of a backward: launch what is left in the fixed order and wait for all of it."""
        if self.communicating:
            self._launch_ready(force=True)
            while self._in_flight:
                self._retire(self._in_flight.popleft())
            self.staged.staging.clear()  # the idle buffers stay for the next backward (Note [reused buffers])
            if self.sync and not self.overlap:  # overlap_comm=False: no buffers kept between steps
                self.staged.release()
        self._reset_backward()
        self.state = BackwardState.IDLE

    # ---------------------------------------------------------------- views for the step
    def shard_grad(self, group_index: int) -> torch.Tensor:
        """This rank's reduced gradient shard of a group (stages 1-2)."""
        if self.stage.shards_gradients:
            return self.shards.read(group_index)
        start, end = self.groups[group_index].shard_range()
        return self.flat_grads[group_index][start:end]

    def whole_grads_valid(self) -> bool:
        """Whether the whole flat gradients hold the reduced values everywhere."""
        return not self.stage.shards_optimizer or (not self.stage.shards_gradients and self.comm.use_all_reduce)

    def local_grads(self) -> list[torch.Tensor]:
        """The reduced gradient elements this rank is responsible for (norms, clipping)."""
        if not self.stage.shards_optimizer:
            return [g for g in self.flat_grads if g is not None]
        return [self.shard_grad(i) for i in range(len(self.groups))]

    def zero(self) -> None:
        if not self._dirty:
            return
        for t in self.flat_grads:
            if t is not None:
                t.zero_()
        self.shards.forget()  # the shards are written by the next reduction (Note [written shard])
        self._dirty = False

    def idle_buffers(self) -> list[torch.Tensor]:
        """The staging and receive buffers kept idle for reuse (Note [reused buffers])."""
        return self.staged.idle()

    def live_buffers(self) -> list[torch.Tensor]:
        """Staging buffers filling, and the staging, receive and reduce-scatter buffers of messages in flight."""
        out = self.staged.filling()
        for item in self._in_flight:
            out.extend(buffer for _, buffer in item.pooled)
            if not item.pooled:
                out.append(item.source)
            if item.output is not None:
                out.append(item.output)
        return out
