"""Sequence parallelism (DeepSpeed-Ulysses): the all-to-alls, the attention wrapper and the token-weighted
loss against one process; GPT fits split over a sequence group against the unsplit run (losses within 1e-5
relative, parameters within 1e-6, SGD, 5 steps): SP 2 on 2 ranks (dense at ZeRO 0 and 3, sparse at ZeRO 2)
against one process, and SP 2 x data 2 at ZeRO 3 on 4 ranks against 2 data-parallel ranks; and the
refusals, before any rank starts."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPTConfig, GPTLightningModule
from lightning_zero.sequence_parallel import DistributedAttention, SequenceGroup, gather_heads, scatter_heads
from lightning_zero.sparse_attention import SparseSelfAttention
from lightning_zero.sparse_attention.sparsity_config import FixedSparsityConfig
from tests.launches import ONE_RANK, SP2, SharedLaunches
from tests.pool import GlooPool, Pools

STEPS = 5
TINY = GPTConfig(seq_len=64, n_layer=2, n_head=4, n_embd=32)
SECTION = {"mode": "fixed", "block": 8, "num_local_blocks": 2, "attention": "unidirectional",
           "different_layout_per_head": True, "num_different_global_patterns": 2}


# ------------------------------------------------------------------------------------------ mechanism
def _slice(t: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    n = t.size(dim) // size
    return t.narrow(dim, rank * n, n)


def mechanism_body() -> None:
    """On each of 2 ranks: the all-to-alls, attention (dense and sparse, per-head layouts) and the loss
    against the same computation on the whole tensors in this process, values and gradients."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sg = SequenceGroup.of(None)
    assert (sg.size, sg.rank) == (size, rank)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        whole = torch.randn(2, 4, 8, 3, generator=gen).to(dtype)
        weight = torch.randn(2, 4, 8, 3, generator=gen).to(dtype)
        mine = _slice(whole, rank, size, 2).clone().requires_grad_()
        heads = scatter_heads(mine, None, sg.traffic)
        assert torch.equal(heads, _slice(whole, rank, size, 1)), dtype  # [b, h/P, seq, d]
        assert torch.equal(gather_heads(heads, None), mine), dtype
        (heads * _slice(weight, rank, size, 1)).sum().backward()
        assert torch.equal(mine.grad, _slice(weight, rank, size, 2)), dtype  # the reverse all-to-all
    # per dtype: the scatter and its backward, each sending all but its own chunk of 96 elements
    assert sg.traffic.calls == 6 and sg.traffic.bytes_sent == 2 * 96 // size * (size - 1) * (4 + 2 + 2)
    sparse = SparseSelfAttention(FixedSparsityConfig(4, block=2, different_layout_per_head=True, num_local_blocks=2,
                                                     num_different_global_patterns=2), max_seq_length=8, causal=True)
    assert not torch.equal(sparse.master_layout[0], sparse.master_layout[1])  # the heads' layouts differ
    for attention in (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), sparse):
        qkv = [torch.randn(2, 4, 8, 3, generator=gen, requires_grad=True) for _ in range(3)]
        weight = torch.randn(2, 4, 8, 3, generator=gen)
        expected = attention(*qkv)
        (expected * weight).sum().backward()
        parts = [_slice(t.detach(), rank, size, 2).clone().requires_grad_() for t in qkv]
        got = DistributedAttention(attention, sg)(*parts)
        torch.testing.assert_close(got, _slice(expected.detach(), rank, size, 2), rtol=0, atol=1e-6)
        (got * _slice(weight, rank, size, 2)).sum().backward()
        for part, t in zip(parts, qkv):
            torch.testing.assert_close(part.grad, _slice(t.grad, rank, size, 2), rtol=0, atol=1e-6)
    logits = torch.randn(2, 8, 5, generator=gen, requires_grad=True)
    targets = torch.randint(0, 5, (2, 8), generator=gen)
    targets[:, :3] = -100  # rank 0's slice has fewer labelled tokens: a plain mean of the ranks' means is wrong
    expected = F.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1))
    expected.backward()
    mine = _slice(logits.detach(), rank, size, 1).clone().requires_grad_()
    got = sg.loss(mine, sg.slice(targets))
    torch.testing.assert_close(got, expected.detach(), rtol=1e-6, atol=0)
    got.backward()  # each rank's share of P * the gradient (Note [token-weighted loss over data x sequence])
    torch.testing.assert_close(mine.grad, size * _slice(logits.grad, rank, size, 1), rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_all_to_all_attention_and_loss_match_one_process(gloo_pool: GlooPool) -> None:
    gloo_pool.run("tests.e2e.test_sequence_parallel:mechanism_body")


# ------------------------------------------------------------------------------------------ GPT parity
class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.losses.append(float(outputs["loss"]))


def _module(sparse: bool) -> GPTLightningModule:
    torch.manual_seed(0)
    config = replace(TINY, sparse_attention=SECTION) if sparse else TINY
    return GPTLightningModule(config, lr=0.05, optimizer="sgd", warmup_steps=0)


def _samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.randint(0, 256, (48, 65), generator=torch.Generator().manual_seed(1))
    out = []
    for i, row in enumerate(data):
        y = row[1:].clone()
        y[: 4 * (i % 5)] = -100  # unlabelled tokens, more in the first slice: the loss is token-weighted
        out.append((row[:-1], y))
    return out


def _flat(module: GPTLightningModule) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def unsplit_run(sparse: bool, shuffle: bool, seed: int) -> dict[str, Any]:
    """The reference in plain PyTorch, one process, the samples in the order of a one-replica
    ``DistributedSampler(shuffle, seed)`` (the one Lightning made in the split run)."""
    module = _module(sparse)
    opt = module.configure_optimizers()
    samples = _samples()
    order = [samples[i] for i in DistributedSampler(samples, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)]
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = (torch.stack(t) for t in zip(*order[4 * step: 4 * step + 4]))
        loss = module.loss((x, y))
        losses.append(float(loss))
        loss.backward()
        opt.step()
    return {"losses": losses, "params": _flat(module)}


def fit_body(stage: int, sequence_parallel: int, sparse: bool = False, reference: bool = False) -> dict[str, Any]:
    """This rank's losses, sampler shard and final parameters of a 5-step SGD fit of the tiny GPT; with
    ``reference``, the unsplit one-process run too."""
    from tests.models import make_trainer

    module, losses = _module(sparse), _Losses()
    strategy = ZeroStrategy(stage=stage, sequence_parallel=sequence_parallel)
    trainer = make_trainer(strategy, devices=dist.get_world_size(), max_steps=STEPS, callbacks=[losses],
                           use_distributed_sampler=True)
    seed = os.environ.get("PL_GLOBAL_SEED")  # Lightning's sampler seed: the same in every pool
    os.environ["PL_GLOBAL_SEED"] = "0"
    try:
        trainer.fit(module, torch.utils.data.DataLoader(_samples(), batch_size=4))
    finally:
        os.environ.pop("PL_GLOBAL_SEED") if seed is None else os.environ.update(PL_GLOBAL_SEED=seed)
    sampler = trainer.train_dataloader.sampler
    assert module.model is not None and module.model.sequence_group is None  # detached at teardown
    out = {"losses": losses.losses, "params": _flat(module), "shard": (sampler.num_replicas, sampler.rank)}
    if reference:
        out["unsplit"] = unsplit_run(sparse, sampler.shuffle, sampler.seed)
    return out


def _close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) == STEPS and len(set(expected)) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
    assert worst < 1e-5, (got, expected)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage,sparse", [(0, False), (3, False), (2, True)])
