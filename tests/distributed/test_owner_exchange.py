"""The owner exchange of stages 2-3 on gloo (Notes [owner-major message], [owner exchange] and
[reused buffers] in core/zero/exchange.py, [written shard] in core/zero/grad_reducer.py): the message
layout and the rank-order sum in one process; on 2 gloo ranks training bitwise equal to the all-reduce
path with buckets of several units merged; at 3 ranks equal within rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import Bucket, FlatParamGroup
from lightning_zero.core.zero.exchange import plan_messages, sum_in_rank_order
from lightning_zero.core.zero.grad_reducer import GradReducer
from tests.pool import Pools


def _groups(sizes: list[int], world_size: int) -> list[FlatParamGroup]:
    return [FlatParamGroup([nn.Parameter(torch.zeros(n))], world_size, 0) for n in sizes]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_merged_message_holds_every_element_once_owner_by_owner(world_size: int) -> None:
    groups = _groups([5, 11, 7], world_size)
    buckets = [Bucket(gi, 0, groups[gi].padded_numel, (0,), order) for order, gi in enumerate([2, 1, 0])]
    (message,) = plan_messages(buckets, groups, bucket_numel=10_000, merge=True, world_size=world_size)
    assert message.buckets == (0, 1, 2) and message.numel == sum(g.padded_numel for g in groups)
    seen = {(s.group_index, i) for s in message.segments for i in range(s.start, s.end)}
    assert len(seen) == message.numel  # no element twice, none missing
    for q, (lo, hi) in enumerate(message.owner_ranges):  # rank q's slice: exactly q's shards, contiguous
        mine = [s for s in message.segments if s.owner == q]
        assert sum(s.end - s.start for s in mine) == hi - lo and (not mine or mine[0].offset == lo)
        for s in mine:
            start, end = groups[s.group_index].shard_range(q)
            assert start <= s.start and s.end <= end
    # not merged past reduce_bucket_size, and never without the exchange
    split = plan_messages(buckets, groups, bucket_numel=sum(g.padded_numel for g in groups[1:]), merge=True,
                          world_size=world_size)
    assert [m.buckets for m in split] == [(0, 1), (2,)]
    assert len(plan_messages(buckets, groups, 10_000, merge=False, world_size=world_size)) == 3


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_the_sum_is_in_rank_order_whichever_rank_owns(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    parts = [torch.randn(1000, generator=gen) * 10 ** (q % 3) for q in range(4)]
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    first = torch.full((1000,), float("nan"))
    sum_in_rank_order([p.clone() for p in parts], first, first=True)
    assert torch.equal(first, expected)
    later = torch.ones(1000)
    sum_in_rank_order([p.clone() for p in parts], later, first=False)
    assert torch.equal(later, 1 + expected)


def _reducer(bucket_numel: int) -> tuple[nn.Module, GradReducer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    group = FlatParamGroup(list(model.parameters()), world_size=1, rank=0)
    group.bind()
    names = {p: n for n, p in model.named_parameters()}
    return model, GradReducer([group], DataParallelComm(), 2, bucket_numel, True, torch.float32, names)


def test_reused_buffers_accumulate_and_never_leak_stale_values() -> None:
    model, reducer = _reducer(bucket_numel=4)
    assert len(reducer.messages) == 3
    reference = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(6, 5)

    def backward(net: nn.Module, xi: torch.Tensor, use_first: bool) -> None:
        (net[1](net[0](xi)) if use_first else net[1](xi[:, :4])).pow(2).sum().backward()

    def expected(*inputs: tuple[torch.Tensor, bool]) -> torch.Tensor:
        reference.zero_grad()
        for xi, use_first in inputs:
            backward(reference, xi, use_first)
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in reference.parameters()])

    # two micro-steps (not the boundary): the first reduction writes the shard, the second adds
    from lightning_zero.core.zero.grad_reducer import ReductionMode

    reducer.set_boundary_mode(ReductionMode.AT_BOUNDARY)
    backward(model, x, True)
    reducer.finish()
    allocated = reducer.staged.staging_pool.allocations
    assert reducer.idle_buffers() and reducer.live_buffers() == []  # kept for the next micro-step, idle
    reducer.set_boundary_mode(ReductionMode.IMMEDIATE)
    backward(model, 2 * x, True)
    reducer.finish()
    # the second micro-step allocated nothing; at most the in-flight messages plus one filling, ever
    assert reducer.staged.staging_pool.allocations == allocated <= reducer.max_in_flight + 1 < 2 * len(reducer.messages)
    assert reducer.idle_buffers() and reducer.live_buffers() == []  # kept for the next step (Note [reused buffers])
    shard = reducer.shard_grad(0)
    torch.testing.assert_close(shard, expected((x, True), (2 * x, True)), rtol=0, atol=1e-5)
    # the next step: the first layer gets no gradient, so its part reads zero, not last step's values
    storage = shard.data_ptr()
    reducer.zero()
    backward(model, x, False)
    reducer.finish()
    shard = reducer.shard_grad(0)
    assert shard.data_ptr() == storage
    torch.testing.assert_close(shard, expected((x, False)), rtol=0, atol=1e-5)
    assert reducer.staged.staging_pool.allocations == allocated  # the next step reused them too
    reducer.zero()  # a read without any backward: all zeros
    assert torch.count_nonzero(reducer.shard_grad(0)) == 0
    reducer.remove_hooks()  # teardown frees them
    assert reducer.idle_buffers() == []


def test_without_overlap_comm_no_buffer_is_kept_between_steps() -> None:
    """overlap_comm=False is the memory-lean choice: the buffers serve the micro-steps of a step, and the step's
    last backward frees them (with overlap_comm they stay, the test above)."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    group = FlatParamGroup(list(model.parameters()), world_size=1, rank=0)
    group.bind()
    names = {p: n for n, p in model.named_parameters()}
    reducer = GradReducer([group], DataParallelComm(), 2, 4, False, torch.float32, names)
    from lightning_zero.core.zero.grad_reducer import ReductionMode

    reducer.set_boundary_mode(ReductionMode.AT_BOUNDARY)
    model(torch.randn(6, 5)).pow(2).sum().backward()
    reducer.finish()
    assert reducer.idle_buffers()  # kept for the step's next micro-step
    reducer.set_boundary_mode(ReductionMode.IMMEDIATE)
    model(torch.randn(6, 5)).pow(2).sum().backward()
    reducer.finish()
    assert reducer.idle_buffers() == [] and reducer.live_buffers() == []
    assert torch.count_nonzero(reducer.shard_grad(0)) > 0


