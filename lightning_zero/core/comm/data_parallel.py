"""Collectives over one explicit data-parallel group.

Every method works without a process group (world size 1): then nothing is communicated, so the
core is unit-tested in one process. The data-parallel group is always passed explicitly and never
assumed to be the world (pipeline stages will make it a sub-group).

Exposed communication: :attr:`DataParallelComm.wait_seconds` adds up the host time spent blocked in
this group's collectives (blocking calls, and ``wait()`` on the handles of asynchronous ones). On a
CPU backend (gloo) that is the time the rank could not compute because of communication; with NCCL
``wait()`` only orders CUDA streams, so the counter says nothing there (docs/monitoring.md).

Traffic: :attr:`DataParallelComm.bytes_sent` adds up the bytes this rank sends, counted as the
bandwidth-optimal (ring) algorithms send them: an all-reduce of B bytes sends 2(N-1)/N·B, a
reduce-scatter, all-gather or all-to-all (N-1)/N of its whole buffer, a broadcast (N-1)/N·B on
average. It is a model of the wire, the same for every collective, so that stages and compressed
collectives (``compressed_allreduce.py``) compare on one scale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist

from lightning_zero.core.comm.deferred import DONE, DeferredFlags, Handle, defer, forget_pending, settle_pending
from lightning_zero.core.common.choices import Collective
from lightning_zero.core.reliability.progress_record import RECORD


def _all_gather_single(output: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup | None,
                       async_op: bool) -> Handle | None:
    """torch's gather into one tensor, by its current name: torch 2.13 renamed ``all_gather_into_tensor``
    to ``all_gather_single`` and warns (FutureWarning) on every call of the old name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, piece, group=group, async_op=async_op)


def _reduce_scatter_single(output: torch.Tensor, whole: torch.Tensor, group: dist.ProcessGroup | None,
                           async_op: bool) -> Handle | None:
    """torch's reduce-scatter of one tensor, by its current name (``reduce_scatter_tensor`` before 2.13)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, whole, group=group, async_op=async_op)


def backend_device(backend: str) -> torch.device:
    """Where a group of ``backend`` takes the tensors of its collectives: NCCL only talks to the current GPU;
    gloo (and one process without a group, ``"none"``) to the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """:func:`backend_device` of ``group``'s backend (the CPU without an initialised process group)."""
    return backend_device(str(dist.get_backend(group)) if dist.is_available() and dist.is_initialized() else "none")


