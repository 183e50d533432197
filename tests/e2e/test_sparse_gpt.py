"""Sparse attention inside the GPT experiment: equal to the same GPT with dense attention masked by
the layout (forward and gradients), in short ZeRO 0-3 fits (stage 3 with activation checkpointing),
from ``lightning-zero train`` with ``model.attention=sparse_fixed`` or a DeepSpeed JSON section, and under
``pipeline`` (2 stages on 2 ranks) against the unsplit one-process run."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPT, GPTConfig, GPTLightningModule
from lightning_zero.sparse_attention import SparseSelfAttention
from tests.in_pool import run_in_process
from tests.launches import Launch
from tests.pool import GlooPool

SECTION = {"mode": "fixed", "block": 8, "num_local_blocks": 2, "attention": "unidirectional"}
TINY = GPTConfig(seq_len=60, n_layer=2, n_head=4, n_embd=32)


class MaskedDense(nn.Module):
    """The reference: SDPA over the full score matrix with the sparse layer's layout (and causality) as mask."""

    def __init__(self, sparse: SparseSelfAttention) -> None:
        super().__init__()
        self.sparse, self.sparsity_config = sparse, sparse.sparsity_config

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        length, block = q.shape[-2], self.sparse.sparsity_config.block
        layout = self.sparse.get_layout(length).bool()
        mask = layout.repeat_interleave(block, 1).repeat_interleave(block, 2) & torch.ones(
            length, length, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _as_masked_dense(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if getattr(module, "sparse_attention", None) is not None:
            module.sparse_attention = MaskedDense(module.sparse_attention)
    return model


def test_gpt_sparse_equals_dense_attention_masked_by_the_layout() -> None:
    config = replace(TINY, sparse_attention=SECTION)
    torch.manual_seed(0)
    sparse = GPT(config)
    torch.manual_seed(0)
    reference = _as_masked_dense(GPT(config))
    x = torch.randint(0, 256, (3, 60))  # 60 tokens: not a multiple of the block, padded inside attention
    out, ref = sparse(x), reference(x)
    assert (out - ref).abs().max() < 1e-5
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, a), b in zip(sparse.named_parameters(), reference.parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-5, name
    torch.manual_seed(0)
    dense = GPT(TINY)
    assert not torch.allclose(dense(x), out, atol=1e-3)  # the layout does change the model


def test_gpt_refuses_sparse_attention_with_dropout() -> None:
    with pytest.raises(ValueError, match="dropout=0"):
        GPT(replace(TINY, dropout=0.1, sparse_attention=SECTION))
    with pytest.raises(ValueError, match="does not take"):
        GPT(replace(TINY, sparse_attention={"mode": "bigbird", "num_local_blocks": 2}))


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.losses.append(float(outputs["loss"]))


def _fit(stage: int, reference: bool) -> list[float]:
    pl.seed_everything(0)
    module = GPTLightningModule(replace(TINY, seq_len=64, sparse_attention=SECTION), lr=3e-3, warmup_steps=0)
    if reference:
        _as_masked_dense(module.model)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (24, 65), generator=g)
    loader = torch.utils.data.DataLoader([(row[:-1], row[1:]) for row in data], batch_size=4)
    losses = _Losses()
    strategy = ZeroStrategy(stage=stage, activation_checkpointing=stage == 3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[losses])
    trainer.fit(module, loader)
    return losses.losses


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_fits_match_the_masked_dense_model(stage: int) -> None:
    sparse, reference = _fit(stage, False), _fit(stage, True)
    assert len(sparse) == 4 and len(set(sparse)) == 4  # the weights move
    assert max(abs(a - b) for a, b in zip(sparse, reference)) < 1e-4, (sparse, reference)


def _train(args: list[str], cwd: Path) -> Launch:
    """One rank: the command trains in this process, as ``lightning-zero train trainer=cpu1`` does."""
    return run_in_process(["train", "experiment=gpt_tiny", "trainer=cpu1", "trainer.max_steps=6",
                           "trainer.val_check_interval=3", "logger=csv", *args], cwd)


def _val_losses(cwd: Path) -> list[float]:
    result = json.loads(next(cwd.rglob("result.json")).read_text())
    return [v for k, v in sorted(result.items()) if "val_loss" in k and isinstance(v, float)]


@pytest.mark.slow
def test_cli_trains_with_sparse_attention_from_hydra_and_from_a_deepspeed_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    hydra = tmp_path / "hydra"
    hydra.mkdir()
    proc = _train(["model.attention=sparse_fixed"], hydra)
    assert proc.returncode == 0, proc.output[-3000:]
    saved = next(hydra.rglob("config.yaml")).read_text()
    assert "attention: sparse_fixed" in saved
    assert "val_loss" in proc.output
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "ds.json").write_text(json.dumps({"sparse_attention": {"mode": "bigbird", "block": 16,
                                                                 "num_random_blocks": 1, "seed": 3}}))
    proc = _train(["deepspeed_config=ds.json"], ds)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "unsupported" not in proc.output.lower()
    assert "mode: bigbird" in next(ds.rglob("config.yaml")).read_text()
    bad = tmp_path / "bad"
    bad.mkdir()
    monkeypatch.chdir(bad)  # a refused command starts nothing: cli.main in this process, not a fresh interpreter
    from lightning_zero.cli import main

    code = main(["train", "experiment=gpt_tiny", "trainer=cpu1", "model.attention=sparse_fixd"])
    out = capsys.readouterr()
    assert code == 2 and "choose one of" in out.out + out.err, out.err[-3000:]
    assert not list(bad.iterdir())  # no output directory