# ---------------------------------------------------------------------------- 2 gloo ranks
def exchange_body(stage: int) -> dict[str, Any]:
    """Fits the same model with the all-reduce and with the owner exchange; counts exchanges and buckets."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy
    from tests.models import StackedLM, TinyTransformer, make_trainer, params_of, token_loader

    calls = {"n": 0}
    original = DataParallelComm.exchange_to_owners

    def counting(self: DataParallelComm, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return original(self, *args, **kwargs)

    class Plan(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            reducer = trainer.strategy.engine.reducer
            plan.update(messages=len(reducer.messages), buckets=len(reducer.buckets))

    out: dict[str, Any] = {}
    DataParallelComm.exchange_to_owners = counting  # type: ignore[method-assign]
    try:
        for collective in ("all_reduce", "auto"):
            before, plan = calls["n"], {}
            # stage 3: three blocks of 687 elements, each its own unit, two of them fit one message
            model = StackedLM("adamw") if stage == 3 else TinyTransformer("adamw")
            extra = {"param_persistence_threshold": 0} if stage == 3 else {}
            strategy = ZeroStrategy(stage=stage, reduce_bucket_size=1500, collective=collective, **extra)
            make_trainer(strategy, accumulate_grad_batches=2, max_steps=3, callbacks=[Plan()]).fit(
                model, token_loader())
            out[collective] = {"losses": model.losses, "params": params_of(model), "exchanges": calls["n"] - before,
                               **plan}
    finally:
        DataParallelComm.exchange_to_owners = original  # type: ignore[method-assign]
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_the_exchange_equals_the_all_reduce_bitwise_at_two_ranks(gloo_pool, stage: int) -> None:
    results = gloo_pool.run("tests.distributed.test_owner_exchange:exchange_body", stage=stage)
    for r in results:
        ref, got = r["all_reduce"], r["auto"]
        assert ref["exchanges"] == 0 and got["exchanges"] > 0  # each path ran what it names
        assert ref["messages"] == ref["buckets"]  # the all-reduce path: one bucket a message
        if stage == 3:  # buckets of several units share one exchange
            assert got["messages"] < got["buckets"], got
        assert got["losses"] == ref["losses"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["auto"]["params"], results[1]["auto"]["params"]))


def three_rank_body() -> dict[str, Any]:
    """Rank-specific gradients of three flat groups reduced by the exchange (buckets merged) and by the
    all-reduce (core level, two micro-steps)."""
    import torch.distributed as dist

    shards = {}
    for collective in ("all_reduce", "auto"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 5), nn.Linear(5, 3))
        groups = [FlatParamGroup(list(m.parameters()), world_size=3, rank=dist.get_rank()) for m in model]
        for g in groups:
            g.bind()
        names = {p: n for n, p in model.named_parameters()}
        reducer = GradReducer(groups, DataParallelComm(None, collective), 3, 100, True, torch.float32, names)
        for micro in range(2):  # the second micro-step adds into the shard
            torch.manual_seed(10 * dist.get_rank() + micro)
            model(torch.randn(4, 7)).pow(2).sum().backward()
            reducer.finish()
        shards[collective] = torch.cat([reducer.shard_grad(i).clone() for i in range(len(groups))])
        merged = len(reducer.messages) < len(reducer.buckets)
        reducer.remove_hooks()
    return {"all_reduce": shards["all_reduce"], "exchange": shards["auto"], "merged": merged}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_exchange_equals_the_all_reduce_within_rounding_at_three_ranks(gloo_pools: Pools) -> None:
    for r in gloo_pools.get(3).run("tests.distributed.test_owner_exchange:three_rank_body"):
        assert r["merged"] and r["exchange"].abs().sum() > 0
        torch.testing.assert_close(r["exchange"], r["all_reduce"], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- the step-error agreement
def agreement_body(stage: int) -> dict[str, Any]:
    """A fit with accumulation; counts blocking ``ranks_with`` and deferred agreements made during training."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy
    from tests.models import TinyTransformer, make_trainer, token_loader

    calls = {"blocking": 0, "deferred": 0}
    blocking, deferred = DataParallelComm.ranks_with, DataParallelComm.ranks_with_later

    def count(name: str, fn: Any) -> Any:
        def wrapped(self: DataParallelComm, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(self, *args, **kwargs)
        return wrapped

    during: dict[str, int] = {}

    class Snapshot(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            during.update({f"start_{k}": v for k, v in calls.items()})

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            during.update({f"end_{k}": v for k, v in calls.items()})

    DataParallelComm.ranks_with = count("blocking", blocking)  # type: ignore[method-assign]
    DataParallelComm.ranks_with_later = count("deferred", deferred)  # type: ignore[method-assign]
    try:
        make_trainer(ZeroStrategy(stage=stage), accumulate_grad_batches=2, max_steps=2,
                     callbacks=[Snapshot()]).fit(TinyTransformer("adamw"), token_loader())
    finally:
        DataParallelComm.ranks_with, DataParallelComm.ranks_with_later = blocking, deferred  # type: ignore[method-assign]
    return during


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_the_step_error_agreement_makes_no_blocking_call_per_micro_step(gloo_pool, stage: int) -> None:
    for r in gloo_pool.run("tests.distributed.test_owner_exchange:agreement_body", stage=stage):
        assert r["end_blocking"] == r["start_blocking"]  # no blocking agreement during training
        assert r["end_deferred"] - r["start_deferred"] == 4  # one deferred agreement per micro-step


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_error_on_one_rank_still_raises_on_every_rank(gloo_pool, stage: int) -> None:
    results = gloo_pool.run("tests.distributed.test_strategy:bad_input_body", kind="raise_on_rank1", stage=stage)
    assert "boom on rank 1" in results[1]["message"], results[1]
    assert "raised on data-parallel rank(s) [1]" in results[0]["message"], results[0]