class _AllOf:
    """One handle for several in-flight collectives."""

    def __init__(self, works: list[Handle]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Timed:
    """The handle of an asynchronous collective whose ``wait()`` counts into ``comm.wait_seconds``."""

    def __init__(self, work: Handle, comm: DataParallelComm) -> None:
        self.work, self.comm = work, comm
        self.seq, self.kind = RECORD.seq, RECORD.kind  # the collective just issued (Note [progress record])
        RECORD.track(self.seq, self.kind, work)

    def wait(self) -> object:
        with self.comm.blocking(), RECORD.waiting(self.seq, self.kind):
            return self.work.wait()

    def is_completed(self) -> bool:
        return bool(self.work.is_completed()) if hasattr(self.work, "is_completed") else True


class DataParallelComm:
    """The data-parallel group and the collectives the ZeRO core needs.

    Args:
        group: the data-parallel process group (``None``: the default group when one is
            initialised, otherwise a single rank with no communication).
        collective: see :class:`~lightning_zero.core.settings.zero.ZeroConfig`.
        expert_data: with expert parallelism, the collectives over the ranks holding this rank's experts (the
            expert-data group, Note [expert axes] in core/mesh/dims.py), which the experts' flat groups use
            (:meth:`of`); ``None``: no expert partition.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, collective: Collective = "auto",
                 expert_data: DataParallelComm | None = None) -> None:
        self.group = group
        self.collective: Collective = Collective.of(collective, "collective")  # the engine checks its config's
        self.expert_data = expert_data
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size: int = dist.get_world_size(group) if initialized else 1  # ranks in the DP group
        self.rank: int = dist.get_rank(group) if initialized else 0  # this rank's index in the DP group
        backend = dist.get_backend(group) if initialized else "none"
        self.backend: str = str(backend)
        self.device: torch.device = backend_device(self.backend)  # where small control tensors (flags, norms) live
        # gloo's all-reduce is faster than its reduce-scatter + all-gather (docs/benchmarks.md).
        self.use_all_reduce: bool = collective == "all_reduce" or (collective == "auto" and self.backend == "gloo")
        # stages 2-3 on gloo with "auto": gradients go to their owners point to point (exchange_to_owners)
        self.use_owner_exchange: bool = collective == "auto" and self.backend == "gloo"
        self.wait_seconds: float = 0.0  # host time blocked in this group's collectives, ever (see the module doc)
        self.bytes_sent: int = 0  # bytes this rank sent, ever, under the ring model (see the module doc)

    def of(self, experts: bool) -> DataParallelComm:
        """The collectives of a flat group: the expert-data group's for the experts' (``experts``), else these."""
        if experts and self.expert_data is None:
            raise ValueError("a flat group of expert parameters needs the expert-data group: build the comm with "
                             "expert_data=DataParallelComm(<the expert-data group>)")
        return self.expert_data if experts and self.expert_data is not None else self

    def _count(self, tensor: torch.Tensor, hops: int) -> None:
        """Add ``hops``/N of ``tensor``'s bytes to :attr:`bytes_sent` (2(N-1) for an all-reduce, else N-1)."""
        self.bytes_sent += tensor.numel() * tensor.element_size() * hops // self.world_size

    def close(self) -> None:
        """Destroy this comm's process group now and stop communicating (world size 1 from here on).
        Only for a group this comm's owner created (``owned_groups``); Note [clean exit] in
        ``core/comm/process_groups.py``."""
        group, self.group = self.group, None
        forget_pending(group)  # their peers are gone with the group
        self.world_size, self.rank = 1, 0
        if group is not None and dist.is_available() and dist.is_initialized():
            with suppress(ValueError):  # already destroyed (e.g. destroy_process_group() of everything)
                dist.destroy_process_group(group)

    @contextmanager
    def blocking(self, kind: str = "") -> Iterator[None]:
        """Count the time spent in the block into :attr:`wait_seconds`; ``kind``: the block issues that
        collective, recorded for the hang watchdog (Note [progress record] in core/reliability/progress_record.py),
        after the deferred agreements are settled (Note [deferred agreement])."""
        if kind:
            settle_pending()
        start = time.perf_counter()
        try:
            if kind:
                with RECORD.collective(kind):
                    yield
            else:
                yield
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _issued(self, work: Handle | None, async_op: bool) -> Handle:
        return _Timed(work, self) if async_op and work is not None else DONE

    @property
    def active(self) -> bool:
        """Whether there is anyone to talk to."""
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False) -> Handle:
        if not self.active:
            return DONE
        self._count(tensor, 2 * (self.world_size - 1))
        with self.blocking("all_reduce"):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return self._issued(work, async_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Element-wise maximum over the ranks, in place (blocking)."""
        if self.active:
            self._count(tensor, 2 * (self.world_size - 1))
            with self.blocking("all_reduce (max)"):
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def extremes(self, value: int) -> tuple[int, int]:
        """``(largest, smallest)`` of ``value`` over the ranks: one all-reduce MAX of ``[v, -v]``.

        The same on every rank, so ``largest != smallest`` tells every rank at once that the ranks disagree.
        """
        both = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self.all_reduce_max(both)
        return int(both[0].item()), -int(both[1].item())

    def reduce_scatter_pieces(
        self, out: torch.Tensor, pieces: Sequence[torch.Tensor], async_op: bool = False
    ) -> Handle:
        """Sum ``pieces[r]`` over ranks into rank r's ``out``; pieces may differ in size."""
        if not self.active:
            out.copy_(pieces[0])
            return DONE
        self.bytes_sent += sum(p.numel() * p.element_size() for i, p in enumerate(pieces) if i != self.rank)
        with self.blocking("reduce_scatter"):
            if all(p.numel() == pieces[0].numel() for p in pieces):
                work = _reduce_scatter_single(out, torch.cat(list(pieces)) if len(pieces) > 1 else pieces[0],
                                              self.group, async_op)
            else:
                work = dist.reduce_scatter(out, list(pieces), group=self.group, async_op=async_op)
        return self._issued(work, async_op)

    def exchange_to_owners(self, pieces: Sequence[torch.Tensor], received: Sequence[torch.Tensor],
                           tag: int = 0) -> Handle:
        """Point-to-point half of a reduce-scatter (asynchronous): ``pieces[q]`` goes to rank q and rank q's
        piece for this rank arrives in ``received[q]``, for every other rank q (this rank's entries are not
        touched). Empty pieces are skipped on both sides, so every rank passes the sizes its peers expect.
        The caller adds the parts up in rank order (Note [owner exchange] in ``core/zero/exchange.py``).
        Sends (N-1)/N of a whole message, half of what a ring all-reduce sends."""
        if not self.active:
            return DONE
        works: list[Handle] = []
        with self.blocking("send/recv (gradient exchange)"):
            for q in range(self.world_size):
                if q == self.rank:
                    continue
                if pieces[q].numel():
                    self.bytes_sent += pieces[q].numel() * pieces[q].element_size()
                    works.append(dist.isend(pieces[q], dst=self._global_rank(q), group=self.group, tag=tag))
                if received[q].numel():
                    works.append(dist.irecv(received[q], src=self._global_rank(q), group=self.group, tag=tag))
        return self._issued(_AllOf(works), async_op=True)

    def all_gather_flat(self, flat: torch.Tensor, start: int, end: int, async_op: bool = False,
                        source: torch.Tensor | None = None) -> Handle:
        """Make ``flat`` whole on every rank from each rank's ``flat[start:end]`` (equal shards).

        Args:
            flat: the whole buffer; start, end: this rank's range of it.
            async_op: return a handle instead of waiting.
            source: this rank's shard, when it is not in ``flat[start:end]`` yet: the collective sends it from
                there and this call writes it into ``flat[start:end]`` (Note [gather from the shard]). It must
                not change until the handle is waited on.

        Note [gather from the shard]
            Gathering a stage-3 unit used to copy this rank's shard into the whole buffer before the
            collective started. Given ``source``, gloo's broadcasts start at once, this rank's own from the
            shard itself, and the shard is copied into its range while the peers' broadcasts run (the copy
            and the sends only read the shard; the receives write other ranges). ``all_gather_into_tensor``
            (NCCL) takes the shard as its input and writes every range itself, the own one included: no
            copy at all. Without peers (one rank) it is the copy alone.
        """
        if not self.active:
            if source is not None:
                flat[start:end].copy_(source)
            return DONE
        self._count(flat, self.world_size - 1)
        if self.use_all_reduce:
            # gloo: one broadcast per owner is measured ~1.8x faster than all_gather_into_tensor
            # (docs/benchmarks.md); the broadcasts run concurrently and are waited on together.
            size = end - start
            with self.blocking("all_gather"):
                works = [
                    dist.broadcast(source if r == self.rank and source is not None else flat[r * size : (r + 1) * size],
                                   src=self._global_rank(r), group=self.group, async_op=True)
                    for r in range(self.world_size)
                ]
                if source is not None:  # Note [gather from the shard]
                    flat[start:end].copy_(source)
                work: Handle | None = _AllOf(works)
                if not async_op:
                    work.wait()
        else:
            with self.blocking("all_gather"):
                work = _all_gather_single(flat, flat[start:end] if source is None else source, self.group, async_op)
        return self._issued(work, async_op)

    def all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Rank r's ``inputs[q]`` arrives in rank q's ``outputs[r]`` (equal-size pieces; blocking)."""
        if not self.active:
            outputs[0].copy_(inputs[0])
            return
        self.bytes_sent += sum(t.numel() * t.element_size() for i, t in enumerate(inputs) if i != self.rank)
        with self.blocking("all_to_all"):
            dist.all_to_all(outputs, inputs, group=self.group)

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor) -> None:
        """``out`` (N pieces end to end) gets every rank's ``piece``, in rank order (blocking)."""
        if not self.active:
            out.copy_(piece.reshape(out.shape))
            return
        self._count(out, self.world_size - 1)
        with self.blocking("all_gather"):
            _all_gather_single(out, piece, self.group, async_op=False)

    def _global_rank(self, dp_rank: int) -> int:
        return dist.get_global_rank(self.group, dp_rank) if self.group is not None else dp_rank

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        if self.active:
            self._count(tensor, self.world_size - 1)
            with self.blocking("broadcast"):
                dist.broadcast(tensor, src=self._global_rank(src_rank), group=self.group)

    def broadcast_text(self, text: str | None, src_rank: int = 0) -> str:
        """``src_rank``'s string on every rank (as UTF-8 bytes in tensors: a length, then the bytes)."""
        if not self.active:
            return text or ""
        data = (text or "").encode() if self.rank == src_rank else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(length, src_rank)
        buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src_rank:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buffer, src_rank)
        return bytes(buffer.cpu().tolist()).decode()

    def ranks_with(self, flag: bool) -> list[int]:
        """All-gather one boolean per rank; returns the DP ranks where it is true (same on all)."""
        if not self.active:
            return [0] if flag else []
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(flag)
        self._count(flags, 2 * (self.world_size - 1))
        with self.blocking("all_reduce (flags)"):
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        return [r for r in range(self.world_size) if flags[r].item()]

    def raise_unless_same(self, value: int, what: str, fix: str) -> None:
        """Raise the same error on every rank when ``value`` differs between ranks."""
        if not self.active:
            return
        largest, smallest = self.extremes(value)
        if largest != smallest:
            raise ValueError(f"{what} differs between data-parallel ranks. {fix}")

    def ranks_with_later(self, flag: bool) -> DeferredFlags:
        """:meth:`ranks_with` without waiting: the all-reduce is issued now, its answer read later
        (Note [deferred agreement])."""
        flags = torch.zeros(max(self.world_size, 1), dtype=torch.int32, device=self.device)
        flags[self.rank] = int(flag)
        handle: Handle = DONE
        if self.active:
            self._count(flags, 2 * (self.world_size - 1))
            with self.blocking("all_reduce (step errors)"):
                handle = self._issued(dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                                      async_op=True)
        return DeferredFlags(flags, handle, self.group)

    @staticmethod
    def defer(pending: DeferredFlags) -> None:
        """Settle ``pending`` (raise its error) before this process next enters a collective of the strategy."""
        defer(pending)

    @staticmethod
    def settle_deferred() -> None:
        """Wait for the deferred agreements and raise the first one's error (Note [deferred agreement])."""
        settle_pending()
