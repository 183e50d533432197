"""Where a training step's main-thread page faults happen (issue 35): per phase of the step and per ZeRO function.

A minor page fault is the first touch of memory the kernel has just handed over (a fresh ``mmap``, or heap grown
again after glibc trimmed it): each costs main-thread CPU. ``bench_breakdown.py`` counts them per step; this
probe says where. Per measured step, as means over both ranks and every measured step:

* phases, between Lightning's hooks: ``forward`` (``on_train_batch_start`` to ``on_before_zero_grad``),
  ``zero_grad``, ``backward`` (autograd, with the reduction hooks it runs), ``after backward`` (the engine's
  ``finish_backward``: the last messages and their waits), ``optimizer step`` (to ``on_train_batch_end``);
* functions of the ZeRO core, counted on the main thread, inclusive (a wrapped function called inside another
  counts in both), with their calls and main-thread CPU time per step;
* glibc's heap (``mallinfo2``) at the start of each step: ``arena`` (bytes of the brk heap) and ``mmapped``
  (bytes in blocks mapped on their own, which are unmapped when freed and fault afresh when allocated again),
  and the engine's ``model_state_bytes().pooled`` (idle memory kept for reuse).

Run from the repository root::

    python benchmarks/bench_faults.py --model gpt_20m --systems ddp,zero2,zero3 --steps 3 --warmup 2
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib
import os
import resource
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("forward", "zero_grad", "backward", "after backward", "optimizer step")
# (module, class, method): the ZeRO core's functions that allocate or touch buffers on the main thread
WRAPPED = (
    ("lightning_zero.core.stage3.sharded_unit", "ShardedUnit", "start_gather"),
    ("lightning_zero.core.stage3.sharded_unit", "ShardedUnit", "wait"),
    ("lightning_zero.core.stage3.sharded_unit", "ShardedUnit", "release"),
    ("lightning_zero.core.zero.exchange", "MessageStaging", "write"),
    ("lightning_zero.core.zero.exchange", "MessageStaging", "complete"),
    ("lightning_zero.core.zero.exchange", "GradShards", "write"),
    ("lightning_zero.core.zero.grad_reducer", "GradReducer", "_on_grad_ready"),
    ("lightning_zero.core.zero.grad_reducer", "GradReducer", "_launch_message"),
    ("lightning_zero.core.zero.grad_reducer", "GradReducer", "_retire"),
    ("lightning_zero.core.zero.engine", "ZeroEngine", "finish_backward"),
    ("lightning_zero.core.zero.engine", "ZeroEngine", "before_step"),
    ("lightning_zero.core.zero.engine", "ZeroEngine", "after_step"),
    ("lightning_zero.core.zero.engine", "ZeroEngine", "zero_grad"),
)


def thread_faults() -> int:
    """Minor page faults of the calling thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap() -> dict[str, float]:
    """glibc's ``mallinfo2()``: MB in the brk heap and in separately mapped blocks (empty off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {"arena MB": info.arena / 2**20, "mmapped MB": info.hblkhd / 2**20, "mmapped blocks": float(info.hblks)}


def engine_counters(trainer: Any) -> dict[str, float]:
    """Counts of the ZeRO engine that tell reuse from allocation (empty for DDP)."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None:
        return {}
    staged = engine.reducer.staged
    out = {
        "staging allocations": staged.staging_pool.allocations,
        "receive allocations": staged.receive_pool.allocations,
    }
    if engine.runtime is not None:
        out["unit gathers"] = sum(u.gathers for u in engine.runtime.units)
        out["gathers served by the pool"] = engine.runtime.pool.reused
    return {k: float(v) for k, v in out.items()}


