"""Mixture-of-experts layers and expert parallelism (docs/expert_parallel.md).

``routing`` (token-choice top-k routing, capacity, the auxiliary and z losses), ``grouped`` (the experts'
grouped matrix products), ``dispatch`` (the expert-parallel all-to-alls with uneven splits), ``experts`` (3-D
expert parameters and their split over the expert-parallel ranks), ``layer`` (``TopKGate``, ``MoELayer`` and
DeepSpeed's ``MoE``), ``hf`` (Hugging Face MoE models from their ``base_model_ep_plan``), ``stats`` (router
statistics), ``config`` (``ExpertParallelConfig``).
"""

from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.moe.dispatch import ExpertGroup, dispatch_and_combine
from lightning_zero.moe.experts import ExpertSplit, GroupedMLPExperts, StackedExperts, expert_split_of
from lightning_zero.moe.grouped import GroupedKernel, expert_mlp, grouped_matmul
from lightning_zero.moe.hf import attach_hf_experts, hf_ep_plan, hf_expert_modules
from lightning_zero.moe.layer import MoE, MoELayer, TopKGate
from lightning_zero.moe.routing import Routing, RoutingPolicy, route
from lightning_zero.moe.stats import RouterStats, read_router_stats

__all__ = [
    "ExpertGroup",
    "ExpertParallelConfig",
    "ExpertSplit",
    "GroupedKernel",
    "GroupedMLPExperts",
    "MoE",
    "MoELayer",
    "RouterStats",
    "Routing",
    "RoutingPolicy",
    "StackedExperts",
    "TopKGate",
    "attach_hf_experts",
    "dispatch_and_combine",
    "expert_mlp",
    "expert_split_of",
    "grouped_matmul",
    "hf_ep_plan",
    "hf_expert_modules",
    "read_router_stats",
    "route",
]
