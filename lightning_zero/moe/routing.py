"""Token-choice top-k routing: which experts each token goes to, with what weight, which assignments a
capacity drops, and the router's auxiliary losses (load balancing, Switch; router z-loss, ST-MoE).

Note [token-choice routing]
    Each of the T tokens picks its k experts from the router's softmax over E experts (fp32, whatever the
    activations' dtype). A noisy gate perturbs the choice in training only: ``"Jitter"`` multiplies the
    router's input by uniform noise in [1 - 1e-2, 1 + 1e-2], ``"RSample"`` adds Gumbel noise to the logits
    the top-k is taken on (the weights stay the clean probabilities), as DeepSpeed's policies do.

    Capacity (``capacity_factor`` not ``None``): an expert takes at most ``C = max(min_capacity,
    ceil(k * T / E * capacity_factor))`` assignments of this rank's T tokens; assignments are served choice by
    choice (every token's first choice before any second choice), in token order within a choice, or with
    ``random_priority`` (DeepSpeed's random token selection, ``use_rts``) in a random order of the tokens; the
    rest are dropped (their token keeps its residual path only). ``None``: dropless, every assignment kept.
    Capacity is counted on the rank that routes the tokens, so a run's routing is the same at any
    expert-parallel size: expert parallelism moves tokens, it never changes which are kept.

    Weights: with k > 1 the kept weights of a token are renormalised to sum 1 (``normalize``, the default for
    k > 1, as DeepSpeed's top-2 and top-k gates and Mixtral do); with k = 1 the weight is the probability.

    Losses: ``aux_loss = E * sum_i f_i * P_i`` with ``f_i`` the share of the T * k assignments that chose
    expert i (before dropping) and ``P_i`` the mean router probability of expert i: 1 for a uniform router
    (Switch Transformer; DeepSpeed's top-1 and top-k gates). ``z_loss = mean_t logsumexp(logits_t)^2``
    (ST-MoE), which keeps the router's logits small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPS = 1e-2


@dataclass(frozen=True)
class RoutingPolicy:
    """How tokens are routed (Note [token-choice routing]).

    Args:
        num_experts: E, the experts of the layer (all ranks together).
        k: experts per token.
        capacity_factor: training capacity factor; ``None``: dropless.
        eval_capacity_factor: the same outside training; ``None``: dropless.
        min_capacity: the least capacity of an expert when dropping.
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"``.
        normalize: renormalise a token's kept weights to sum 1 (default: ``k > 1``).
        random_priority: drop in a random order of the tokens instead of token order (DeepSpeed's ``use_rts``).
        sample_second: k = 2 in training: the second expert drawn with Gumbel noise on the logits
            (DeepSpeed's ``top2_2nd_expert_sampling``).
    """

    num_experts: int
    k: int = 1
    capacity_factor: float | None = 1.0
    eval_capacity_factor: float | None = 1.0
    min_capacity: int = 4
    noisy_gate_policy: str | None = None
    normalize: bool | None = None
    random_priority: bool = False
    sample_second: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.k, int) or not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k (experts per token) must be an integer in [1, num_experts={self.num_experts}], "
                             f"got {self.k!r}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive (or None: dropless), got {value!r}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {self.noisy_gate_policy!r}")

    @property
    def renormalizes(self) -> bool:
        return self.k > 1 if self.normalize is None else self.normalize

    def capacity(self, tokens: int, training: bool) -> int | None:
        """The most assignments an expert keeps of ``tokens`` tokens (``None``: dropless)."""
        factor = self.capacity_factor if training else self.eval_capacity_factor
        if factor is None:
            return None
        return max(self.min_capacity, math.ceil(self.k * tokens / self.num_experts * factor))


@dataclass(frozen=True)
class Routing:
    """One routing decision of T tokens.

    ``experts`` [T, k] (long): the chosen experts; ``weights`` [T, k] (fp32): their weights, 0 where dropped;
    ``kept`` [T, k] (bool); ``aux_loss`` and ``z_loss``: scalars with gradients to the router;
    ``tokens_per_expert`` [E] (long): kept assignments per expert; ``dropped``: assignments dropped.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: int


def jitter(x: torch.Tensor, policy: RoutingPolicy, training: bool) -> torch.Tensor:
    """The router's input under the ``"Jitter"`` policy in training (else ``x``)."""
    if training and policy.noisy_gate_policy == "Jitter":
        return x * torch.empty_like(x).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
    return x


def route(logits: torch.Tensor, policy: RoutingPolicy, training: bool) -> Routing:
    """Route T tokens from their router logits [T, E] (Note [token-choice routing])."""
    tokens, num = logits.shape
    if num != policy.num_experts:
        raise ValueError(f"the router gave {num} logits per token for {policy.num_experts} experts")
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    choose = logits
    if training and policy.noisy_gate_policy == "RSample":
        choose = logits + _gumbel(logits)
    experts = torch.topk(choose, policy.k, dim=-1).indices
    if training and policy.sample_second and policy.k == 2:
        first = experts[:, :1]
        second = (choose + _gumbel(choose)).scatter(1, first, float("-inf")).argmax(dim=-1, keepdim=True)
        experts = torch.cat([first, second], dim=1)
    weights = probs.gather(1, experts)
    chosen = torch.zeros(num, dtype=torch.long, device=logits.device).index_add_(
        0, experts.reshape(-1), torch.ones(experts.numel(), dtype=torch.long, device=logits.device))
    kept = _within_capacity(experts, policy.capacity(tokens, training), num, training and policy.random_priority)
    if not bool(kept.all()):
        weights = weights * kept
    if policy.renormalizes:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).eps)
    share = chosen.float() / max(tokens * policy.k, 1)
    aux = num * torch.sum(share * probs.mean(dim=0)) if tokens else logits.sum() * 0.0
    z = torch.logsumexp(logits, dim=-1).pow(2).mean() if tokens else logits.sum() * 0.0
    per_expert = torch.zeros(num, dtype=torch.long, device=logits.device).index_add_(
        0, experts[kept], torch.ones(int(kept.sum()), dtype=torch.long, device=logits.device))
    return Routing(experts, weights, kept, aux, z, per_expert, int(kept.numel() - kept.sum()))


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    u = torch.rand_like(like).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def _within_capacity(experts: torch.Tensor, capacity: int | None, num: int, random_priority: bool) -> torch.Tensor:
    """[T, k] bool: the assignments kept, served choice by choice, in token (or random) order within one."""
    tokens, k = experts.shape
    if capacity is None or tokens == 0:
        return torch.ones_like(experts, dtype=torch.bool)
    order = torch.randperm(tokens, device=experts.device) if random_priority else None
    served = experts if order is None else experts[order]
    one_hot = F.one_hot(served.t().reshape(-1), num)  # [k * T, E]: choice-major, token order within a choice
    position = (one_hot.cumsum(dim=0) - 1).mul_(one_hot).sum(dim=1)  # place of each assignment in its expert
    kept = (position < capacity).view(k, tokens).t()
    if order is not None:
        kept = torch.empty_like(kept).index_copy_(0, order, kept)
    return kept
