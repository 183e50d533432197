"""Router statistics: what each MoE layer's routing did since it was last read (the dashboard's ``moe/*``).

Every routed call adds its kept assignments per expert and its dropped assignments, and keeps its auxiliary
and z losses; :func:`read_router_stats` sums the layers of a module and starts a new window. The numbers are
this rank's routing (its own tokens), as the monitor logs rank 0's loss; tensors stay on their device until
read, so recording costs no synchronisation. The monitor logs them (``moe/*``) with the layers' all-to-all bytes
(``traffic/all_to_all_bytes_per_step``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RouterStats:
    """One layer's routing since the last read.

    Args:
        num_experts: E (tokens per expert are counted by global expert index).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped = 0
        self.aux_loss: torch.Tensor | None = None  # the last call's, detached
        self.z_loss: torch.Tensor | None = None
        self.calls = 0

    def record(self, tokens_per_expert: torch.Tensor, dropped: int, aux_loss: torch.Tensor | None,
               z_loss: torch.Tensor | None) -> None:
        counts = tokens_per_expert.detach()
        self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        self.dropped += int(dropped)
        self.aux_loss = None if aux_loss is None else aux_loss.detach()
        self.z_loss = None if z_loss is None else z_loss.detach()
        self.calls += 1

    def reset(self) -> None:
        self.tokens_per_expert, self.dropped, self.aux_loss, self.z_loss, self.calls = None, 0, None, None, 0


def expert_groups(module: nn.Module | None) -> list[Any]:
    """The expert-parallel groups the MoE layers of ``module`` route through (their bytes sent: Note [all-to-all
    bytes] in dispatch.py); empty without expert parallelism."""
    if module is None:
        return []
    return [g for m in module.modules() if (g := getattr(m, "expert_group", None)) is not None and g.size > 1]


def router_stats_of(module: nn.Module) -> list[tuple[str, RouterStats]]:
    """Every MoE layer's statistics in ``module`` (by module name)."""
    return [(name, m.router_stats) for name, m in module.named_modules()
            if isinstance(getattr(m, "router_stats", None), RouterStats)]


def read_router_stats(module: nn.Module, reset: bool = True) -> dict[str, float]:
    """``moe/tokens_per_expert/<e>`` (summed over the layers), ``moe/dropped_tokens``, ``moe/aux_loss`` and
    ``moe/z_loss`` (the layers' mean of their last call), ``moe/load_imbalance`` (the busiest expert's tokens
    over the mean; 1 is balanced); empty when no layer routed since the last read."""
    layers = [s for _, s in router_stats_of(module) if s.calls]
    if not layers:
        return {}
    out: dict[str, float] = {}
    widest = max(s.num_experts for s in layers)
    counts = torch.zeros(widest, dtype=torch.float64)
    for s in layers:
        assert s.tokens_per_expert is not None
        counts[: s.num_experts] += s.tokens_per_expert.double().cpu()
    for e, c in enumerate(counts.tolist()):
        out[f"moe/tokens_per_expert/{e}"] = c
    out["moe/dropped_tokens"] = float(sum(s.dropped for s in layers))
    mean = float(counts.mean())
    out["moe/load_imbalance"] = float(counts.max()) / mean if mean > 0 else 0.0
    for key in ("aux_loss", "z_loss"):
        values = [float(getattr(s, key)) for s in layers if getattr(s, key) is not None]
        if values:
            out[f"moe/{key}"] = sum(values) / len(values)
    if reset:
        for s in layers:
            s.reset()
    return out
