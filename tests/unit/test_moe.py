"""The MoE layer package in one process (issue 44): routing, capacity and the router losses; the grouped
products against a loop over experts; ``MoE`` with DeepSpeed's arguments; Hugging Face experts adapted from their
``base_model_ep_plan``; router statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_zero.moe import (
    ExpertGroup,
    GroupedKernel,
    GroupedMLPExperts,
    MoE,
    MoELayer,
    RoutingPolicy,
    TopKGate,
    attach_hf_experts,
    expert_mlp,
    grouped_matmul,
    hf_expert_modules,
    read_router_stats,
    route,
)
from lightning_zero.moe.grouped import activation


# ------------------------------------------------------------------------------------------- routing
def test_capacity_serves_first_choices_before_second_ones_in_token_order() -> None:
    # 4 tokens, 2 experts, k=2: every token chooses expert 0 first, expert 1 second (logits favour 0)
    logits = torch.tensor([[2.0, 1.0]] * 4)
    policy = RoutingPolicy(2, k=2, capacity_factor=0.5, min_capacity=0)  # C = ceil(2 * 4 / 2 * 0.5) = 2
    assert policy.capacity(4, training=True) == 2
    r = route(logits, policy, training=True)
    assert r.experts.tolist() == [[0, 1]] * 4
    assert r.kept.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert r.tokens_per_expert.tolist() == [2, 2] and r.dropped == 4
    assert torch.allclose(r.weights[:2].sum(dim=1), torch.ones(2))  # k > 1: kept weights renormalised
    assert r.weights[2:].abs().sum() == 0  # a token with no kept expert adds nothing


def test_a_first_choice_outranks_an_earlier_tokens_second_choice() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0]])  # token 0: 1 then 0; token 1: 0 then 1
    r = route(logits, RoutingPolicy(3, k=2, capacity_factor=0.75, min_capacity=0), training=True)  # C = 1
    assert r.kept.tolist() == [[True, False], [True, False]]  # both first choices, no second choice fits


def test_dropless_keeps_everything_and_eval_uses_its_own_factor() -> None:
    logits = torch.randn(50, 4)
    policy = RoutingPolicy(4, k=1, capacity_factor=None, eval_capacity_factor=0.1, min_capacity=0)
    assert bool(route(logits, policy, training=True).kept.all())
    assert route(logits, policy, training=False).dropped > 0
    assert route(logits, RoutingPolicy(4, k=1), training=True).weights.max() < 1  # k = 1: the probability


def test_aux_loss_is_one_for_a_uniform_router_and_z_loss_is_log_e_squared() -> None:
    r = route(torch.zeros(12, 4), RoutingPolicy(4, k=2, capacity_factor=None), training=True)
    assert math.isclose(float(r.aux_loss), 1.0, rel_tol=1e-6)
    assert math.isclose(float(r.z_loss), math.log(4) ** 2, rel_tol=1e-6)
    skewed = torch.tensor([[5.0, 0.0, 0.0, 0.0]] * 12)
    assert float(route(skewed, RoutingPolicy(4, k=1, capacity_factor=None), training=True).aux_loss) > 3.0


def test_the_router_losses_reach_the_router_weights() -> None:
    gate = TopKGate(8, RoutingPolicy(4, k=2, capacity_factor=None))
    r = gate(torch.randn(10, 8))
    (r.aux_loss + r.z_loss).backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


def test_bad_policies_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"k \(experts per token\) must be an integer in \[1, num_experts=4\]"):
        RoutingPolicy(4, k=5)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        RoutingPolicy(4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="noisy_gate_policy must be one of"):
        RoutingPolicy(4, noisy_gate_policy="Gaussian")


def test_noisy_policies_change_the_choice_in_training_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(200, 8) * 0.01  # nearly tied: noise decides
    plain = route(logits, RoutingPolicy(8, k=1), training=True).experts
    noisy = route(logits, RoutingPolicy(8, k=1, noisy_gate_policy="RSample"), training=True).experts
    assert not torch.equal(plain, noisy)
    assert torch.equal(plain, route(logits, RoutingPolicy(8, k=1, noisy_gate_policy="RSample"), False).experts)


# ------------------------------------------------------------------------------------------- grouped products
@pytest.mark.parametrize("kernel", [GroupedKernel.GROUPED_MM, GroupedKernel.PADDED_BMM])
def test_grouped_products_equal_a_loop_over_experts_with_empty_experts(kernel: GroupedKernel) -> None:
    torch.manual_seed(0)
    counts = [3, 0, 5, 0, 2]  # two starved experts
    x = torch.randn(sum(counts), 8, requires_grad=True)
    w = torch.randn(5, 4, 8, requires_grad=True)
    g = torch.randn(sum(counts), 4)
    y = grouped_matmul(x, w, counts, kernel)
    y.backward(g)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = grouped_matmul(xr, wr, counts, GroupedKernel.LOOP)
    ref.backward(g)
    assert torch.allclose(y, ref, atol=1e-6)
    assert torch.allclose(x.grad, xr.grad, atol=1e-6) and torch.allclose(w.grad, wr.grad, atol=1e-6)
    assert w.grad[1].abs().sum() == 0 and w.grad[3].abs().sum() == 0


def test_auto_takes_grouped_mm_where_its_strides_allow_and_padded_bmm_elsewhere() -> None:
    from lightning_zero.moe.grouped import resolve_kernel

    aligned, odd = torch.randn(3, 4, 8), torch.randn(3, 4, 6)
    assert resolve_kernel(GroupedKernel.AUTO, torch.randn(2, 8), aligned) is GroupedKernel.GROUPED_MM
    assert resolve_kernel(GroupedKernel.AUTO, torch.randn(2, 6), odd) is GroupedKernel.PADDED_BMM
    assert resolve_kernel(GroupedKernel.AUTO, torch.randn(2, 8).double(), aligned.double()) is GroupedKernel.PADDED_BMM


@pytest.mark.parametrize("kernel", [GroupedKernel.GROUPED_MM, GroupedKernel.PADDED_BMM])
def test_no_rows_at_all_still_reaches_the_weights(kernel: GroupedKernel) -> None:
    w = torch.randn(3, 4, 8, requires_grad=True)
    y = grouped_matmul(torch.randn(0, 8), w, [0, 0, 0], kernel)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() == 0


def test_a_gated_expert_mlp_with_biases_equals_each_expert_alone() -> None:
    torch.manual_seed(0)
    counts = [2, 3, 1]
    x = torch.randn(6, 4)
    up, down = torch.randn(3, 10, 4), torch.randn(3, 4, 5)
    ub, db = torch.randn(3, 10), torch.randn(3, 4)
    out = expert_mlp(x, counts, up, down, activation("silu"), gated=True, up_bias=ub, down_bias=db)
    start, ref = 0, []
    for e, n in enumerate(counts):
        h = x[start : start + n] @ up[e].t() + ub[e]
        gate, val = h.chunk(2, dim=-1)
        ref.append((torch.nn.functional.silu(gate) * val) @ down[e].t() + db[e])
        start += n
    assert torch.allclose(out, torch.cat(ref), atol=1e-5)


# ------------------------------------------------------------------------------------------- layers
def _per_token(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Each token through its kept experts one by one (the reference)."""
    r = layer.last_routing
    assert r is not None
    out = torch.zeros_like(x)
    experts = layer.experts
    for t in range(x.shape[0]):
        for j in range(r.experts.shape[1]):
            if r.kept[t, j]:
                e = int(r.experts[t, j])
                counts = [0] * experts.num_experts
                counts[e] = 1
                out[t] += r.weights[t, j] * experts(x[t : t + 1], counts)[0]
    return out


