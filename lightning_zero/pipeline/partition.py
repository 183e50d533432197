"""Partitioning an ordered sequence of layers into contiguous pipeline chunks.

Methods (DeepSpeed's ``partition_method``): ``uniform`` balances layer counts, ``parameters``
balances parameter counts (each distinct parameter counted once, where it is first used), and
``type:<regex>`` balances the number of layers whose class name matches the regex (the others
ride along with the nearest matching layer before them). Chunks are contiguous and non-empty;
the split minimises the heaviest chunk (exact, by binary search over the bound). Chunk ``c`` runs on stage
``c % stages``: a stage runs chunks ``stage + k * stages`` for ``k < virtual_stages``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from lightning_zero.core.settings.pipeline import PipelineConfig


def layer_weights(layers: Sequence[nn.Module], method: str) -> list[int]:
    """The weight each layer contributes to its chunk under ``method``."""
    if method == "uniform":
        return [1] * len(layers)
    if method == "parameters":
        seen: set[int] = set()
        out = []
        for layer in layers:
            fresh = [p for p in layer.parameters() if id(p) not in seen]
            seen.update(id(p) for p in fresh)
            out.append(sum(p.numel() for p in fresh))
        return out
    if method.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [1 if pattern.search(type(layer).__name__) else 0 for layer in layers]
        if not any(weights):
            names = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(f"partition_method {method!r} matches no layer class; the classes are {names}.")
        return weights
    raise ValueError(f"partition_method must be 'uniform', 'parameters' or 'type:<regex>', got {method!r}.")


def partition(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries ``b`` (length ``parts + 1``, ``b[0] = 0``, ``b[-1] = len(weights)``) of contiguous,
    non-empty chunks that minimise the heaviest chunk; ties keep earlier chunks light."""
    n = len(weights)
    if parts > n:
        raise ValueError(
            f"The model has {n} pipeline layers, fewer than the {parts} pipeline chunks (stages x virtual_stages): "
            "every chunk needs a layer. Fix: fewer pipeline stages / virtual_stages, or split the model into more "
            "layers in `pipeline_layers()`."
        )

    def split(bound: int) -> list[int] | None:
        # greedy from the end keeps the first chunks light (the first stage also holds the inputs)
        bounds, total, end = [n], 0, n
        for i in range(n - 1, -1, -1):
            if total + weights[i] > bound and i + 1 < end:
                bounds.append(i + 1)
                end, total = i + 1, 0
            total += weights[i]
        bounds.append(0)
        bounds = sorted(set(bounds))
        return bounds if len(bounds) - 1 <= parts else None

    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if split(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = split(lo) or [0, n]
    # fewer chunks than asked (light layers): split the largest chunks until every chunk exists
    while len(bounds) - 1 < parts:
        sizes = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        size, i = max(sizes)
        bounds.insert(i + 1, bounds[i] + size // 2)
    return bounds


def stages_of(layers: Sequence[nn.Module], bounds: list[int],
               config: PipelineConfig) -> dict[nn.Parameter, set[int]]:
    """Every parameter of ``layers`` -> the stages whose chunks use it."""
    stages_of: dict[nn.Parameter, set[int]] = {}
    for c in range(config.chunks):
        for layer in layers[bounds[c] : bounds[c + 1]]:
            for p in layer.parameters():
                stages_of.setdefault(p, set()).add(c % config.stages)
    return stages_of


def stage_layers(config: PipelineConfig, stage: int, bounds: list[int]) -> tuple[list[int], list[int]]:
    """``stage``'s chunks (in schedule order) and the indices of their layers."""
    chunk_ids = [stage + k * config.stages for k in range(config.virtual_stages)]
    return chunk_ids, [i for c in chunk_ids for i in range(bounds[c], bounds[c + 1])]
