"""Whole parameters inside a split region: modules that hold a whole (replicated) parameter but act on the split
activations between a column-parallel layer and the row-parallel layer after it.

Note [replicated parameters on split activations]
    Between a column-parallel layer (its output split: each TP rank holds its own heads or features) and the
    next row-parallel layer, every module sees only its rank's part of the activation. A whole parameter used
    there, such as Qwen3's and Gemma3's per-head ``q_norm`` / ``k_norm`` (one scale vector shared by all heads),
    gets on each rank the gradient of its own heads only: left replicated, the TP ranks step it with different
    gradients and its copies drift apart without any error. Hugging Face's ``"replicated_with_grad_allreduce"``
    (our :class:`ReplicateGradSum`) sums each such parameter's gradient over the TP group as autograd produces
    it (a hook on the parameter, before ZeRO or the precision plugin see the gradient), so every rank holds
    the unsplit model's gradient, the same bits everywhere (counted once in the norm, as any replicated
    parameter).

    Which modules act on split activations cannot be read from the module tree in general (a flat block holds
    its layer norms beside its split layers, as Qwen3's attention holds its q/k norms), so it is checked where
    it shows: at the first backward every replicated parameter's gradient is compared across the TP group (its
    sum and norm in float64, one small all-reduce per parameter, once), before the gradient
    accumulates. A replicated parameter gets the same gradient bits on every TP rank (``copy_to_tp`` made the
    gradients flowing into the replicated region whole, Note [conjugate functions]); one that does not acts on
    split activations, and the step is refused on every rank with the fix. A first backward whose gradients
    are not finite (an fp16 overflow) is inconclusive: the check waits for the next. Conversely
    ``replicated_with_grad_allreduce`` on a module with no column-parallel sibling is refused before
    anything changes: there its gradient is already whole on every rank and summing it would multiply it by
    the TP size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.checkpoint.slices import split_dim
from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.styles import Colwise, ReplicateGradSum, Style

FIX = ("plan its module 'replicated_with_grad_allreduce' (a whole parameter applied to each rank's own heads or "
       "features, e.g. Qwen3's per-head q_norm: its gradient is summed over the TP group), or split it")


def _splits_out(style: Style | None) -> bool:
    return isinstance(style, Colwise) and not style.gather_output


def check_split_regions(root: nn.Module, chosen: Mapping[str, Style], source: str) -> None:
    """Refuse ``replicated_with_grad_allreduce`` where nothing beside the module is split (Note [replicated
    parameters on split activations]).

    Raises:
        ValueError: naming the module and the fix.
    """
    for prefix, parent in root.named_modules():
        children = {n: f"{prefix}.{n}" if prefix else n for n, _ in parent.named_children()}
        styles = {n: chosen.get(full) for n, full in children.items()}
        for name, style in styles.items():
            if isinstance(style, ReplicateGradSum) and not any(map(_splits_out, styles.values())):
                raise ValueError(
                    f"tensor_parallel plan ({source}): {children[name]!r} is planned 'replicated_with_grad_allreduce' "
                    "but no module beside it has a split output ('colwise'): its gradient is already the whole one "
                    "on every TP rank and summing it would multiply it by the TP size. Fix: plan it 'replicate' or "
                    "leave it out of the plan")


def watch_replicated_grads(root: nn.Module, tp: TPGroup, summed: set[int]) -> None:
    """At the first backward, refuse a replicated parameter whose gradient differs across the TP group (Note
    [replicated parameters on split activations]); ``summed``: ids of those whose gradients are summed."""
    if tp.size == 1:
        return
    seen: set[int] = set()
    for name, param in root.named_parameters():
        if split_dim(param) is not None or id(param) in summed or id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        handle: list[RemovableHandle] = []
        handle.append(param.register_hook(_compare(name, tp, handle)))


def _compare(name: str, tp: TPGroup, handle: list[RemovableHandle]) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        g = grad.detach()  # a fingerprint in float64, without a float64 copy of the gradient
        v = torch.stack([g.sum(dtype=torch.float64), torch.linalg.vector_norm(g, dtype=torch.float64)])
        finite = bool(torch.isfinite(v).all())
        v = v if finite else torch.zeros_like(v)
        flag = torch.tensor([0.0 if finite else 1.0], dtype=v.dtype, device=v.device)
        both = tp.all_reduce(torch.cat([v, -v, flag]), dist.ReduceOp.MAX)
        if both[-1] > 0:  # some rank's gradient is not finite: inconclusive, check the next backward
            return
        handle[0].remove()
        if not torch.equal(both[:2], -both[2:4]):
            raise ValueError(
                f"tensor_parallel: the gradient of the replicated parameter {name!r} differs between the TP ranks "
                "of a group at the first backward: its module acts on split activations (e.g. a per-head norm "
                "after a column-parallel layer: each rank sees only its own heads), so its copies would drift "
                f"apart. Fix: {FIX}")

    return hook


def sum_grads_over_tp(module: nn.Module, tp: TPGroup) -> None:
    """Each parameter of ``module`` gets its gradient summed over the TP group as autograd produces it (Note
    [replicated parameters on split activations]); nothing on one rank."""
    if tp.size == 1:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(grad.contiguous().clone())

    for param in module.parameters():
        if param.requires_grad:
            param.register_hook(hook)
