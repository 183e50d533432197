"""One contender run on one rank, the task the shared gloo pool executes (``lightning_zero.testing.pool``)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
from typing import Any

import torch.distributed as dist

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.contenders import CONTENDERS
from benchmarks.harness.recorder import StepRecorder
from benchmarks.harness.training import fit
from lightning_zero import ZeroStrategy
from lightning_zero.testing.memory import proc_status_bytes, reset_peak_rss


def _peak_rss(reset: bool = False) -> tuple[float, str]:
    """(bytes, source): VmHWM since the last reset where /proc allows resetting it, else ru_maxrss (lifetime)."""
    try:
        if reset:
            reset_peak_rss()
        return float(proc_status_bytes("VmHWM")), "VmHWM"
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "ru_maxrss"


def run_contender(name: str, config: BenchConfig) -> dict[str, Any]:
    """Train contender ``name`` for ``config.total_steps`` steps on this rank; its raw measurements."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the previous contender's heap back to the OS
    _peak_rss(reset=True)
    rec, contender = StepRecorder(), CONTENDERS[name]
    built = contender.build(config)
    if contender.kind == "lightning":
        fit(built, config, rec, rank, world_size)
    else:
        built(config, rec, rank, world_size)
    rss, source = _peak_rss()
    gathered = built.gathered_peak_numel if isinstance(built, ZeroStrategy) else 0  # stage 3, elements
    return {"times": rec.times, "cpu": rec.cpu, "phases": rec.phases, "extra": rec.extra, "state": rec.state,
            "rss": rss, "rss_source": source, "gathered_peak_numel": gathered, "losses": rec.losses,
            "info": rec.info}  # fmt: skip
