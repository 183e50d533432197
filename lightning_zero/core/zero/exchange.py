"""The gradient buckets in their fixed launch order (:func:`plan_buckets`, every stage), and stages 2-3 gradient
messages: buckets merged across units up to ``reduce_bucket_size``, laid out
owner by owner, the buffers they are staged and received in, their sum in a fixed rank order, and the
gradient shards they are written into.

Note [owner-major message]
    A message is a run of buckets consecutive in the fixed launch order (Note [fixed launch order]
    in ``grad_reducer.py``); with the owner exchange, buckets of several flat groups (stage 3: of
    several units) are merged while the message stays within ``reduce_bucket_size`` elements
    (a single bucket larger than that is a message of its own). A message's staging buffer lives
    from its first gradient to its last, so buckets are merged only while the parameters in the
    module-order span of the message hold at most twice the message's elements: a bucket whose
    parameters are spread over the model (stage 3's group of persistent parameters, a root unit
    holding the embedding and the head) fills during most of the backward, and merged it would
    keep a large staging buffer alive that long (it raised tests/e2e/test_large_models.py's peak),
    while a unit's weights and biases (two optimizer param groups) merge. Its staging buffer holds, for
    rank q = 0..N-1 in turn, every bucket's elements inside q's shard of that bucket's group: what
    goes to rank q is then one contiguous slice, sent with one ``isend``. For a message of one
    bucket this is the bucket's own element order, so the reduce-scatter and all-reduce paths
    use the same layout.

Note [owner exchange]
    Every rank sends rank q its slice for q and receives from every peer the slice for itself:
    (N-1)/N of the message leaves each rank, half of a ring all-reduce's bytes. The owner adds
    the N parts in rank order 0..N-1 (:func:`sum_in_rank_order`), so the sum does not depend on
    which message arrived first; at 2 ranks it is ``a + b``, bitwise what gloo's all-reduce gives,
    and at more ranks it differs from an all-reduce only by fp32 rounding order.

Note [reused buffers]
    Staging and receive buffers come from a :class:`BufferPool`: a buffer given back is handed out
    again, to a message needing at most that many elements and at least half of them, instead of a
    new allocation; at most ``keep`` idle buffers are kept. They are kept from one optimizer step to
    the next (like DDP's buckets and DeepSpeed's reduction buffers) and freed at teardown
    (``GradReducer.remove_hooks``); with ``overlap_comm=False`` they are freed at each step's last
    backward instead, the memory-lean choice (DeepSpeed's ``overlap_comm`` is its trade of bucket
    memory for speed too). Freed at each step's end, they came back from the
    kernel as fresh pages every step: on the gpt_20m benchmark 9,500 (stage 3) to 14,000 (stage 2)
    main-thread page faults per step, all of stage 3's above DDP's (docs/benchmarks.md). Memory:
    while a backward runs, at most two messages in flight (staging plus (N-1)/N of a message
    received) and the messages filling, each of at most ``reduce_bucket_size`` elements or one
    larger bucket; between steps the same buffers, idle, reported as ``pooled`` by
    ``model_state_bytes()`` (docs/tuning.md). The all-reduce path had the same staging and no
    receive buffer.

Note [written shard]
    The gradient shard is allocated with ``torch.empty`` and never zero-filled per step:
    ``forget()`` (the engine's ``zero_grad``) only forgets which buckets wrote their part; the first
    reduction of a bucket since then writes it and later ones add, and a part no reduction wrote is
    zeroed when the shard is read (:meth:`GradShards.read`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero.core.comm.grad_home import GradHome, sum_in_rank_order
from lightning_zero.core.common.flat_param import Bucket, FlatParamGroup, overlap


@dataclass(frozen=True)
class Segment:
    """The elements ``[start, end)`` of one bucket's flat group that rank ``owner`` owns, at ``offset`` in
    the message's staging buffer."""

    bucket: int  # bucket order
    group_index: int
    owner: int
    start: int
    end: int
    offset: int


