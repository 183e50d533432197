"""The contenders, registered in this one place: :data:`CONTENDERS` maps a name to a way of training."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.deepspeed_loop import deepspeed_loop
from benchmarks.harness.fsdp2 import FSDP2Strategy
from benchmarks.harness.training import plain_loop, zero_redundancy_loop
from lightning_zero import PipelineConfig, ZeroStrategy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.runtime import Agreement


@dataclass(frozen=True)
class Contender:
    """A way of training. ``build(config)`` returns a Lightning strategy (``kind="lightning"``) or, for
    ``kind="loop"``, a function ``(config, recorder, rank, world_size) -> None`` running its own loop.
    ``pool="deepspeed"``: it runs in the workers of the interpreter that has DeepSpeed (see run_all.py);
    ``compared=False``: a diagnostic that trains a different model (no gradient exchange), left out of the loss
    agreement check and of the peer tables."""

    name: str
    kind: str
    build: Callable[[BenchConfig], Any]
    description: str
    pool: str = "main"
    compared: bool = True


CONTENDERS: dict[str, Contender] = {}


def register(name: str, kind: str, description: str, pool: str = "main",
             compared: bool = True) -> Callable[[Callable[[BenchConfig], Any]], Any]:  # fmt: skip
    """Decorator adding a ``build`` function to :data:`CONTENDERS` under ``name``."""

    def decorate(build: Callable[[BenchConfig], Any]) -> Callable[[BenchConfig], Any]:
        CONTENDERS[name] = Contender(name, kind, build, description, pool, compared)
        return build

    return decorate


@register("ddp", "lightning", "Lightning DDPStrategy (torch DDP, bucket_cap_mb from --bucket-size)")
def _ddp(config: BenchConfig) -> Strategy:
    return DDPStrategy(process_group_backend="gloo", bucket_cap_mb=config.bucket_size * 4 / 2**20)


class _NoSyncDDP(DDPStrategy):
    """DDP whose gradients are never all-reduced: every step runs as inside ``DDP.no_sync()``."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        assert isinstance(self.model, DistributedDataParallel)
        self.model.require_backward_grad_sync = False  # the flag that no_sync() clears


@register("ddp_nosync", "lightning", "ddp with no gradient all-reduce (no_sync on every step): comm baseline",
          compared=False)
def _ddp_nosync(config: BenchConfig) -> Strategy:
    return _NoSyncDDP(process_group_backend="gloo", bucket_cap_mb=config.bucket_size * 4 / 2**20)


def _zero(stage: int, **options: Any) -> Callable[[BenchConfig], Strategy]:
    def build(config: BenchConfig) -> Strategy:
        kwargs = {"reduce_bucket_size": config.bucket_size, **options}  # a variant's own bucket size wins
        return ZeroStrategy(stage, process_group_backend="gloo", monitor=False, **kwargs)

    return build


for _s in (0, 1, 2):
    register(f"zero{_s}", "lightning", f"ZeroStrategy(stage={_s}), buckets of --bucket-size")(_zero(_s))
for _s in (1, 2):  # diagnostic variants, not run by default
    for _suffix, _options in (("nocheck", {"check_step_errors": False}), ("rs", {"collective": "reduce_scatter"}),
                              ("defaults", {"reduce_bucket_size": ZeroConfig().reduce_bucket_size})):  # fmt: skip
        register(f"zero{_s}_{_suffix}", "lightning", f"zero{_s} with {_options}")(_zero(_s, **_options))
register("pp2_1f1b", "lightning", "ZeroStrategy(stage=1) over 2 pipeline stages (1F1B, 4 micro-batches): one "
         "data-parallel replica, whose batch is both ranks' rows")(
    _zero(1, pipeline=PipelineConfig(stages=2, micro_batches=4, schedule="1f1b")))
register("zero2_nooverlap", "lightning", "zero2 with {'overlap_comm': False}")(_zero(2, overlap_comm=False))
register("zero2_offload", "lightning", "zero2 with offload_optimizer='cpu' (master + AdamW state in separate "
         "host buffers)")(_zero(2, offload_optimizer="cpu"))  # fmt: skip


def _zero3(cls: type[ZeroStrategy] = ZeroStrategy, **options: Any) -> Callable[[BenchConfig], Strategy]:
    def build(config: BenchConfig) -> Strategy:
        kwargs = {"reduce_bucket_size": config.bucket_size,
                  "prefetch_bucket_size": config.prefetch_size or config.bucket_size,
                  "param_persistence_threshold": config.persistence_threshold,
                  "max_live_parameters": config.max_live_parameters, **options}  # fmt: skip
        if kwargs.get("offload_optimizer") == "nvme":
            kwargs["nvme_path"] = os.getcwd()  # the pool task's own temporary directory, removed afterwards
        return cls(3, process_group_backend="gloo", monitor=False, **kwargs)

    return build


