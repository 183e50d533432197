"""The experts' weights as 3-D parameters (experts first), split over the expert-parallel ranks by dimension 0.

Note [expert split]
    Every expert parameter is one tensor [E, ...] holding all E experts (Hugging Face's ``gate_up_proj`` /
    ``down_proj``, the GPT's MoE, DeepSpeed-style layers' stacked expert modules). Expert parallelism of size
    P keeps rank p's L = E / P experts, rows ``p*L .. p*L + L - 1`` of dimension 0, in a new parameter of
    shape [L, ...] tagged with :class:`ExpertSplit` (what a checkpoint needs to put the whole tensor back
    together, and what the strategy reads to reduce and partition it over the expert-data group). Like
    tensor parallelism's slices (Note [slice after build] in tensor_parallel/plan.py) the split is applied to
    the whole, initialised model: every rank builds all experts with the same seed and keeps its own, so a
    run's weights do not depend on the expert-parallel size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero.moe.dispatch import ExpertGroup
from lightning_zero.moe.grouped import GroupedKernel, activation, expert_mlp, padded_slots


@dataclass(frozen=True)
class ExpertSplit:
    """How an expert parameter was split (Note [expert split]): ``num_experts`` E in the whole tensor, over
    ``size`` ranks, this one ``rank``."""

    num_experts: int
    size: int
    rank: int

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size

    def whole_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (self.num_experts, *local[1:])

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole tensor [E, ...]."""
        return whole[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]


def expert_split_of(param: torch.Tensor) -> ExpertSplit | None:
    """The split of an expert parameter (``None``: not split by expert parallelism)."""
    return getattr(param, "expert_split", None)


def expert_parameter_names(module: nn.Module, num_experts: int) -> list[str]:
    """The direct parameters of an experts module that hold one row per expert (dimension 0 of size E)."""
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == num_experts]


@torch.no_grad()
def split_experts(module: nn.Module, names: list[str], ep: ExpertGroup, num_experts: int,
                  memo: dict[nn.Parameter, nn.Parameter] | None = None) -> list[nn.Parameter]:
    """Replace ``module``'s parameters ``names`` ([E, ...]) by this rank's rows (Note [expert split]); ``memo``
    (filled) maps each whole parameter to its slice. Returns the slices."""
    local = ep.local_experts(num_experts)
    out = []
    for name in names:
        whole = getattr(module, name)
        if expert_split_of(whole) is not None:
            raise ValueError(f"{type(module).__name__}.{name} is already split by expert parallelism (a previous "
                             "fit with expert_parallel): build a fresh module for another fit")
        part = nn.Parameter(whole.data[local.start : local.stop].clone(), requires_grad=whole.requires_grad)
        part.expert_split = ExpertSplit(num_experts, ep.size, ep.rank)  # type: ignore[attr-defined]
        setattr(module, name, part)
        if memo is not None:
            memo[whole] = part
        out.append(part)
    return out


class GroupedMLPExperts(nn.Module):
    """E expert MLPs as 3-D parameters computed by grouped products (Note [grouped experts] in grouped.py):
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] when ``gated`` (SwiGLU-style, Hugging Face's
    layout), else ``up_proj`` [E, I, H] and ``down_proj``.

    Args:
        num_experts: E.
        hidden_size: H.
        intermediate_size: I.
        activation_name: ``"gelu"``, ``"silu"``, ``"relu"`` or ``"gelu_tanh"``.
        gated: gated (GLU) experts.
        kernel: the grouped product's implementation.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation_name: str = "gelu",
                 gated: bool = False, kernel: GroupedKernel = GroupedKernel.AUTO) -> None:
        super().__init__()
        self.num_experts, self.gated, self.kernel = num_experts, gated, kernel
        self.activation_name = activation_name
        self.act = activation(activation_name)
        up = 2 * intermediate_size if gated else intermediate_size
        self.up_name = "gate_up_proj" if gated else "up_proj"
        self.register_parameter(self.up_name, nn.Parameter(torch.empty(num_experts, up, hidden_size)))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, down_std: float | None = None) -> None:
        nn.init.normal_(getattr(self, self.up_name), std=std)
        nn.init.normal_(self.down_proj, std=std if down_std is None else down_std)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts on ``rows`` sorted by expert, ``counts`` rows each."""
        return expert_mlp(rows, counts, getattr(self, self.up_name), self.down_proj, self.act, self.gated,
                          kernel=self.kernel)


class StackedExperts(nn.Module):
    """E copies of any expert module (DeepSpeed's ``expert`` argument), each parameter stacked into one [E, ...]
    parameter (its name with ``.`` as ``_``), run as one batched call: ``torch.func.vmap`` of the module over
    the experts, on their rows padded to the largest count (a padded batched product, not a loop).

    Args:
        expert: the module one expert is a copy of (its initial values are every expert's, as DeepSpeed's
            deep copies start).
        num_experts: E.
    """

    def __init__(self, expert: nn.Module, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        template = copy.deepcopy(expert)
        self.names = {name: name.replace(".", "_") for name, _ in template.named_parameters()}
        if any(True for _ in template.buffers()):
            raise ValueError(f"{type(expert).__name__} has buffers: an expert module with buffers (batch norm) is "
                             "not built for MoE layers; use one without")
        for name, p in template.named_parameters():
            stacked = p.detach().unsqueeze(0).repeat(num_experts, *([1] * p.dim())).clone()
            self.register_parameter(self.names[name], nn.Parameter(stacked, requires_grad=p.requires_grad))
        template.to("meta")  # the template keeps the structure only; the values are the stacked parameters
        object.__setattr__(self, "_template", template)  # not a submodule: its parameters are not the model's

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = len(counts)
        longest = max(counts, default=0)
        params = {name: getattr(self, flat) for name, flat in self.names.items()}
        if longest == 0:
            return rows.new_zeros(0, *rows.shape[1:]) + sum(p.sum() * 0 for p in params.values())
        slots = padded_slots(counts, longest, rows.device)
        padded = rows.new_zeros(local * longest, *rows.shape[1:]).index_copy(0, slots, rows)
        call: Callable[..., torch.Tensor] = torch.func.functional_call
        template = self._template
        out = torch.func.vmap(lambda p, x: call(template, p, (x,)))(params, padded.view(local, longest, -1))
        return out.reshape(local * longest, -1).index_select(0, slots)