def test_deepspeed_strategy_refuses_a_sparse_section_the_model_does_not_use() -> None:
    from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy

    strategy = DeepSpeedZeroStrategy.from_deepspeed_config(
        {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "sparse_attention": SECTION})
    module = GPTLightningModule(replace(TINY, seq_len=64), warmup_steps=0)  # dense attention
    loader = torch.utils.data.DataLoader([(torch.zeros(64, dtype=torch.long),) * 2] * 4, batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="has no sparse attention"):
        trainer.fit(module, loader)


def bench_worker_body(args: list[str]) -> dict:
    """Pool body: one measurement of benchmarks/bench_sparse_attention.py's worker on this rank."""
    from benchmarks.bench_sparse_attention import run_worker

    return run_worker(args)


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_sparse_attention_runs_small(gloo_pool: GlooPool, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_sparse_attention.py end to end at one short length (its numbers: docs/benchmarks.md). Its
    ``attention`` table runs in this process, each measurement on the session's pool (rank 0's) instead of a fresh
    process (the benchmark's own command starts them: its peak memory is a fresh process's)."""
    import benchmarks.bench_sparse_attention as bench

    def in_pool(args: list[str], timeout: float) -> dict:
        return gloo_pool.run("tests.e2e.test_sparse_gpt:bench_worker_body", args=args, _timeout_s=timeout)[0]

    monkeypatch.setattr(bench, "_spawn", in_pool)
    monkeypatch.setattr(sys, "argv", ["bench_sparse_attention.py", "attention", "--lengths", "1024", "--rounds", "1",
                                      "--threads", "1"])
    bench.main()
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| tokens |"))
    row = next(line for line in lines if line.startswith("| 1024 |"))
    assert row.count("|") == header.count("|") and " - " not in row and "failed runs" not in out


# ------------------------------------------------------------------------------------------ pipeline
PIPE_STEPS = 4


def _pipe_module() -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(replace(TINY, seq_len=64, sparse_attention=SECTION), lr=3e-3, warmup_steps=0)


def _pipe_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.randint(0, 256, (PIPE_STEPS * 4, 65), generator=torch.Generator().manual_seed(1))
    return [(row[:-1], row[1:]) for row in data]


def pipeline_parity_body(zero_stages: tuple[int, ...]) -> dict[int, dict[str, list[float]]]:
    """Per ZeRO stage: this rank's losses from 2 pipeline stages on 2 ranks, and the unsplit sparse GPT's
    losses trained in plain PyTorch on this process with the same batches (the 1-rank reference)."""
    import torch.distributed as dist

    from lightning_zero import PipelineConfig
    from tests.models import make_trainer

    reference = _pipe_module()
    opt = reference.configure_optimizers()
    loader = torch.utils.data.DataLoader(_pipe_batches(), batch_size=4)
    expected = []
    for x, y in loader:
        opt.zero_grad()
        loss = reference.loss((x, y))
        loss.backward()
        opt.step()
        expected.append(float(loss))
    out = {}
    for stage in zero_stages:
        module, losses = _pipe_module(), _Losses()
        config = PipelineConfig(stages=2, micro_batches=2, schedule="1f1b", partition_method="uniform")
        strategy = ZeroStrategy(stage=stage, pipeline=config, param_persistence_threshold=0)
        make_trainer(strategy, devices=dist.get_world_size(), max_steps=PIPE_STEPS, callbacks=[losses]).fit(
            module, torch.utils.data.DataLoader(_pipe_batches(), batch_size=4))
        out[stage] = {"pipelined": losses.losses, "unsplit": expected}
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_pipelined_sparse_gpt_follows_the_unsplit_sparse_run(gloo_pool: GlooPool) -> None:
    """2 pipeline stages on 2 ranks at ZeRO 1 and 3: the sparse GPT's losses follow the one-process run."""
    for per_rank in gloo_pool.run("tests.e2e.test_sparse_gpt:pipeline_parity_body", zero_stages=(1, 3)):
        for stage, run in per_rank.items():
            pipelined, unsplit = run["pipelined"], run["unsplit"]
            assert len(pipelined) == len(unsplit) == PIPE_STEPS and len(set(unsplit)) == PIPE_STEPS
            worst = max(abs(a - b) / abs(b) for a, b in zip(pipelined, unsplit))
            assert worst < 1e-5, (stage, pipelined, unsplit)


def test_deepspeed_strategy_refuses_a_sparse_section_other_than_the_models() -> None:
    """The section must be what the model runs: a model built with another mode or other keys is refused (it was
    accepted, and the section silently not applied), and the same section passes."""
    from lightning_zero.deepspeed.strategy import _check_sparse_attention

    built = GPTLightningModule(replace(TINY, seq_len=64, sparse_attention=SECTION), warmup_steps=0)
    _check_sparse_attention(SECTION, built, "ds.json")  # the model's own section
    for other in ({**SECTION, "mode": "bslongformer"}, {**SECTION, "block": SECTION.get("block", 16) * 2}):
        other = {k: v for k, v in other.items() if other["mode"] != "bslongformer" or k in ("mode", "block")}
        with pytest.raises(ValueError, match="is not the sparse attention"):
            _check_sparse_attention(other, built, "ds.json")