def test_sequence_parallel_2_follows_one_process(gloo_pool: GlooPool, stage: int, sparse: bool) -> None:
    """SP 2 on 2 ranks (both in one sequence group: one data shard) against the unsplit run."""
    runs = gloo_pool.run("tests.e2e.test_sequence_parallel:fit_body", stage=stage, sequence_parallel=2, sparse=sparse,
                         reference=True)
    for run in runs:
        assert run["shard"] == (1, 0)  # both ranks of the sequence group draw the same samples
        _close(run["losses"], run["unsplit"]["losses"])
        assert (run["params"] - run["unsplit"]["params"]).abs().max() < 1e-6
        assert not torch.equal(run["params"], _flat(_module(sparse)))  # trained


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_2_by_data_2_at_zero_3_follows_2_data_parallel_ranks(gloo_pool: GlooPool, gloo_pools: Pools) -> None:
    """4 ranks (2 sequence groups of 2) at ZeRO 3 against a real 2-rank data-parallel ZeRO 3 run."""
    data_parallel = gloo_pool.run("tests.e2e.test_sequence_parallel:fit_body", stage=3, sequence_parallel=1)
    split = gloo_pools.get(4).run("tests.e2e.test_sequence_parallel:fit_body", stage=3, sequence_parallel=2)
    for rank, run in enumerate(split):
        d = rank // 2  # Note [rank order]: rank = d * 2 + s
        assert run["shard"] == (2, d)
        _close(run["losses"], data_parallel[d]["losses"])
        assert (run["params"] - data_parallel[0]["params"]).abs().max() < 1e-6


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("args", "needle"), [
    (["sequence_parallel=sp4", "trainer.devices=6"], "sequence_parallel=4 does not divide the 6 ranks: launch a "
                                                     "multiple of 4 ranks"),
    (["sequence_parallel.size=3", "trainer.devices=3"], "the model's 4 attention heads do not split over "
                                                        "sequence_parallel=3: choose a size dividing the heads"),
    (["sequence_parallel=sp4", "trainer.devices=4", "data.seq_len=62"], "a sequence of 62 tokens does not split "
                                                                        "over sequence_parallel=4"),
    (["sequence_parallel=sp2", "pipeline=pp2_1f1b", "trainer.devices=4"],
     "sequence_parallel.size=2 with pipeline.stages=2: sequence parallel inside pipeline stages is not built"),
    (["sequence_parallel=sp2", "experiment=mlp"], "only the GPT experiment splits its sequences"),
])
def test_the_cli_refuses_what_sequence_parallel_cannot_split_before_launch(
        args: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "experiment=gpt_tiny", *args]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and needle in err, err
    assert not list(tmp_path.iterdir())  # no output directory, no process