@dataclass(frozen=True)
class Message:
    """Buckets reduced as one message (Note [owner-major message])."""

    buckets: tuple[int, ...]  # bucket orders, consecutive in the launch order
    numel: int  # staging elements
    owner_ranges: tuple[tuple[int, int], ...]  # per rank q: the staging slice [lo, hi) that goes to q
    segments: tuple[Segment, ...]  # owner-major


def _layout(buckets: list[Bucket], groups: list[FlatParamGroup], world_size: int) -> Message:
    segments, ranges, offset = [], [], 0
    for q in range(world_size):
        first = offset
        for b in buckets:
            lo, hi = overlap(b.start, b.end, *groups[b.group_index].shard_range(q))
            if hi > lo:
                segments.append(Segment(b.order, b.group_index, q, lo, hi, offset))
                offset += hi - lo
        ranges.append((first, offset))
    return Message(tuple(b.order for b in buckets), offset, tuple(ranges), tuple(segments))


@dataclass(frozen=True)
class ModuleOrder:
    """Where buckets sit in module order: ``spans[order]`` the first and last position of a bucket's
    parameters, ``prefix[i]`` the elements of the parameters before position i."""

    spans: tuple[tuple[int, int], ...]
    prefix: tuple[int, ...]

    def span_numel(self, run: list[Bucket]) -> int:
        lo = min(self.spans[b.order][0] for b in run)
        hi = max(self.spans[b.order][1] for b in run)
        return self.prefix[hi + 1] - self.prefix[lo]


def split_buckets(group: FlatParamGroup, bucket_numel: int) -> list[tuple[int, int, tuple[int, ...], int]]:
    """Split ``group`` into buckets of whole parameters, walking backwards (backward produces the
    last parameters first). Returns ``(start, end, slot indices, first slot index)``;
    the caller assigns the global launch order."""
    buckets = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(group.slots))):
        current.append(i)
        size += group.slots[i].numel
        if size >= bucket_numel:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    out = []
    for idx in buckets:
        lo, hi = min(idx), max(idx)
        start = group.slots[lo].offset
        end = group.slots[hi].offset + group.slots[hi].numel
        if hi == len(group.slots) - 1:
            end = group.padded_numel  # the padding rides with the last bucket
        out.append((start, end, tuple(sorted(idx)), lo))
    return out


def plan_buckets(groups: list[FlatParamGroup], names: dict[nn.Parameter, str],
                 bucket_numel: int) -> tuple[list[Bucket], ModuleOrder]:
    """The gradient buckets of ``groups`` in launch order, the same on every rank (Note [fixed launch order] in
    grad_reducer.py), and where each sits in module order (``names`` is in module order)."""
    position = {p: i for i, p in enumerate(names)}  # module order
    raw = []
    for gi, g in enumerate(groups):
        for start, end, slots, first in split_buckets(g, bucket_numel):
            raw.append((position[g.slots[first].param], gi, start, end, slots))
    # A bucket is complete when its first-registered parameter reports, which backward
    # reaches last: launch first the bucket whose first parameter comes latest in the module.
    raw.sort(key=lambda r: -r[0])
    # where each bucket's gradients arrive: its span in module order (Note [owner-major message])
    prefix = [0]
    for p in names:
        prefix.append(prefix[-1] + p.numel())
    spans = []
    for _, gi, _, _, slots in raw:
        where = [position[groups[gi].slots[s].param] for s in slots]
        spans.append((min(where), max(where)))
    buckets = [Bucket(gi, start, end, slots, order) for order, (_, gi, start, end, slots) in enumerate(raw)]
    return buckets, ModuleOrder(tuple(spans), tuple(prefix))


