"""Expert dispatch on 2 gloo ranks (issue 44): tokens sent to the rank of their expert and back equal every
rank computing every expert itself, forward and backward; an expert starved of tokens (and a rank routing no
token at all) runs without a hang; the all-to-all bytes are what Note [all-to-all bytes] counts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.moe import ExpertGroup, GroupedMLPExperts, MoELayer, RoutingPolicy, TopKGate
from lightning_zero.moe.routing import Routing, route
from tests.pool import GlooPool

E, H, K = 4, 8, 2


class Starving(TopKGate):
    """A router whose logits for ``banned`` experts are -1e4: no token of this rank is routed to them."""

    def __init__(self, gate: TopKGate, banned: list[int]) -> None:
        super().__init__(gate.wg.in_features, gate.policy)
        self.wg = gate.wg
        self.banned = banned

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.wg(x)
        if self.banned:
            logits = logits.index_fill(1, torch.tensor(self.banned), -1e4)
        return route(logits, self.policy, self.training)


def dispatch_body(starve: bool, capacity: float | None) -> dict[str, Any]:
    """Each rank: its own tokens through the layer holding all experts (the reference), then through the same
    layer split over the 2 ranks; returns the worst differences of outputs and gradients."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = MoELayer(TopKGate(H, RoutingPolicy(E, k=K, capacity_factor=capacity, min_capacity=0)),
                     GroupedMLPExperts(E, H, 16, "silu", gated=True), E)
    if starve:  # rank 0 sends nothing to rank 1's experts; rank 1 nothing to expert 0
        whole.gate = Starving(whole.gate, [2, 3] if rank == 0 else [0])
    split = copy.deepcopy(whole)
    ep = ExpertGroup(dist.new_group(list(range(world))), world, rank)
    split.attach_expert_group(ep)
    gen = torch.Generator().manual_seed(100 + rank)
    calls = [12, 0 if starve and rank == 1 else 7]  # a call where rank 1 has no token at all
    out: dict[str, Any] = {"out": 0.0, "x_grad": 0.0, "expert_grad": 0.0, "gate_grad": 0.0, "received": []}
    for tokens in calls:
        x = torch.randn(tokens, H, generator=gen)
        g = torch.randn(tokens, H, generator=gen)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        ys = [whole(xs[0]), split(xs[1])]
        for y in ys:
            y.backward(g)
        out["out"] = max(out["out"], float((ys[0] - ys[1]).abs().max()) if tokens else 0.0)
        out["x_grad"] = max(out["x_grad"], float((xs[0].grad - xs[1].grad).abs().max()) if tokens else 0.0)
        out["received"].append(split.last_routing.tokens_per_expert.tolist())
    for name in ("gate_up_proj", "down_proj"):  # the reference sums every rank's gradient of all experts
        ref = getattr(whole.experts, name).grad.clone()
        dist.all_reduce(ref)
        mine = ref[rank * (E // world) : (rank + 1) * (E // world)]
        out["expert_grad"] = max(out["expert_grad"], float((getattr(split.experts, name).grad - mine).abs().max()))
    out["gate_grad"] = float((whole.gate.wg.weight.grad - split.gate.wg.weight.grad).abs().max())
    out["bytes"], out["exchanges"] = ep.bytes_sent, ep.exchanges
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("starve", [False, True])
@pytest.mark.parametrize("capacity", [None, 0.8])
def test_split_experts_compute_what_every_rank_computing_every_expert_computes(gloo_pool: GlooPool, starve: bool,
                                                                               capacity: float | None) -> None:
    results = gloo_pool.run("tests.distributed.test_moe:dispatch_body", starve=starve, capacity=capacity,
                            _timeout_s=120)
    for r in results:
        assert r["out"] < 1e-5 and r["x_grad"] < 1e-5 and r["expert_grad"] < 1e-5 and r["gate_grad"] < 1e-6, r
        assert r["exchanges"] == 2 * 2 * 2  # 2 calls x (dispatch, combine) x (forward, backward): also with no token
    if starve:
        assert results[0]["received"][0][2:] == [0, 0]  # rank 0 routed nothing to rank 1's experts
        assert results[1]["received"][0][0] == 0 and results[1]["received"][1] == [0, 0, 0, 0]


def bytes_body() -> dict[str, Any]:
    """One dropless call of a known routing: the bytes each rank counts against the rows it sent away."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = MoELayer(TopKGate(H, RoutingPolicy(E, k=K, capacity_factor=None)), GroupedMLPExperts(E, H, 16), E)
    ep = ExpertGroup(dist.new_group(list(range(world))), world, rank)
    layer.attach_expert_group(ep)
    x = torch.randn(10 + rank, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    layer(x).sum().backward()
    counts = [torch.zeros(E, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, layer.last_routing.tokens_per_expert)
    mine = slice(rank * 2, rank * 2 + 2)
    sent = int(counts[rank].sum() - counts[rank][mine].sum())  # rows bound for the other rank's experts
    received = sum(int(c[mine].sum()) for q, c in enumerate(counts) if q != rank)
    return {"bytes": ep.bytes_sent, "sent": sent, "received": received}


@pytest.mark.distributed
def test_all_to_all_bytes_are_the_rows_sent_away_four_times_and_the_counts(gloo_pool: GlooPool) -> None:
    for r in gloo_pool.run("tests.distributed.test_moe:bytes_body", _timeout_s=60):
        # forward: its rows out (dispatch) and the others' results back (combine); backward the same again; and
        # the counts of the other rank's 2 experts, 8 bytes each
        assert r["bytes"] == 2 * (r["sent"] + r["received"]) * H * 4 + 2 * 8, r
        assert r["sent"] > 0 and r["received"] > 0


def test_an_expert_group_that_does_not_divide_the_experts_is_refused() -> None:
    layer = MoELayer(TopKGate(H, RoutingPolicy(3)), GroupedMLPExperts(3, H, 8), 3)
    with pytest.raises(ValueError, match="3 experts do not split over expert_parallel=2 ranks"):
        layer.attach_expert_group(ExpertGroup(nn.Module(), 2, 0))  # type: ignore[arg-type]