def test_the_strategy_and_the_deepspeed_json_refuse_or_take_it() -> None:
    from lightning_zero import PipelineConfig
    from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy

    with pytest.raises(ValueError, match="pipeline stages is not built"):
        ZeroStrategy(sequence_parallel=2, pipeline=PipelineConfig(stages=2, micro_batches=2))
    with pytest.raises(ValueError, match="positive integer"):
        ZeroStrategy(sequence_parallel=0)
    ds = DeepSpeedZeroStrategy.from_deepspeed_config({"train_batch_size": 8, "sequence_parallel_size": 2})
    assert ds.sequence_parallel == 2
    with pytest.raises(ValueError, match="conflicting settings"):
        DeepSpeedZeroStrategy.from_deepspeed_config({"sequence_parallel_size": 2}, sequence_parallel=4)
    module = GPTLightningModule(replace(TINY, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="2 attention heads do not split over sequence_parallel=4"):
        module.configure_sequence_parallel(SequenceGroup(None, 4, 0))
    with pytest.raises(ValueError, match="a sequence of 6 tokens does not split over a sequence group of 4"):
        SequenceGroup(None, 4, 1).slice(torch.zeros(2, 6))


def test_a_module_without_the_hook_is_refused_at_setup() -> None:
    from lightning_zero.sequence_parallel import StrategySequenceParallel

    sp = StrategySequenceParallel.__new__(StrategySequenceParallel)
    sp.group = SequenceGroup(None, 2, 0)
    with pytest.raises(ValueError, match="has no `configure_sequence_parallel"):
        sp.attach(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------ CLI
def _val_losses(run: Path) -> dict[int, float]:
    """The run's validation losses by step, from its TensorBoard events (float32, as logged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("loss/val")}


@pytest.mark.slow
def test_cli_sequence_parallel_2_follows_the_one_rank_run(launches: SharedLaunches) -> None:
    """docs/sequence_parallel.md's two commands (the docs test quotes their outputs from the same runs): SP 2 on 2
    ranks has the 1-rank run's step-0 validation loss, and the same curve after (to 1e-5)."""
    split_run, one_run = launches.pool_cli(*SP2).check(), launches.pool_cli(*ONE_RANK).check()
    split, one = _val_losses(split_run.run_dir), _val_losses(one_run.run_dir)
    assert sorted(split) == sorted(one) == [0, 5, 10, 15, 20] and one[5] < one[0], (split, one)  # it learns
    assert max(abs(split[s] - one[s]) / one[s] for s in one) < 1e-5, (split, one)
    assert "sequence_parallel:\n  size: 2" in (split_run.run_dir / "config.yaml").read_text()


@pytest.mark.distributed
def test_bench_sequence_parallel_counts_the_formula_s_bytes(gloo_pools: Pools, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_sequence_parallel.py small (its numbers: docs/benchmarks.md): the bytes the all-to-alls
    send equal 8 B T H (P - 1) / P^2 elements per layer, at P = 2 and 4. Its ``traffic`` table runs in this
    process, each configuration's ranks in the session's pool of that size instead of fresh processes (the
    benchmark's own command starts them: docs/benchmarks.md)."""
    import sys

    import benchmarks.bench_sequence_parallel as bench

    def in_pool(size: int, args: list[str], timeout: float) -> dict:
        kind, length, _limit_mb, steps = args
        return gloo_pools.get(size).run("benchmarks.bench_sequence_parallel:measure", kind=kind, length=int(length),
                                        steps=int(steps), _timeout_s=timeout)[0]

    monkeypatch.setattr(bench, "_launch", in_pool)
    monkeypatch.setattr(sys, "argv", ["bench_sequence_parallel.py", "traffic", "--length", "128"])
    bench.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert len(rows) == 2 and all(row.endswith("| 1.000 |") for row in rows), out