def plan_messages(buckets: list[Bucket], groups: list[FlatParamGroup], bucket_numel: int, merge: bool,
                  world_size: int, order: ModuleOrder | None = None) -> list[Message]:
    """Messages in launch order; ``merge``: consecutive buckets share a message while it stays within
    ``bucket_numel`` elements and (given ``order``) its span (Note [owner-major message]), else one each."""
    runs: list[list[Bucket]] = []
    size = 0
    for b in buckets:  # already in launch order
        n = b.end - b.start
        fits = bool(runs) and merge and size + n <= bucket_numel
        if fits and order is not None:
            fits = order.span_numel([*runs[-1], b]) <= 2 * (size + n)
        if fits:
            runs[-1].append(b)
            size += n
        else:
            runs.append([b])
            size = n
    return [_layout(run, groups, world_size) for run in runs]


class BufferPool:
    """Buffers handed out and given back (Note [reused buffers])."""

    def __init__(self, dtype: torch.dtype, device: torch.device, keep: int) -> None:
        self.dtype, self.device, self.keep = dtype, device, keep
        self.idle: list[torch.Tensor] = []
        self.allocations = 0  # buffers allocated, ever (a test reads it)

    def take(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements (uninitialised) of the smallest idle buffer that has them and at most
        twice as many, or of a new buffer; the buffer itself is the view's ``_base``."""
        fits = [b for b in self.idle if numel <= b.numel() <= 2 * numel]
        if fits:
            buffer = min(fits, key=torch.Tensor.numel)
            self.idle = [b for b in self.idle if b is not buffer]
        else:
            self.allocations += 1
            buffer = torch.empty(max(numel, 1), dtype=self.dtype, device=self.device)
        return buffer[:numel]

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for reuse, dropping the smallest idle one beyond ``keep``."""
        self.idle.append(buffer)
        if len(self.idle) > self.keep:
            smallest = min(self.idle, key=torch.Tensor.numel)
            self.idle = [b for b in self.idle if b is not smallest]

    def release(self) -> None:
        self.idle = []


class MessageStaging:
    """The messages of stages 2-3 and their staging and receive buffers (Notes above).

    Args:
        buckets: the buckets, in launch order; groups: their flat groups.
        bucket_numel: ``reduce_bucket_size``; merge: merge buckets into messages (the owner exchange).
        rank, world_size: this rank in the data-parallel group; dtype: the reduction dtype.
        in_flight: messages reduced at once (idle buffers kept: that many receive, one more staging);
        order: the buckets' places in module order (Note [owner-major message]).
    """

    def __init__(self, buckets: list[Bucket], groups: list[FlatParamGroup], bucket_numel: int, merge: bool,
                 rank: int, world_size: int, dtype: torch.dtype, in_flight: int,
                 order: ModuleOrder | None = None) -> None:
        self.groups = groups
        self.messages = plan_messages(buckets, groups, bucket_numel, merge, world_size, order)
        self.message_of = {o: i for i, m in enumerate(self.messages) for o in m.buckets}
        self._segments = {o: [s for s in m.segments if s.bucket == o] for m in self.messages for o in m.buckets}
        device = groups[0].device if groups else torch.device("cpu")
        self.staging_pool = BufferPool(dtype, device, keep=in_flight + 1)
        self.receive_pool = BufferPool(dtype, device, keep=in_flight)
        self.staging: dict[int, torch.Tensor] = {}  # message index -> its staging buffer, while filling

    def write(self, bucket: Bucket, start: int, end: int, grad: torch.Tensor | None, first: bool) -> None:
        """Write (``first``), add, or with ``grad`` None zero, the group elements ``[start, end)`` of ``bucket``
        in its message's staging buffer; ``grad`` is 1-D from ``start``."""
        index = self.message_of[bucket.order]
        staging = self.staging.get(index)
        if staging is None:
            staging = self.staging[index] = self.staging_pool.take(self.messages[index].numel)
        for seg in self._segments[bucket.order]:
            lo, hi = overlap(start, end, seg.start, seg.end)
            if hi <= lo:
                continue
            dest = staging[seg.offset + lo - seg.start : seg.offset + hi - seg.start]
            if grad is None:
                dest.zero_()
            elif first:
                dest.copy_(grad[lo - start : hi - start])
            else:
                dest.add_(grad[lo - start : hi - start])

    def complete(self, index: int, buckets: list[Bucket], reported: set) -> torch.Tensor:
        """The staging buffer of message ``index``, taken out, with the slots of parameters not in ``reported``
        and the padding zeroed (a reused buffer holds stale values there)."""
        for o in self.messages[index].buckets:
            b = buckets[o]
            slots = self.groups[b.group_index].slots
            covered = b.start
            for s in b.slots:
                slot = slots[s]
                if slot.param not in reported:
                    self.write(b, slot.offset, slot.offset + slot.numel, None, True)
                covered = max(covered, slot.offset + slot.numel)
            if covered < b.end:
                self.write(b, covered, b.end, None, True)
        return self.staging.pop(index)

    def release(self) -> None:
        """End of a step: no staging left, no idle buffer kept."""
        self.staging.clear()
        self.staging_pool.release()
        self.receive_pool.release()

    def filling(self) -> list[torch.Tensor]:
        """The staging buffers of the messages filling now."""
        return [t._base if t._base is not None else t for t in self.staging.values()]

    def idle(self) -> list[torch.Tensor]:
        """The buffers kept for the next messages (Note [reused buffers])."""
        return [*self.staging_pool.idle, *self.receive_pool.idle]


class GradShards:
    """This rank's reduced gradient shard of each group (stages 2-3; Note [written shard]); with a ``home``, the
    shards live there (swap files) and are written through it."""

    def __init__(self, groups: list[FlatParamGroup], buckets: list[Bucket], dtype: torch.dtype,
                 home: GradHome | None = None) -> None:
        self.groups, self.buckets, self.dtype, self.home = groups, buckets, dtype, home
        # one per group, allocated by the first reduction into it, so setup holds no gradient memory
        self.tensors: list[torch.Tensor | None] = [None] * len(groups)
        self.written: set[int] = set()  # bucket orders whose part is written since forget()

    def get(self, group_index: int) -> torch.Tensor:
        shard = self.tensors[group_index]
        if shard is None:
            g = self.groups[group_index]
            shard = (self.home.tensor(group_index, g.shard_numel, self.dtype) if self.home is not None
                     else torch.empty(g.shard_numel, dtype=self.dtype, device=g.device))
            self.tensors[group_index] = shard
        return shard

    def write(self, message: Message, rank: int, terms_of: Callable[[Segment, int], list[torch.Tensor]]) -> None:
        """This rank's parts of a reduced message; ``terms_of(segment, offset in this rank's part)``: the
        parts to add, in rank order."""
        base = message.owner_ranges[rank][0]
        for seg in message.segments:
            if seg.owner != rank:
                continue
            own_start = self.groups[seg.group_index].shard_range()[0]
            terms, first = terms_of(seg, seg.offset - base), seg.bucket not in self.written
            if self.home is not None:
                self.get(seg.group_index)
                self.home.accumulate(seg.group_index, seg.start - own_start, terms, first)
                continue
            target = self.get(seg.group_index)[seg.start - own_start : seg.end - own_start]
            sum_in_rank_order(terms, target, first)
        self.written.update(message.buckets)

    def read(self, group_index: int) -> torch.Tensor:
        """The shard, its parts no reduction wrote since :meth:`forget` zeroed."""
        own_start, own_end = self.groups[group_index].shard_range()
        for b in self.buckets:
            if b.group_index != group_index or b.order in self.written:
                continue
            lo, hi = overlap(b.start, b.end, own_start, own_end)
            if hi > lo:
                if self.home is not None:
                    self.get(group_index)
                    self.home.zero(group_index, lo - own_start, hi - own_start)
                else:
                    self.get(group_index)[lo - own_start : hi - own_start].zero_()
            self.written.add(b.order)
        return self.get(group_index)

    def forget(self) -> None:
        self.written.clear()
