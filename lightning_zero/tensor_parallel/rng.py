"""Dropout randomness under tensor parallelism: one stream where activations are replicated, one per TP
rank where they are split.

Note [dropout streams]
    Every rank of a TP group runs the same replicated computation with the same seed and the same tensor
    shapes, so the default generator stays identical across the group: dropout on replicated activations
    (after a row-parallel layer, on the embeddings) draws the same mask on every TP rank, as it must.
    Dropout on split activations (attention probabilities of this rank's heads) must differ between TP
    ranks, or head ``h`` and head ``h + heads/tp`` would share a mask: inside ``split_region_rng`` the
    default generator is swapped for this TP rank's own stream (seeded from the run's seed and the TP
    rank), whose state is kept across steps, and swapped back after (Megatron's RNG tracker). Masks are
    therefore not the unsplit model's: parity holds at dropout 0, as for any change of layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

SPLIT_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel stream


class SplitRegionRNG:
    """This TP rank's dropout stream for split activations (Note [dropout streams])."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._states: dict[torch.device, torch.Tensor] = {}

    def _default(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    def _set_default(self, device: torch.device, state: torch.Tensor) -> None:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        if device not in self._states:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._states[device] = gen.get_state()
        outside = self._default(device)
        self._set_default(device, self._states[device])
        try:
            yield
        finally:
            self._states[device] = self._default(device)
            self._set_default(device, outside)


def split_region_rng(module: nn.Module) -> Any:
    """The split stream of a column-parallel ``module`` (its ``tp_rng``), or no change for any other module."""
    rng: SplitRegionRNG | None = getattr(module, "tp_rng", None)
    if rng is None:
        return nullcontext()
    return rng.fork(next(module.parameters()).device)
