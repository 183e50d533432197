"""What every contender trains (:class:`BenchConfig`, sent to the workers) and the names of what is measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PHASES = ("forward", "backward", "reduce", "optimizer", "after_step")
STATE_KINDS = ("params", "grads", "optimizer", "comm_buffers")
DEFAULT_CONTENDERS = "ddp,ddp_nosync,zero0,zero1,zero2"
TARGET_RATIO = 1.10  # stages 1 and 2 should stay within this factor of DDP's step time
TARGET_RATIO_STAGE3 = 1.30  # stage 3: within this factor of DDP, and no slower / no larger than fsdp2
MB = 1e6
Runs = dict[str, list[list[dict[str, Any]]]]  # contender -> repeat -> rank -> run_contender()'s result


@dataclass(frozen=True)
class BenchConfig:
    """What every contender trains; sent to the workers."""

    model: str = "gpt_20m"
    micro_batch: int = 4
    seq_len: int = 128
    steps: int = 10
    warmup: int = 3
    bucket_size: int = 6_553_600  # elements per gradient bucket (fp32: 25 MiB, DDP's default)
    threads: int = 1
    data: str = "random"
    profile: bool = False
    prefetch_size: int | None = None  # stage 3 prefetch_bucket_size in elements (None: bucket_size)
    persistence_threshold: int = 100_000  # stage 3 param_persistence_threshold (DeepSpeed's default)
    max_live_parameters: int = 1_000_000_000  # stage 3 max_live_parameters (ZeroConfig's and DeepSpeed's default)
    model_overrides: tuple[tuple[str, int], ...] = ()  # GPTConfig fields replacing the preset's (e.g. n_layer)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps
