"""The 1-bit compressed all-reduce (mean) with error feedback on workers and servers.

Communication plan, for a flat fp32 vector of ``n`` elements on N data-parallel ranks (``n`` a
multiple of 8N, so every chunk packs into whole bytes; :func:`padded_numel`):

1. **Worker.** Each rank splits its vector into N equal chunks and compresses chunk q plus its
   worker residual for q (Note [error feedback] in compression.py) to packed signs and one scale.
2. **All-to-all.** Chunk q goes to rank q, the *server* of chunk q: each rank sends
   (N-1)/N · (n/8 + 4N) bytes.
3. **Server.** Rank q averages the N decompressed chunks it received, adds its server residual,
   and compresses the mean again.
4. **All-gather.** Every server's compressed chunk goes to every rank ((N-1)/N · (n/8 + 4N) bytes
   sent), which decompresses all N chunks into the result: the same vector on every rank.

Against an fp32 ring all-reduce (2(N-1)/N · 4n bytes) that is about 32x fewer bytes. At world
size 1 nothing is sent and the vector is returned as it is (no compression without a wire).
"""

from __future__ import annotations

import torch

from lightning_zero.core.comm.compression import Compressed, ErrorFeedback
from lightning_zero.core.comm.data_parallel import DataParallelComm

_SCALE_BYTES = 4  # one fp32 scale travels after each chunk's packed signs


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of 8 · ``world_size`` (whole bytes of signs per chunk)."""
    unit = 8 * world_size
    return -(-numel // unit) * unit


def _to_message(c: Compressed) -> torch.Tensor:
    return torch.cat([c.signs, c.scale.float().view(torch.uint8)])


def _from_message(message: torch.Tensor) -> Compressed:
    return Compressed(message[:-_SCALE_BYTES], message[-_SCALE_BYTES:].view(torch.float32))


class CompressedAllReduce:
    """The mean of a flat vector over ``comm``'s ranks, sent as 1-bit signs (see the module doc).

    Args:
        numel: length of the vectors reduced (a multiple of 8 · world size: :func:`padded_numel`).
        comm: the data-parallel group.
        error_feedback: keep the worker and server residuals (``False``: the ablation).
    """

    def __init__(self, numel: int, comm: DataParallelComm, error_feedback: bool = True) -> None:
        n = comm.world_size
        if numel % (8 * n):
            raise ValueError(f"CompressedAllReduce needs a length that is a multiple of {8 * n}, got {numel}")
        self.comm = comm
        self.chunk = numel // n  # elements each rank serves
        device = comm.device
        self.worker = [ErrorFeedback(self.chunk, error_feedback, device) for _ in range(n)]  # one per server
        self.server = ErrorFeedback(self.chunk, error_feedback, device)  # this rank's chunk
        self.last_bytes_sent = 0  # bytes the last call sent (ring model, as comm.bytes_sent)

    @torch.no_grad()
    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """The compressed mean of ``flat`` over the ranks (fp32, the same on every rank)."""
        comm, n = self.comm, self.comm.world_size
        if not comm.active:
            return flat.float().clone()
        before = comm.bytes_sent
        chunks = flat.float().view(n, self.chunk)
        outgoing = [_to_message(self.worker[q].compress(chunks[q])) for q in range(n)]
        incoming = [torch.empty_like(m) for m in outgoing]
        comm.all_to_all(incoming, outgoing)
        mean = torch.zeros(self.chunk, dtype=torch.float32, device=flat.device)
        for message in incoming:
            mean.add_(_from_message(message).decompress())
        mean.div_(n)
        served = _to_message(self.server.compress(mean))
        gathered = torch.empty(n * served.numel(), dtype=torch.uint8, device=flat.device)
        comm.all_gather(gathered, served)
        out = torch.cat([_from_message(m).decompress() for m in gathered.view(n, -1)])
        self.last_bytes_sent = comm.bytes_sent - before
        return out

    def residuals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(worker residuals, N chunks end to end; server residual of this rank's chunk)."""
        return torch.cat([w.residual for w in self.worker]), self.server.residual

    @torch.no_grad()
    def load_residuals(self, worker: torch.Tensor, server: torch.Tensor) -> None:
        for w, part in zip(self.worker, worker.view(len(self.worker), -1)):
            w.residual.copy_(part)
        self.server.residual.copy_(server)
