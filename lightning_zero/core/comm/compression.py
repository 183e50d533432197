"""1-bit sign compression with a scale, and error feedback: the arithmetic of compressed collectives.

A float vector ``x`` of ``n`` elements (``n`` a multiple of 8) is sent as its signs, packed eight
per byte, plus one fp32 scale ``||x||_2 / sqrt(n)`` (so the decompressed vector ``scale * sign(x)``
has the same norm as ``x``). Zero counts as positive: a bit can only say "+" or "-".

Note [error feedback]
    Compression loses ``x - decompress(compress(x))``. Error feedback keeps that residual and adds
    it to the next vector compressed through the same channel, so over steps nothing is lost: the
    sum of what was sent equals the sum of what was meant, minus the residual still held (which
    stays bounded). :class:`ErrorFeedback` owns one such residual. 1-bit Adam keeps two per rank:
    one for what the rank sends as a worker, one for the chunk it averages as a server
    (``compressed_allreduce.py``).

Pure torch; no process group (unit-tested on one rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of a 1-D tensor (``x >= 0`` is a 1 bit), eight per ``uint8``, element 0 in the low bit."""
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(f"pack_signs needs a 1-D tensor whose length is a multiple of 8, got shape {tuple(x.shape)}")
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ±1 vector :func:`pack_signs` packed (``8 * len(packed)`` elements)."""
    bits = (packed.view(-1, 1) & _BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.view(-1).to(dtype).mul_(2).sub_(1)


@dataclass(frozen=True)
class Compressed:
    """What travels: packed signs and one scale."""

    signs: torch.Tensor  # uint8, numel / 8 bytes
    scale: torch.Tensor  # fp32 scalar (shape ``(1,)``)

    @property
    def nbytes(self) -> int:
        return self.signs.numel() * self.signs.element_size() + self.scale.numel() * self.scale.element_size()

    def decompress(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return unpack_signs(self.signs, dtype).mul_(self.scale.to(dtype))


def compress(x: torch.Tensor) -> Compressed:
    """1-bit compression of a 1-D tensor (length a multiple of 8)."""
    scale = (torch.linalg.vector_norm(x.float()) / math.sqrt(max(x.numel(), 1))).reshape(1)
    return Compressed(pack_signs(x), scale)


class ErrorFeedback:
    """One compression channel with its residual (Note [error feedback]).

    Args:
        numel: length of the vectors sent through the channel (a multiple of 8).
        enabled: ``False`` drops the residual (plain 1-bit compression: the ablation).
        device: where the residual lives.
    """

    def __init__(self, numel: int, enabled: bool = True, device: torch.device | str = "cpu") -> None:
        self.enabled = enabled
        self.residual: torch.Tensor = torch.zeros(numel, dtype=torch.float32, device=device)  # fp32, what was lost

    @torch.no_grad()
    def compress(self, x: torch.Tensor) -> Compressed:
        """Compress ``x`` plus the held residual; keep what this compression loses."""
        target = x.float() + self.residual if self.enabled else x.float()
        sent = compress(target)
        if self.enabled:
            self.residual.copy_(target - sent.decompress())
        return sent
