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

    Which modules act on split activations cannot be read from the module tree in general, so the plan is
    checked by position: a module with parameters that sits beside (in the same parent as) a column-parallel
    layer with a split output and a row-parallel layer taking a split input is taken to act on the split
    activations, and must be planned ``replicated_with_grad_allreduce`` or split; an ``nn.Sequential`` is
    read in order instead (only the modules between the two layers). Unplanned, or planned ``"replicate"``,
    it is refused with the fix. Conversely ``replicated_with_grad_allreduce`` on a module with no
    column-parallel sibling is refused: there its gradient is already whole on every rank and summing it
    would multiply it by the TP size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.styles import Colwise, Replicate, ReplicateGradSum, Rowwise, Style

FIX = ("plan it 'replicated_with_grad_allreduce' (a whole parameter applied to each rank's own heads or "
       "features, e.g. Qwen3's per-head q_norm: its gradient is summed over the TP group), or split it")


def _splits_out(style: Style | None) -> bool:
    return isinstance(style, Colwise) and not style.gather_output


def _takes_split(style: Style | None) -> bool:
    return isinstance(style, Rowwise) and style.input_is_parallel


def _inside(parent: nn.Module, styles: dict[str, Style | None]) -> list[str]:
    """The children of ``parent`` (by name) that act on split activations (Note [replicated parameters on split
    activations]): between a split-output column layer and the next split-input row layer of an
    ``nn.Sequential``; in any other parent, every child beside both kinds."""
    if isinstance(parent, nn.Sequential):
        out, region = [], False
        for name in styles:
            if _splits_out(styles[name]):
                region, pending = True, []
            elif _takes_split(styles[name]) and region:
                out += pending
                region = False
            elif region:
                pending.append(name)
        return out
    if any(map(_splits_out, styles.values())) and any(map(_takes_split, styles.values())):
        return [n for n, s in styles.items() if not (_splits_out(s) or _takes_split(s))]
    return []


def check_split_regions(root: nn.Module, chosen: Mapping[str, Style], source: str) -> None:
    """Refuse a whole parameter left on split activations, and a gradient sum where none is split.

    Raises:
        ValueError: naming the module, the split layers beside it and the fix.
    """
    for prefix, parent in root.named_modules():
        children = {n: f"{prefix}.{n}" if prefix else n for n, _ in parent.named_children()}
        styles = {n: chosen.get(full) for n, full in children.items()}
        for name in _inside(parent, styles):
            module = getattr(parent, name)
            if isinstance(styles[name], ReplicateGradSum) or not any(True for _ in module.parameters()):
                continue
            if styles[name] is None or isinstance(styles[name], Replicate):
                col = next(children[n] for n, s in styles.items() if _splits_out(s))
                row = next(children[n] for n, s in styles.items() if _takes_split(s))
                how = "is planned 'replicate'" if styles[name] is not None else "is left whole (not in the plan)"
                raise ValueError(
                    f"tensor_parallel plan ({source}): {children[name]!r} ({type(module).__name__}) {how} but sits "
                    f"beside the split layers {col!r} and {row!r}, so it acts on their split activations and its "
                    f"gradient differs per TP rank: its copies would drift apart. Fix: {FIX}. If it only sees the "
                    f"replicated input, move it out of {prefix or type(root).__name__!r}")
        for name, style in styles.items():
            if isinstance(style, ReplicateGradSum) and not any(map(_splits_out, styles.values())):
                raise ValueError(
                    f"tensor_parallel plan ({source}): {children[name]!r} is planned 'replicated_with_grad_allreduce' "
                    "but no module beside it has a split output ('colwise'): its gradient is already the whole one "
                    "on every TP rank and summing it would multiply it by the TP size. Fix: plan it 'replicate' or "
                    "leave it out of the plan")


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