class FaultProbe:
    """Counts main-thread faults per phase and per wrapped function; built in the worker by ``bench_breakdown.body``.

    Args:
        warmup: steps left out of the result.
    """

    def __init__(self, warmup: int) -> None:
        import lightning.pytorch as pl

        self.warmup, self.step = warmup, 0
        self.main = threading.get_native_id()
        self.phases: list[dict[str, float]] = []
        self.functions: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # name -> faults, calls, CPU s
        self.heaps: list[dict[str, float]] = []
        self.counters: list[dict[str, float]] = []
        self._wrap()
        probe = self

        class Callback(pl.Callback):
            def _mark(self, phase: int) -> None:
                probe.mark(phase)

            def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
                probe.begin(trainer)

            def on_before_zero_grad(self, *_: Any) -> None:
                self._mark(0)

            def on_before_backward(self, *_: Any) -> None:
                self._mark(1)

            def on_after_backward(self, *_: Any) -> None:
                self._mark(2)

            def on_before_optimizer_step(self, *_: Any) -> None:
                self._mark(3)

            def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
                self._mark(4)
                if probe.step >= probe.warmup:
                    after = engine_counters(trainer)
                    probe.counters.append({k: after[k] - probe.before[k] for k in after})
                probe.step += 1

        self.callback = Callback()

    def _wrap(self) -> None:
        for module_name, cls_name, method in WRAPPED:
            cls = getattr(importlib.import_module(module_name), cls_name)
            original = getattr(cls, method)
            if getattr(original, "_fault_probe", None) is not None:  # a pool worker reused from an earlier run
                original = original._fault_probe
            setattr(cls, method, self._counted(f"{cls_name}.{method}", original))

    def _counted(self, name: str, fn: Any) -> Any:
        probe = self

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_native_id() != probe.main or probe.step < probe.warmup:
                return fn(*args, **kwargs)
            before, cpu = thread_faults(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = probe.functions[name]
                entry[0] += thread_faults() - before
                entry[1] += 1
                entry[2] += time.thread_time() - cpu

        counted._fault_probe = fn  # type: ignore[attr-defined]
        return counted

    def begin(self, trainer: Any) -> None:
        self.before = engine_counters(trainer)
        if self.step >= self.warmup:
            engine = getattr(trainer.strategy, "engine", None)
            pooled = {"pooled MB": engine.model_state_bytes().pooled / 2**20} if engine is not None else {}
            self.heaps.append({**heap(), **pooled})
        self.last, self.current = thread_faults(), dict.fromkeys(PHASES, 0.0)

    def mark(self, phase: int) -> None:
        now = thread_faults()
        self.current[PHASES[phase]] += now - self.last
        self.last = now
        if phase == len(PHASES) - 1 and self.step >= self.warmup:
            self.phases.append(self.current)

    def result(self) -> dict[str, Any]:
        steps = max(len(self.phases), 1)
        return {
            "phases": self.phases,
            "functions": {k: [v / steps for v in vs] for k, vs in self.functions.items()},
            "heaps": self.heaps,
            "counters": self.counters,
        }


def probe(warmup: int) -> Any:
    """The callback ``bench_breakdown.body`` adds (its ``result()`` is the probe's)."""
    p = FaultProbe(warmup)
    p.callback.result = p.result  # type: ignore[attr-defined]
    return p.callback


def report(system: str, ranks: list[dict[str, Any]]) -> str:
    """One system's phases, functions and heap, as markdown."""
    probes = [r["probe"] for r in ranks]
    steps = [s for p in probes for s in p["phases"]]
    lines = [f"### {system}", "", "| phase | main-thread faults / step |", "|---|---|"]
    for phase in PHASES:
        lines.append(f"| {phase} | {statistics.fmean(s[phase] for s in steps):.0f} |")
    lines.append(f"| **step** | {statistics.fmean(sum(s.values()) for s in steps):.0f} |")
    names = sorted({n for p in probes for n in p["functions"]})
    if names:
        lines += [
            "",
            "| function (inclusive) | faults / step | calls / step | main CPU ms / step |",
            "|---|---|---|---|",
        ]
        for n in names:
            faults, calls, cpu = (
                statistics.fmean(p["functions"].get(n, [0.0] * 3)[i] for p in probes) for i in range(3)
            )
            lines.append(f"| {n} | {faults:.0f} | {calls:.1f} | {1e3 * cpu:.1f} |")
    counters = [c for p in probes for c in p["counters"] if c]
    if counters:
        lines += [
            "",
            "per step (mean): " + ", ".join(f"{k} {statistics.fmean(c[k] for c in counters):.1f}" for k in counters[0]),
        ]
    heaps = [h for p in probes for h in p["heaps"] if h]
    if heaps:
        lines += [
            "",
            "at step start (mean): " + ", ".join(f"{k} {statistics.fmean(h[k] for h in heaps):.1f}" for k in heaps[0]),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt_20m")
    p.add_argument("--systems", default="ddp,zero2,zero3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    from benchmarks.harness.config import BenchConfig
    from lightning_zero.testing.pool import GlooPool

    config = dataclasses.asdict(BenchConfig(model=args.model, steps=args.steps, warmup=args.warmup))
    pool = GlooPool(world_size=2, timeout_s=1800)
    try:
        for system in args.systems.split(","):
            ranks = pool.run(
                "benchmarks.bench_breakdown:body", system=system, config=config, probe="benchmarks.bench_faults:probe"
            )
            print(report(system, ranks), flush=True)
    finally:
        pool.close()
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


if __name__ == "__main__":
    main()
