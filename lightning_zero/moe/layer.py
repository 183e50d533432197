"""Mixture-of-experts layers: the router (``TopKGate``), the routed experts (``MoELayer``), and ``MoE``, which takes
DeepSpeed's ``deepspeed.moe.layer.MoE`` arguments so that DeepSpeed code ports with an import change.

A layer holds all E experts until a strategy with expert parallelism splits them (``attach_expert_group``: each
rank keeps its E / P, Note [expert split] in experts.py); its forward then sends each token to the ranks of its
experts (Note [expert dispatch] in dispatch.py). Without a strategy it runs every expert locally.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_zero.moe.dispatch import ExpertGroup, dispatch_and_combine
from lightning_zero.moe.experts import StackedExperts, expert_parameter_names, split_experts
from lightning_zero.moe.routing import Routing, RoutingPolicy, jitter, route
from lightning_zero.moe.stats import RouterStats


class TopKGate(nn.Module):
    """The router: a bias-free linear map to E logits (``wg``, DeepSpeed's name) and the routing policy.

    Args:
        hidden_size: H.
        policy: how tokens are routed (Note [token-choice routing] in routing.py).
    """

    def __init__(self, hidden_size: int, policy: RoutingPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.wg = nn.Linear(hidden_size, policy.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route the tokens ``x`` [T, H] (the logits in fp32)."""
        return route(self.wg(jitter(x, self.policy, self.training)), self.policy, self.training)


class MoELayer(nn.Module):
    """Routed experts: ``gate`` picks each token's experts, ``experts`` (any module computing its experts on rows
    sorted by expert: ``forward(rows, counts)``, with its [E, ...] parameters) computes them.

    After a forward, ``aux_loss`` and ``z_loss`` hold that call's router losses (with their gradients) and
    ``router_stats`` has counted its routing (moe/stats.py).

    Args:
        gate: the router.
        experts: the experts' module.
        num_experts: E.
    """

    def __init__(self, gate: TopKGate, experts: nn.Module, num_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.expert_group: ExpertGroup | None = None  # set by attach_expert_group
        self.router_stats = RouterStats(num_experts)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def attach_expert_group(self, ep: ExpertGroup, memo: dict[nn.Parameter, nn.Parameter] | None = None,
                            ) -> list[nn.Parameter]:
        """Keep this rank's experts and route through ``ep`` from now on (Note [expert split]); returns the
        expert parameters' slices."""
        names = expert_parameter_names(self.experts, self.num_experts)
        parts = split_experts(self.experts, names, ep, self.num_experts, memo)
        self.expert_group = ep
        return parts

    def detach_expert_group(self) -> None:
        """Route without the group again (the parameters stay this rank's slices)."""
        self.expert_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., H] -> the weighted sum of each token's experts, same shape."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.gate(tokens)
        self.last_routing, self.aux_loss, self.z_loss = routing, routing.aux_loss, routing.z_loss
        self.router_stats.record(routing.tokens_per_expert, routing.dropped, routing.aux_loss, routing.z_loss)
        out = dispatch_and_combine(tokens, routing.experts, routing.weights.to(x.dtype), routing.kept,
                                   self.num_experts, self.experts, self.expert_group)
        return out.reshape(shape)


_REFUSED = {
    "use_tutel": "Tutel's CUDA kernels are not built: leave use_tutel=False (the experts run as grouped products)",
    "enable_expert_tensor_parallelism": "expert tensor parallelism is not built: leave it False (experts are split "
                                        "over the expert-parallel ranks whole)",
}


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer: ``deepspeed.moe.layer.MoE`` code ports with an import change
    (``from lightning_zero.moe import MoE``); expert parallelism comes from the strategy
    (``ZeroStrategy(expert_parallel=N)``, or this layer's ``ep_size`` when the strategy does not set it).

    Args:
        hidden_size: H.
        expert: one expert (a module mapping [..., H] to [..., H]); the layer holds ``num_experts`` copies, stacked
            ([E, ...] per parameter) and computed as one batched call.
        num_experts: E.
        ep_size: expert-parallel ranks (E / ep_size experts each); 1: whatever the strategy chooses.
        k: experts per token.
        capacity_factor: training capacity factor (with ``drop_tokens``).
        eval_capacity_factor: the same outside training.
        min_capacity: the least capacity of an expert.
        use_residual: Residual MoE (PR-MoE): a dense copy of ``expert`` beside the routed ones, mixed per token
            by a learned two-way softmax.
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"``.
        drop_tokens: drop assignments beyond capacity (False: dropless).
        use_rts: random token selection when dropping (top-1, as DeepSpeed).
        use_tutel, enable_expert_tensor_parallelism: refused when True (not built).
        top2_2nd_expert_sampling: k = 2: the second expert drawn with Gumbel noise in training.
        z_loss_coef: the router z-loss's weight in the returned ``l_aux`` (0: the load-balancing loss only, as
            DeepSpeed returns it).

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)`` like DeepSpeed's: the layer's
    output, the auxiliary loss to add (times its coefficient) to the training loss, and the kept assignments per
    expert of this call.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, z_loss_coef: float = 0.0, **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise TypeError(f"MoE got arguments it does not know: {sorted(unknown)} (DeepSpeed's are hidden_size, "
                            "expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity, "
                            "use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel, "
                            "enable_expert_tensor_parallelism, top2_2nd_expert_sampling)")
        for name, value in (("use_tutel", use_tutel),
                            ("enable_expert_tensor_parallelism", enable_expert_tensor_parallelism)):
            if value:
                raise NotImplementedError(f"MoE({name}=True): {_REFUSED[name]}")
        if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} must be a multiple of ep_size={ep_size}")
        noisy = None if noisy_gate_policy in (None, "None") else noisy_gate_policy
        policy = RoutingPolicy(num_experts, k, capacity_factor if drop_tokens else None,
                               eval_capacity_factor if drop_tokens else None, min_capacity, noisy,
                               random_priority=use_rts and k == 1, sample_second=top2_2nd_expert_sampling)
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.z_loss_coef = z_loss_coef
        self.deepspeed_moe = MoELayer(TopKGate(hidden_size, policy), StackedExperts(expert, num_experts), num_experts)
        self.use_residual = use_residual
        if use_residual:
            self.mlp = StackedExperts(expert, 1)  # one dense expert, computed on every token
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if used_token is not None:
            raise NotImplementedError("MoE(used_token=...) is not built: route every token (pass None)")
        out = self.deepspeed_moe(hidden_states)
        layer = self.deepspeed_moe
        assert layer.aux_loss is not None and layer.z_loss is not None and layer.last_routing is not None
        l_aux = layer.aux_loss + self.z_loss_coef * layer.z_loss if self.z_loss_coef else layer.aux_loss
        if self.use_residual:
            rows = hidden_states.reshape(-1, hidden_states.shape[-1])
            dense = self.mlp(rows, [rows.shape[0]]).reshape(hidden_states.shape)
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + dense * coef[..., 1:]
        return out, l_aux, layer.last_routing.tokens_per_expert
