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
    parameter). On a module whose activations are replicated (the GPT's ``ln_f``, on the residual stream
    before the column-parallel ``lm_head``) the same sum multiplies a gradient that is already whole by the
    TP size.

    Which activations a module acts on cannot be read from the module tree (a flat block holds its layer
    norms beside its split layers, as Qwen3's attention holds its q/k norms; a norm beside a column-parallel
    layer may feed it, as ``ln_f`` feeds ``lm_head``), so it is decided where it shows, from the tensors
    themselves, compared across the TP group by a fingerprint (sum and norm in float64, one small all-reduce,
    once per module or parameter):

    * a ``replicated_with_grad_allreduce`` module's input at its first forward: the same on every TP rank
      means replicated activations, and the fit stops on every rank before any step, with the fix;
    * at the first backward, every replicated parameter's gradient: a plain replicated parameter gets the
      same gradient bits on every TP rank (``copy_to_tp`` made the gradients flowing into the replicated
      region whole, Note [conjugate functions]), so one that differs acts on split activations and the step
      is refused with the fix; a summed parameter's gradient is compared before the sum, and one that is
      the same on every rank (not split) is refused too.

    A comparison whose tensors are not finite on some rank (an fp16 overflow) is inconclusive, and so is, for a
    summed parameter, one whose tensors are zero on every rank: the check waits for the next forward or
    backward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.checkpoint.slices import split_dim
from lightning_zero.tensor_parallel.collectives import TPGroup

FIX = ("plan its module 'replicated_with_grad_allreduce' (a whole parameter applied to each rank's own heads or "
       "features, e.g. Qwen3's per-head q_norm: its gradient is summed over the TP group), or split it")
NOT_SPLIT = ("its {what} is the same on every TP rank: it acts on replicated activations (e.g. a norm on the "
             "residual stream, before a column-parallel layer), so summing its gradient would multiply it by the TP "
             "size ({size}). Fix: plan it 'replicate' or leave it out of the plan")


class Across(enum.Enum):
    """How a tensor compares across the TP group (:func:`compare_across`)."""

    SAME = "same"
    DIFFERENT = "different"
    ZERO = "zero"
    """Zero on every rank: the same, but it says nothing of where the tensor comes from."""
    UNKNOWN = "unknown"
    """Not finite on some rank: ask again later."""


def compare_across(t: torch.Tensor, tp: TPGroup) -> Across:
    """Whether ``t`` is the same on every rank of the TP group, by its fingerprint (sum and norm in float64,
    without a float64 copy); one small all-reduce, the same answer on every rank."""
    g = t.detach()
    v = torch.stack([g.sum(dtype=torch.float64), torch.linalg.vector_norm(g, dtype=torch.float64)])
    finite = bool(torch.isfinite(v).all())
    v = v if finite else torch.zeros_like(v)
    flag = torch.tensor([0.0 if finite else 1.0], dtype=v.dtype, device=v.device)
    both = tp.all_reduce(torch.cat([v, -v, flag]), dist.ReduceOp.MAX)
    if both[-1] > 0:
        return Across.UNKNOWN
    if both[1] == 0:  # the largest norm: zero everywhere
        return Across.ZERO
    return Across.SAME if torch.equal(both[:2], -both[2:4]) else Across.DIFFERENT


def hook_replicated_grads(root: nn.Module, tp: TPGroup, summed: Sequence[tuple[str, nn.Module]]) -> None:
    """The hooks of Note [replicated parameters on split activations] on ``root`` once the plan has split it: the
    modules planned ``replicated_with_grad_allreduce`` (``summed``: their names and modules) get their gradients
    summed over the TP group (:func:`sum_grads_over_tp`), and every other replicated parameter's gradient is
    compared across the group at the first backward. Nothing on one rank."""
    if tp.size == 1:
        return
    seen: set[int] = set()  # ids of the parameters hooked: each once
    for name, module in summed:
        sum_grads_over_tp(module, tp, name)
        seen.update(id(p) for p in module.parameters())
    for name, param in root.named_parameters():
        if split_dim(param) is not None or id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        handle: list[RemovableHandle] = []
        handle.append(param.register_hook(_compare(name, tp, handle)))


def _compare(name: str, tp: TPGroup, handle: list[RemovableHandle]) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        verdict = compare_across(grad, tp)
        if verdict is Across.UNKNOWN:  # some rank's gradient is not finite: check the next backward
            return
        handle[0].remove()
        if verdict is Across.DIFFERENT:
            raise ValueError(
                f"tensor_parallel: the gradient of the replicated parameter {name!r} differs between the TP ranks "
                "of a group at the first backward: its module acts on split activations (e.g. a per-head norm "
                "after a column-parallel layer: each rank sees only its own heads), so its copies would drift "
                f"apart. Fix: {FIX}")

    return hook


def sum_grads_over_tp(module: nn.Module, tp: TPGroup, name: str) -> None:
    """Each parameter of ``module`` (planned ``replicated_with_grad_allreduce`` as ``name``) gets its gradient summed
    over the TP group as autograd produces it; its first forward's input and each parameter's first gradient,
    before the sum, must differ across the TP group (Note [replicated parameters on split activations]). Nothing
    on one rank."""
    if tp.size == 1:
        return
    where = f"tensor_parallel plan: {name!r} is planned 'replicated_with_grad_allreduce' but "
    forward: list[RemovableHandle] = []

    def first_input(mod: nn.Module, args: tuple[Any, ...]) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        verdict = Across.DIFFERENT if x is None else compare_across(x, tp)  # no tensor: the backward decides
        if verdict in (Across.UNKNOWN, Across.ZERO):
            return
        forward[0].remove()
        if verdict is Across.SAME:
            raise ValueError(where + NOT_SPLIT.format(what="input", size=tp.size))

    forward.append(module.register_forward_pre_hook(first_input))
    for pname, param in module.named_parameters():
        if param.requires_grad and split_dim(param) is None:  # a slice inside it (a planned child) is its own
            param.register_hook(_summed(f"{name}.{pname}", where, tp))


def _summed(pname: str, where: str, tp: TPGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    checked = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not checked[0]:
            verdict = compare_across(grad, tp)
            checked[0] = verdict not in (Across.UNKNOWN, Across.ZERO)
            if verdict is Across.SAME:
                raise ValueError(where + NOT_SPLIT.format(what=f"gradient of {pname!r} (before the sum)",
                                                          size=tp.size))
        return tp.all_reduce(grad.contiguous().clone())

    return hook
