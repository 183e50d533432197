"""DeepSpeed's ZeRO stages 0-3 as benchmark contenders: a plain loop over ``deepspeed.initialize``.

Lightning's ``DeepSpeedStrategy`` refuses the CPU, so DeepSpeed trains the same module (seed 0), on the same
per-rank rows, with the same ``torch.optim.AdamW`` param groups (a client optimizer: DeepSpeed partitions it),
fp32, no gradient clipping. DeepSpeed is not a dependency of this project: these contenders run in a pool whose
workers use an interpreter that has it (``run_all.py --deepspeed-python``), with ``DS_ACCELERATOR=cpu``. The first
``deepspeed.initialize`` in a process may compile ops (and import DeepSpeed's modules): it is timed on its own
(``extra["ds_first_init_s"]``), outside every step.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.recorder import StepRecorder
from benchmarks.harness.training import loader, module_for
from lightning_zero.core.common.choices import ZeroStage

_FIRST_INIT: dict[str, float] = {}  # per process: seconds of the first deepspeed.initialize (op builds)


def deepspeed_config(stage: int, config: BenchConfig) -> dict[str, Any]:
    """DeepSpeed's JSON config for ``stage`` with the run's buckets and stage-3 settings."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": config.bucket_size,
                            "allgather_bucket_size": config.bucket_size, "overlap_comm": False,
                            "contiguous_gradients": True}  # fmt: skip
    if ZeroStage.of(stage).shards_parameters:
        zero.update(stage3_prefetch_bucket_size=config.prefetch_size or config.bucket_size,
                    stage3_param_persistence_threshold=config.persistence_threshold,
                    stage3_max_live_parameters=config.max_live_parameters)  # fmt: skip
    return {"train_micro_batch_size_per_gpu": config.micro_batch, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}  # fmt: skip


def deepspeed_loop(stage: int) -> Any:
    """The loop training DeepSpeed's ``stage``: ``(config, recorder, rank, world_size) -> None``."""

    def run(config: BenchConfig, rec: StepRecorder, rank: int, world_size: int) -> None:
        t = time.perf_counter()
        import deepspeed  # inside the worker: only the DeepSpeed pool's interpreter has it

        module = module_for(config)
        optimizer = module.configure_optimizers()
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=deepspeed_config(stage, config),
                                          dist_init_required=not dist.is_initialized())  # fmt: skip
        _FIRST_INIT.setdefault("s", time.perf_counter() - t)
        rec.info["ds_first_init_s"] = _FIRST_INIT["s"]
        rec.info["ds_init_s"] = time.perf_counter() - t
        for step, batch in enumerate(loader(config, rank, world_size)):
            rec.start()
            loss = engine(batch[0])  # forward of the wrapped module: logits
            loss = module.pipeline_loss(loss, batch[1])
            rec.mark("forward")
            engine.backward(loss)
            rec.mark("backward")
            if step == config.total_steps - 1:
                rec.state = {"live": rec.live_state_bytes()}
                rec.exclude_since_mark()
            engine.step()
            rec.mark("optimizer")
            rec.end(loss)
        engine.destroy() if hasattr(engine, "destroy") else None

    return run
