"""The experts' matrix products over tokens sorted by expert: one grouped product per weight, not a loop.

Note [grouped experts]
    The rows of ``x`` are sorted by expert, ``counts[e]`` rows for expert e. ``grouped_matmul(x, w, counts)``
    multiplies each expert's rows by its own matrix ``w[e]`` (``w`` is [E, out, in], the layout of
    ``nn.Linear`` weights stacked, and of Hugging Face's 3-D expert parameters) in one call:

    * ``GroupedKernel.GROUPED_MM``: ``torch._grouped_mm`` with the groups' end offsets (no padding; on CPU in
      fp32 and bf16, on CUDA in bf16; both matrix sizes times the element size multiples of 16 bytes);
    * ``GroupedKernel.PADDED_BMM``: each expert's rows padded to the largest count, one ``bmm``, unpadded (any
      device and dtype; the padding costs what the imbalance costs);
    * ``GroupedKernel.LOOP``: one product per expert, the reference the others are tested against (and the
      slow path the benchmark compares with).

    Empty experts (zero rows) are fine in all three: a starved expert contributes nothing, and its weight's
    gradient is zero. ``expert_mlp`` runs a whole expert MLP (``down(act(up x))``, or the gated
    ``down(act(gate x) * up x)`` with the gate and up projections concatenated, as Hugging Face and the GPT's
    MoE store them) on the sorted rows, with optional per-expert biases.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


class GroupedKernel(enum.Enum):
    """How the grouped product is computed (Note [grouped experts])."""

    AUTO = "auto"
    GROUPED_MM = "grouped_mm"
    PADDED_BMM = "padded_bmm"
    LOOP = "loop"


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(size * x.element_size() % 16 for size in w.shape[1:]):  # its operands' strides: 16-byte multiples
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def resolve_kernel(kernel: GroupedKernel, x: torch.Tensor, w: torch.Tensor) -> GroupedKernel:
    """``AUTO``: ``torch._grouped_mm`` where it runs for this device, dtype and shape, else the padded ``bmm``."""
    if kernel is not GroupedKernel.AUTO:
        return kernel
    return GroupedKernel.GROUPED_MM if _grouped_mm_runs(x, w) else GroupedKernel.PADDED_BMM


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int],
                   kernel: GroupedKernel = GroupedKernel.AUTO) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e].T`` for every expert e (Note [grouped experts]).

    Args:
        x: [N, in], rows sorted by expert.
        w: [E, out, in].
        counts: rows per expert (E numbers summing to N).
        kernel: which implementation.
    """
    if len(counts) != w.shape[0]:
        raise ValueError(f"{len(counts)} counts for {w.shape[0]} experts")
    kernel = resolve_kernel(kernel, x, w)
    if kernel is GroupedKernel.GROUPED_MM:
        offsets = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w.transpose(-2, -1), offs=offsets))
    if kernel is GroupedKernel.PADDED_BMM:
        return _padded_bmm(x, w, counts)
    pieces = x.split(list(counts))
    return torch.cat([p @ w[e].t() for e, p in enumerate(pieces)]) if pieces else x.new_empty(0, w.shape[1])


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``torch._grouped_mm``'s backward refuses an expanded
    one (a ``sum()``'s gradient, strides 0)."""

    @staticmethod
    def forward(ctx: object, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)  # an empty one has strides 0 too


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    experts, longest = len(counts), max(counts, default=0)
    if longest == 0:
        return x.new_zeros(0, w.shape[1]) + (w.sum() * 0).to(x.dtype)  # keeps the graph to w
    slots = padded_slots(counts, longest, x.device)  # where each row sits in the padded [E, longest] layout
    padded = x.new_zeros(experts * longest, x.shape[1]).index_copy(0, slots, x)
    out = torch.bmm(padded.view(experts, longest, -1), w.transpose(-2, -1))
    return out.reshape(experts * longest, -1).index_select(0, slots)


def padded_slots(counts: Sequence[int], longest: int, device: torch.device) -> torch.Tensor:
    """Where each sorted row sits when every expert's rows are padded to ``longest``."""
    c = torch.tensor(counts, dtype=torch.long, device=device)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), c)
    first = torch.cumsum(c, 0) - c
    within = torch.arange(int(c.sum()), device=device) - torch.repeat_interleave(first, c)
    return expert * longest + within


def rows_bias(bias: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """[N, out]: each row's expert bias (``bias`` [E, out])."""
    c = torch.tensor(counts, dtype=torch.long, device=bias.device)
    return torch.repeat_interleave(bias, c, dim=0)


def expert_mlp(x: torch.Tensor, counts: Sequence[int], up: torch.Tensor, down: torch.Tensor,
               activation: Callable[[torch.Tensor], torch.Tensor], gated: bool,
               up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
               kernel: GroupedKernel = GroupedKernel.AUTO) -> torch.Tensor:
    """Every expert's MLP on its rows of ``x`` (Note [grouped experts]).

    Args:
        x: [N, H], sorted by expert.
        counts: rows per expert.
        up: [E, I, H], or gated [E, 2I, H] (gate rows first, then up).
        down: [E, H, I].
        activation: the element-wise activation.
        gated: ``down(act(gate x) * (up x))`` instead of ``down(act(up x))``.
        up_bias, down_bias: [E, 2I or I] and [E, H], or ``None``.
    """
    h = grouped_matmul(x, up, counts, kernel)
    if up_bias is not None:
        h = h + rows_bias(up_bias, counts)
    if gated:
        gate, value = h.chunk(2, dim=-1)
        h = activation(gate) * value
    else:
        h = activation(h)
    y = grouped_matmul(h, down, counts, kernel)
    if down_bias is not None:
        y = y + rows_bias(down_bias, counts)
    return y


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "silu": F.silu, "relu": F.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The element-wise activation named ``name`` (``ACTIVATIONS``)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {name!r}: choose from {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
