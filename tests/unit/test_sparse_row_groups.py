"""The row-group executor (lightning_zero/sparse_attention/row_groups.py): its planner covers every
(head, row) once with groups whose keys are their rows' union and whose masked work stays within the
policy's bound; its output and gradients equal masked dense attention for every config (float64
1e-10, float32 1e-5), per-head layouts and masks included; ``auto`` picks it for CPU training."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.sparse_attention import FixedSparsityConfig, SparseSelfAttention
from lightning_zero.sparse_attention.row_groups import GroupPolicy, batch_groups, plan_row_groups
from tests.unit.test_sparse_attention import BLOCK, CONFIGS, H, _compare


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_covers_every_row_once_with_its_blocks(name: str) -> None:
    layout = CONFIGS[name]().make_layout(512).bool()  # 64 blocks of 8 tokens
    policy = GroupPolicy()
    groups = plan_row_groups(layout, BLOCK, policy)
    shared = groups[0].head is None
    seen = torch.zeros(layout.shape[:2], dtype=torch.int64)
    max_rows = policy.max_tokens // BLOCK
    computed = 0
    for g in groups:
        heads = range(H) if g.head is None else [g.head]
        rows = g.stop - g.start
        assert 1 <= rows <= max_rows
        for h in heads:
            seen[h, g.start:g.stop] += 1
            union = layout[h, g.start:g.stop].any(0)
            assert g.keys == tuple(union.nonzero().flatten().tolist())  # the union, nothing more
        computed += rows * len(g.keys)
    assert bool((seen == 1).all())
    # masked work bound (Note [row groups]): the plan costs no more than one row per group
    overhead, rows_per_head = (policy.group_tokens / BLOCK) ** 2, layout.shape[1]
    own = int(layout[0].sum()) if shared else int(layout.sum())
    assert computed + len(groups) * overhead <= own + rows_per_head * (1 if shared else H) * overhead
    assert shared == bool((layout == layout[:1]).all())


def test_plan_of_a_fixed_layout_wastes_little_and_batches_stay_under_the_chunk() -> None:
    config = FixedSparsityConfig(H, block=8, num_local_blocks=32, attention="unidirectional")
    layout = config.make_layout(4096).bool()
    policy = GroupPolicy(chunk_elements=1 << 18)
    groups = plan_row_groups(layout, 8, policy)
    computed = sum((g.stop - g.start) * len(g.keys) for g in groups)
    assert computed <= 1.35 * int(layout[0].sum())  # masked work: the local windows' upper triangles
    assert all(g.start // 32 == (g.stop - 1) // 32 for g in groups)  # no group straddles two windows
    batches = batch_groups(groups, layout, 8, batch=2, policy=policy)
    assert sum(gb.rows.shape[0] for gb in batches) == len(groups)
    for gb in batches:
        g, hc, r = gb.rows.shape
        scores = 2 * hc * g * r * gb.keys.shape[2] * 8 * 8
        assert g == 1 or scores <= policy.chunk_elements


def test_plan_refuses_an_empty_row() -> None:
    layout = torch.ones(2, 4, 4, dtype=torch.bool)
    layout[1, 2] = False
    with pytest.raises(ValueError, match="row 2 of head 1"):
        plan_row_groups(layout, 8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("executor", ["row_groups", "block_sparse"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_cpu_executor_equals_masked_dense_attention(name: str, executor: str, dtype: torch.dtype) -> None:
    for causal in (False, True):
        module = SparseSelfAttention(CONFIGS[name](), max_seq_length=128, causal=causal, executor=executor,
                                     chunk_elements=3000, group_policy=GroupPolicy(group_tokens=16, max_tokens=32))
        _compare(module, dtype, causal=causal)
    if executor == "row_groups":
        assert len(module._group_batches[(96, 2, "cpu")]) > 2  # several batches


@pytest.mark.parametrize("name", ["fixed_per_head", "bigbird"])
def test_row_groups_with_per_head_layouts_and_every_mask(name: str) -> None:
    length = 96
    g = torch.Generator().manual_seed(7)
    keep = torch.ones(2, length)
    keep[1, 50:] = 0
    am_mul = (torch.rand(length, length, generator=g) > 0.2).float()
    am_mul.fill_diagonal_(1)
    rpe = torch.randn(2, H, length, length, generator=g, dtype=torch.float64)  # per batch and head
    neg_inf = torch.tensor(float("-inf"))
    module = SparseSelfAttention(CONFIGS[name](), key_padding_mask_mode="mul", attn_mask_mode="mul",
                                 max_seq_length=length, causal=True, executor="row_groups", chunk_elements=5000,
                                 group_policy=GroupPolicy(group_tokens=16, max_tokens=32))
    _compare(module, torch.float64, causal=True, kp=keep, am=am_mul, rpe=rpe,
             kp_add=torch.where(keep == 0, neg_inf, 0.0), am_add=torch.where(am_mul == 0, neg_inf, 0.0))
    assert {gr.head for gr in plan_row_groups(module.get_layout(length), BLOCK)} == set(range(H))


def test_auto_runs_row_groups_for_cpu_training_and_the_kernel_when_forced() -> None:
    q = torch.randn(1, H, 64, 16, requires_grad=True)
    auto = SparseSelfAttention(CONFIGS["fixed_uni"](), max_seq_length=64, causal=True)
    auto(q, q, q).sum().backward()
    assert auto._group_batches and not auto._chunks
    forced = SparseSelfAttention(CONFIGS["fixed_uni"](), max_seq_length=64, causal=True, executor="block_sparse")
    forced(q, q, q)
    assert forced._chunks and not forced._group_batches


def test_row_groups_refuses_a_non_cpu_tensor_naming_the_fix() -> None:
    module = SparseSelfAttention(CONFIGS["fixed_uni"](), max_seq_length=64, executor="row_groups")
    q = torch.empty(1, H, 64, 16, device="meta")
    with pytest.raises(RuntimeError, match="executor='auto' or 'flex'"):
        module(q, q, q)


def test_group_policy_refuses_a_non_positive_size() -> None:
    with pytest.raises(ValueError, match="max_tokens=0: must be a positive"):
        GroupPolicy(max_tokens=0)