@pytest.mark.parametrize("capacity", [None, 0.6])
def test_a_moe_layer_equals_every_token_through_its_experts(capacity: float | None) -> None:
    torch.manual_seed(0)
    layer = MoELayer(TopKGate(8, RoutingPolicy(4, k=2, capacity_factor=capacity, min_capacity=0)),
                     GroupedMLPExperts(4, 8, 16, "silu", gated=True), 4)
    x = torch.randn(20, 8)
    out = layer(x)
    assert torch.allclose(out, _per_token(layer, x), atol=1e-5)
    assert (layer.last_routing.dropped > 0) == (capacity is not None)


def test_moe_takes_deepspeeds_arguments_and_returns_what_deepspeed_returns() -> None:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    moe = MoE(hidden_size=8, expert=expert, num_experts=4, ep_size=2, k=1, capacity_factor=1.0,
              eval_capacity_factor=2.0, min_capacity=1, use_residual=True, noisy_gate_policy="Jitter",
              drop_tokens=True, use_rts=False, use_tutel=False, enable_expert_tensor_parallelism=False,
              top2_2nd_expert_sampling=True)
    x = torch.randn(2, 6, 8)
    out, l_aux, exp_counts = moe(x)
    assert out.shape == x.shape and l_aux.dim() == 0 and exp_counts.shape == (4,)
    assert int(exp_counts.sum()) + moe.deepspeed_moe.last_routing.dropped == 12
    stacked = dict(moe.deepspeed_moe.experts.named_parameters())
    assert stacked["0_weight"].shape == (4, 16, 8)  # the expert's weights, one row per expert
    assert torch.equal(stacked["0_weight"][3], expert[0].weight.detach())  # every expert starts as the copy
    (out.sum() + l_aux).backward()
    assert all(p.grad is not None for p in moe.parameters())