register("zero3", "lightning", "ZeroStrategy(stage=3), buckets and prefetch of --bucket-size")(_zero3())
for _suffix, _options in (("nocheck", {"check_step_errors": False}), ("rs", {"collective": "reduce_scatter"}),
                          ("noprefetch", {"prefetch_bucket_size": 1}), ("persist0", {"param_persistence_threshold": 0}),
                          ("defaults", {"prefetch_bucket_size": ZeroConfig().prefetch_bucket_size})):  # fmt: skip
    register(f"zero3_{_suffix}", "lightning", f"zero3 with {_options}")(_zero3(**_options))


register("zero3_offload_nvme", "lightning", "zero3 with offload_param='nvme' and offload_optimizer='nvme' "
         "(parameter shards, master and AdamW state in swap files in the run's temporary directory)")(
    _zero3(offload_optimizer="nvme", offload_param="nvme"))  # fmt: skip
register("zero3_offload_opt_nvme", "lightning", "zero3 with offload_optimizer='nvme' only")(
    _zero3(offload_optimizer="nvme"))  # fmt: skip


def _stage3_as(agreement: Agreement = Agreement.WHILE_RECORDING, pool: bool = True,
               lend: bool = True) -> type[ZeroStrategy]:  # fmt: skip
    """Stage 3 with the speed items of issue 21 switched on or off after setup, to measure each: the gather
    agreement (``Stage3Runtime.agreement``: ``ALWAYS`` is the behaviour before it was limited to recording,
    ``OFF`` a diagnostic under which ranks that ran different units would exchange the wrong buffers), the
    pool of gathered memory (``ShardedUnit.pool``, Note [gather buffer pool]) and the one-rank lending of the
    shard's memory (``ShardedUnit.lend``, Note [one rank]); core/stage3/runtime.py, core/stage3/gather_pool.py."""

    class _Zero3Variant(ZeroStrategy):
        def setup(self, trainer: pl.Trainer) -> None:
            super().setup(trainer)
            runtime = self.engine.runtime if self.engine is not None else None
            if runtime is not None:
                runtime.agreement = agreement
                for unit in runtime.units:
                    unit.lend = lend
                    unit.pool = unit.pool if pool else None

    return _Zero3Variant


register("zero3_noagree", "lightning", "zero3 without the gather agreement all-reduce (diagnostic)")(
    _zero3(_stage3_as(Agreement.OFF)))  # fmt: skip
register("zero3_agree_always", "lightning", "zero3 checking every gather (as before issue 21)")(
    _zero3(_stage3_as(Agreement.ALWAYS)))  # fmt: skip
register("zero3_nopool", "lightning", "zero3 re-allocating every gather's memory (as before issue 21)")(
    _zero3(_stage3_as(pool=False)))  # fmt: skip
register("zero3_copy", "lightning", "zero3 copying the shard at one rank (as before issue 21)")(
    _zero3(_stage3_as(lend=False)))  # fmt: skip
register("zero3_before", "lightning", "zero3 with all three stage-3 speed items of issue 21 off")(
    _zero3(_stage3_as(Agreement.ALWAYS, pool=False, lend=False)))  # fmt: skip


@register("fsdp2", "lightning", "PyTorch FSDP2 fully_shard per block + root, via ModelParallelStrategy")
def _fsdp2(config: BenchConfig) -> Strategy:
    return FSDP2Strategy()


@register("fsdp2_noreshard", "lightning", "fsdp2 with reshard_after_forward=False (ZeRO-2-like gathers)")
def _fsdp2_noreshard(config: BenchConfig) -> Strategy:
    return FSDP2Strategy(reshard_after_forward=False)


@register("torch_zero1", "loop", "PyTorch DDP + torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1), plain loop")
def _torch_zero1(config: BenchConfig) -> Callable[..., None]:
    return zero_redundancy_loop


for _s in (0, 1, 2, 3):
    register(f"ds_zero{_s}", "loop", f"DeepSpeed {(_s and 'ZeRO stage ' + str(_s)) or 'stage 0 (data parallel)'}: "
             "deepspeed.initialize with the same AdamW, plain loop", pool="deepspeed")(
        lambda config, _s=_s: deepspeed_loop(_s))  # fmt: skip


@register("local", "loop", "plain PyTorch loop: no Lightning, no communication (each rank trains alone)",
          compared=False)
def _plain(config: BenchConfig) -> Callable[..., None]:
    return plain_loop
