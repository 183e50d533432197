"""Property test of the flat shard layout (Note [flat shard layout]): over random module shapes,
dtypes, param-group layouts, frozen subsets, world sizes 1-3 and bucket sizes, flatten ->
partition -> gather gives back exactly the original tensors, and every element is owned by
exactly one rank. The ranks are simulated: each builds its own ``FlatParamGroup`` over a copy of
the same parameters (as every rank does), and "gather" concatenates their shards in rank order.
At world size 1 the real ZeroEngine (stages 0-3, single-rank path) must also give the module back.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.engine_setup import trainable_groups
from lightning_zero.core.zero.exchange import split_buckets

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
shapes = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=7)


def _module(shape_list: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = nn.Module()
    for i, shape in enumerate(shape_list):
        module.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape).to(dtype)))
    return module


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape_list=shapes, dtype=st.sampled_from(DTYPES), world=st.integers(1, 3), data=st.data(),
       bucket=st.integers(1, 200), seed=st.integers(0, 1000))
def test_flatten_partition_gather_is_exact_and_ownership_is_a_partition(
        shape_list: list[tuple[int, ...]], dtype: torch.dtype, world: int, data: st.DataObject, bucket: int,
        seed: int) -> None:
    n = len(shape_list)
    frozen = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="frozen")
    group_of = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n), label="param group")
    original = {name: p.detach().clone() for name, p in _module(shape_list, dtype, seed).named_parameters()}

    shards: list[list[torch.Tensor]] = []  # [rank][group] -> that rank's shard
    layouts: list[list[FlatParamGroup]] = []
    names_of: list[dict[nn.Parameter, str]] = []
    for rank in range(world):
        module = _module(shape_list, dtype, seed)
        params = list(module.parameters())
        for p, f in zip(params, frozen):
            p.requires_grad_(not f)
        groups = [{"params": [p for p, g in zip(params, group_of) if g == k]} for k in range(3)]
        optimizer = torch.optim.SGD([g for g in groups if g["params"]], lr=0.1)
        names = {p: name for name, p in module.named_parameters()}
        flat_groups = [FlatParamGroup(g, world, rank) for g in trainable_groups(optimizer, names)]
        for fg in flat_groups:
            fg.bind()
        layouts.append(flat_groups)
        names_of.append(names)
        shards.append([fg.own_shard().clone() for fg in flat_groups])
        # binding leaves every parameter's value unchanged (the params are views of the flat buffer)
        for p, name in names.items():
            assert torch.equal(p.detach(), original[name])

    reference = layouts[0]
    trainable = {name for name, f in zip(original, frozen) if not f}
    seen: set[str] = set()
    for gi, fg in enumerate(reference):
        # every rank computed the same layout
        assert all([(s.offset, s.numel) for s in lay[gi].slots] == [(s.offset, s.numel) for s in fg.slots]
                   for lay in layouts)
        assert fg.padded_numel == -(-max(fg.numel, 1) // world) * world  # the least multiple of N (>= 1 each)
        # ownership: the ranks' ranges tile [0, padded) without gaps or overlaps
        owners = torch.zeros(fg.padded_numel, dtype=torch.int64)
        for rank in range(world):
            start, end = fg.shard_range(rank)
            owners[start:end] += 1
        assert torch.equal(owners, torch.ones_like(owners))
        # gather: the shards in rank order are the flat buffer; its views are the original tensors
        gathered = torch.cat([shards[rank][gi] for rank in range(world)])
        assert gathered.numel() == fg.padded_numel and (gathered.dtype == dtype or not fg.slots)
        assert torch.count_nonzero(gathered[fg.numel:]) == 0  # padding is zero
        for slot, view in zip(fg.slots, fg.views(gathered)):
            name = names_of[0][slot.param]
            assert torch.equal(view, original[name]), name
            seen.add(name)
        # buckets: whole parameters, each slot in exactly one bucket, covering the buffer
        buckets = split_buckets(fg, bucket)
        assert sorted(i for b in buckets for i in b[2]) == list(range(len(fg.slots)))
        covered = sorted((b[0], b[1]) for b in buckets)
        if fg.slots:
            assert covered[0][0] == 0 and covered[-1][1] == fg.padded_numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    assert seen == trainable  # every trainable parameter is in exactly one group (frozen ones in none)
    assert sum(len(fg.slots) for fg in reference) == len(trainable)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape_list=shapes, dtype=st.sampled_from(DTYPES), stage=st.integers(0, 3), seed=st.integers(0, 1000),
       bucket=st.integers(1, 200))
def test_the_single_rank_engine_gives_the_module_back(shape_list: list[tuple[int, ...]], dtype: torch.dtype,
                                                      stage: int, seed: int, bucket: int) -> None:
    module = _module(shape_list, dtype, seed)
    original = {n: p.detach().clone() for n, p in module.named_parameters()}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    config = ZeroConfig(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=0)
    engine = ZeroEngine(module, optimizer, config, DataParallelComm(),
                        dtypes=DtypePolicy(param_dtype=dtype, master_dtype=dtype))
    full = engine.full_state_dict()
    assert set(full) == set(original)
    for name, value in original.items():
        assert torch.equal(full[name], value), name