def test_a_stacked_expert_module_computes_each_expert_with_its_own_weights() -> None:
    torch.manual_seed(0)
    moe = MoE(8, nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), num_experts=3, k=1,
              drop_tokens=False)
    with torch.no_grad():
        for p in moe.deepspeed_moe.experts.parameters():
            p.add_(torch.randn_like(p))  # the experts differ
    x = torch.randn(15, 8)
    out, _, _ = moe(x)
    assert torch.allclose(out, _per_token(moe.deepspeed_moe, x), atol=1e-5)


def test_moe_refuses_what_is_not_built_naming_it() -> None:
    expert = nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=r"use_tutel=True.*not built"):
        MoE(4, expert, num_experts=2, use_tutel=True)
    with pytest.raises(NotImplementedError, match="expert tensor parallelism is not built"):
        MoE(4, expert, num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match="num_experts=3 must be a multiple of ep_size=2"):
        MoE(4, expert, num_experts=3, ep_size=2)
    with pytest.raises(TypeError, match=r"does not know: \['expert_group_nam'\]"):
        MoE(4, expert, num_experts=2, expert_group_nam="x")
    with pytest.raises(NotImplementedError, match="used_token"):
        MoE(4, expert, num_experts=2)(torch.randn(3, 4), used_token=torch.ones(3))


def test_router_statistics_sum_the_layers_and_start_a_new_window() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(MoELayer(TopKGate(8, RoutingPolicy(4, k=2, capacity_factor=0.5, min_capacity=0)),
                                     GroupedMLPExperts(4, 8, 8), 4) for _ in range(2)))
    model(torch.randn(10, 8))
    stats = read_router_stats(model)
    assert sum(stats[f"moe/tokens_per_expert/{e}"] for e in range(4)) + stats["moe/dropped_tokens"] == 2 * 10 * 2
    assert stats["moe/dropped_tokens"] > 0 and stats["moe/load_imbalance"] >= 1.0 and "moe/aux_loss" in stats
    assert read_router_stats(model) == {}


# ------------------------------------------------------------------------------------------- Hugging Face
def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=32)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                             intermediate_size=32, decoder_sparse_step=1, head_dim=8)
        return transformers.Qwen3MoeForCausalLM(config)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                                            head_dim=8)
        return transformers.MixtralForCausalLM(config)
    config = transformers.OlmoeConfig(**common, intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    return transformers.OlmoeForCausalLM(config)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe"])
def test_hugging_face_experts_are_found_from_their_plan_and_compute_as_the_model_does(kind: str) -> None:
    torch.manual_seed(0)
    model = _hf(kind).eval()
    found = hf_expert_modules(model)
    assert [n for n, _ in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for _, module in found:
            attach_hf_experts(module, ExpertGroup())
        out = model(input_ids=ids).logits
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert "moe/tokens_per_expert/3" in read_router_stats(model)
