"""The owner exchange of stages 2-3 on gloo (Note [owner exchange] in core/grad_reducer.py) and its
reused buffers (Note [reused buffers]): the slice arithmetic in one process, and on 2 gloo ranks a
training run whose losses and parameters are bitwise those of the all-reduce path."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.core.comm import DataParallelComm
from lightning_zero.core.flat_param import FlatParamGroup
from lightning_zero.core.grad_reducer import GradReducer, own_parts, sum_in_rank_order


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_own_parts_tile_the_bucket_in_rank_order(world_size: int) -> None:
    shard = 7
    for start in range(0, shard * world_size):
        for end in range(start + 1, shard * world_size + 1):
            parts = own_parts(start, end, shard, world_size)
            nonempty = [(lo, hi) for lo, hi in parts if hi > lo]
            assert nonempty[0][0] == 0 and nonempty[-1][1] == end - start  # covers the bucket...
            assert all(a[1] == b[0] for a, b in pairwise(nonempty))  # ...without gap or overlap
            for q, (lo, hi) in enumerate(parts):  # and each part is inside its rank's shard
                if hi > lo:
                    assert q * shard <= start + lo and start + hi <= (q + 1) * shard


def test_own_parts_of_a_bucket_across_three_shards() -> None:
    assert own_parts(5, 17, 6, 3) == [(0, 1), (1, 7), (7, 12)]
    assert own_parts(6, 12, 6, 3) == [(0, 0), (0, 6), (0, 0)]


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_sum_in_rank_order_adds_own_in_its_place(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    parts = [torch.randn(1000, generator=gen) * 10 ** (q % 3) for q in range(4)]
    own = parts[rank].clone()
    received = [p.clone() for p in parts]
    received[rank] = torch.full_like(own, float("nan"))  # the scratch slot: never read
    out = sum_in_rank_order(own, received, rank, received[rank])
    assert out.data_ptr() == received[rank].data_ptr()
    assert torch.equal(out, ((parts[0] + parts[1]) + parts[2]) + parts[3])  # rank order, bitwise


def _reducer(bucket_numel: int) -> tuple[nn.Module, GradReducer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    params = list(model.parameters())
    group = FlatParamGroup(params, world_size=1, rank=0)
    group.bind()
    names = {p: n for n, p in model.named_parameters()}
    return model, GradReducer([group], DataParallelComm(), 2, bucket_numel, True, torch.float32, names)


def _backward(model: nn.Module, reducer: GradReducer, x: torch.Tensor, use_first: bool = True) -> None:
    y = model[1](model[0](x)) if use_first else model[1](x[:, :4])
    y.pow(2).sum().backward()
    reducer.finish()


def test_reused_buffers_accumulate_and_never_leak_stale_values() -> None:
    model, reducer = _reducer(bucket_numel=12)
    assert len(reducer.buckets) >= 2
    x = torch.randn(6, 5)
    reference = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    reference.load_state_dict(model.state_dict())

    def expected(*inputs: tuple[torch.Tensor, bool]) -> torch.Tensor:
        reference.zero_grad()
        for xi, use_first in inputs:
            y = reference[1](reference[0](xi)) if use_first else reference[1](xi[:, :4])
            y.pow(2).sum().backward()
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in reference.parameters()])

    # two micro-steps accumulate: the first reduction writes the shard, the second adds
    _backward(model, reducer, x)
    _backward(model, reducer, 2 * x)
    shard = reducer.shard_grad(0)
    torch.testing.assert_close(shard, expected((x, True), (2 * x, True)), rtol=0, atol=1e-5)
    storage, pooled = shard.data_ptr(), reducer.pooled_bytes()
    assert pooled > 0 and reducer.live_buffers() == []  # idle buffers are pooled, none is live

    # the next step: the first layer gets no gradient, so its part must read zero, not last step's values
    reducer.zero()
    _backward(model, reducer, x, use_first=False)
    shard = reducer.shard_grad(0)
    assert shard.data_ptr() == storage and reducer.pooled_bytes() == pooled  # nothing allocated anew
    torch.testing.assert_close(shard, expected((x, False)), rtol=0, atol=1e-5)

    # a zero() followed by a read without any backward: all zeros
    reducer.zero()
    assert torch.count_nonzero(reducer.shard_grad(0)) == 0


# ---------------------------------------------------------------------------- 2 gloo ranks
def exchange_body(stage: int) -> dict[str, Any]:
    """Fits the same model with the all-reduce and with the owner exchange; counts exchanges."""
    from lightning_zero import ZeroStrategy
    from tests.models import TinyTransformer, make_trainer, params_of, token_loader

    calls = {"n": 0}
    original = DataParallelComm.exchange_to_owners

    def counting(self: DataParallelComm, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return original(self, *args, **kwargs)

    out: dict[str, Any] = {}
    DataParallelComm.exchange_to_owners = counting  # type: ignore[method-assign]
    try:
        for collective in ("all_reduce", "auto"):
            before = calls["n"]
            model = TinyTransformer("adamw")
            strategy = ZeroStrategy(stage=stage, reduce_bucket_size=100, collective=collective)
            make_trainer(strategy, accumulate_grad_batches=2, max_steps=3).fit(model, token_loader())
            out[collective] = {"losses": model.losses, "params": params_of(model), "exchanges": calls["n"] - before}
    finally:
        DataParallelComm.exchange_to_owners = original  # type: ignore[method-assign]
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_the_exchange_equals_the_all_reduce_bitwise_at_two_ranks(gloo_pool, stage: int) -> None:
    results = gloo_pool.run("tests.test_owner_exchange:exchange_body", stage=stage)
    for r in results:
        ref, got = r["all_reduce"], r["auto"]
        assert ref["exchanges"] == 0 and got["exchanges"] > 0  # each path ran what it names
        assert got["losses"] == ref["losses"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["auto"]["params"], results[1]["auto"]["params"]))


# ---------------------------------------------------------------------------- the step-error agreement
def agreement_body(stage: int) -> dict[str, Any]:
    """A fit with accumulation; counts blocking ``ranks_with`` agreements made during training."""
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
    for r in gloo_pool.run("tests.test_owner_exchange:agreement_body", stage=stage):
        assert r["end_blocking"] == r["start_blocking"]  # no blocking agreement during training
        assert r["end_deferred"] - r["start_deferred"] == 4  # one deferred agreement per micro-step


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_step_error_on_one_rank_raises_on_every_rank_at_any_stage(gloo_pool, stage: int) -> None:
    results = gloo_pool.run("tests.test_strategy:bad_input_body", kind="raise_on_rank1", stage=stage)
    assert "boom on rank 1" in results[1]["message"], results[1]
    assert "raised on data-parallel rank(s) [1]" in results[0]["message"], results[0]


def three_rank_body() -> dict[str, Any]:
    """The same rank-specific gradients reduced by the exchange and by the all-reduce (core level)."""
    import torch.distributed as dist

    shards = {}
    for collective in ("all_reduce", "auto"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 5))
        group = FlatParamGroup(list(model.parameters()), world_size=3, rank=dist.get_rank())
        group.bind()
        names = {p: n for n, p in model.named_parameters()}
        reducer = GradReducer([group], DataParallelComm(None, collective), 2, 20, True, torch.float32, names)
        for micro in range(2):  # the second micro-step adds into the shard
            torch.manual_seed(10 * dist.get_rank() + micro)
            model(torch.randn(4, 7)).pow(2).sum().backward()
            reducer.finish()
        shards[collective] = reducer.shard_grad(0).clone()
        reducer.remove_hooks()
    return {"all_reduce": shards["all_reduce"], "exchange": shards["auto"]}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_exchange_equals_the_all_reduce_within_rounding_at_three_ranks() -> None:
    from lightning_zero.testing.pool import GlooPool

    pool = GlooPool(world_size=3)
    try:
        for r in pool.run("tests.test_owner_exchange:three_rank_body"):
            assert r["exchange"].abs().sum() > 0
            torch.testing.assert_close(r["exchange"], r["all_reduce"], rtol=1e-6, atol=1e-6)
    finally:
        pool.close()
