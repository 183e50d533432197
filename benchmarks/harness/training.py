"""What every contender trains: the same GPT on the same per-rank batches, through Lightning or a plain loop."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.probes import count_by_hand
from benchmarks.harness.recorder import StepRecorder, TimingCallback
from lightning_zero.models.data import DeterministicShardSampler, RandomTokenDataset, TokenChunkDataset, load_corpus
from lightning_zero.models.gpt import GPT_PRESETS, GPTLightningModule


def module_for(config: BenchConfig) -> GPTLightningModule:
    """The GPT every contender trains: the preset with ``config.model_overrides``, seed 0, AdamW at lr 1e-4."""
    torch.manual_seed(0)  # the same initial weights on every rank and for every contender
    overrides = dict(config.model_overrides)
    if config.seq_len > GPT_PRESETS[config.model].seq_len:
        overrides["seq_len"] = config.seq_len
    return GPTLightningModule(config.model, lr=1e-4, warmup_steps=0, model_overrides=overrides or None)


def loader(config: BenchConfig, rank: int, world_size: int, stages: int = 1) -> DataLoader:
    """This rank's ``micro_batch`` sequences per step: disjoint across ranks, the same for every contender.

    Under a pipeline of ``stages`` stages the ranks of one data-parallel replica share its batch: it is the union
    of the rows those ranks take without a pipeline (``DeterministicShardSampler``), so every step trains the same
    global batch as the other contenders."""
    n = config.micro_batch * world_size * config.total_steps
    if config.data == "stdlib":
        dataset: Dataset = TokenChunkDataset(load_corpus(max_bytes=(n + 1) * config.seq_len + 1), config.seq_len)
    else:
        dataset = RandomTokenDataset(n, config.seq_len)
    replicas = world_size // stages  # pipeline/mesh.py: rank = stage * replicas + replica
    sampler = DeterministicShardSampler(len(dataset), replicas, rank % replicas, shuffle=False)
    return DataLoader(dataset, batch_size=config.micro_batch * stages, sampler=sampler, drop_last=True)


def fit(strategy: Strategy, config: BenchConfig, rec: StepRecorder, rank: int, world_size: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true",
                         max_steps=config.total_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[TimingCallback(rec, config)])  # fmt: skip
    pipeline = getattr(strategy, "pipeline_config", None)  # a pipelined ZeroStrategy's PipelineConfig
    trainer.fit(module_for(config), loader(config, rank, world_size, pipeline.stages if pipeline else 1))


def plain_loop(config: BenchConfig, rec: StepRecorder, rank: int, world_size: int) -> None:
    module = module_for(config)
    optimizer = module.configure_optimizers()
    for step, batch in enumerate(loader(config, rank, world_size)):
        rec.start()
        optimizer.zero_grad()
        loss = module.loss(batch)
        rec.mark("forward")
        loss.backward()
        rec.mark("backward")
        if step == config.total_steps - 1:
            rec.state = {**count_by_hand(module, optimizer, ddp=False), "live": rec.live_state_bytes()}
            rec.exclude_since_mark()
        optimizer.step()
        rec.mark("optimizer")
        rec.end(loss)


def zero_redundancy_loop(config: BenchConfig, rec: StepRecorder, rank: int, world_size: int) -> None:
    """PyTorch's own ZeRO-1: ``DistributedDataParallel`` (the run's bucket size) and ``ZeroRedundancyOptimizer``
    over the same AdamW param groups, in a plain loop."""
    module = module_for(config)
    adamw = module.configure_optimizers()
    accepted = set(inspect.signature(type(adamw)).parameters) | {"params"}  # not the defaults AdamW adds itself
    groups = [{k: v for k, v in g.items() if k in accepted} for g in adamw.param_groups]
    first, rest = groups[0], groups[1:]
    optimizer = ZeroRedundancyOptimizer(first.pop("params"), optimizer_class=type(adamw), **first)
    for group in rest:
        optimizer.add_param_group(group)
    model = DistributedDataParallel(module, bucket_cap_mb=config.bucket_size * 4 / 2**20)
    for step, (x, y) in enumerate(loader(config, rank, world_size)):
        rec.start()
        optimizer.zero_grad()
        loss = module.pipeline_loss(model(x), y)
        rec.mark("forward")
        loss.backward()
        rec.mark("backward")
        if step == config.total_steps - 1:
            rec.state = {**count_by_hand(module, optimizer.optim, ddp=True), "live": rec.live_state_bytes()}
            rec.exclude_since_mark()
        optimizer.step()
        rec.mark("optimizer")
        rec.end(loss)
