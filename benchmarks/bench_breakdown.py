"""Per-step breakdown of Lightning DDP and ZeRO stages 1-3 on gloo: where a step's time goes.

The same GPT on the same rows as every contender (``benchmarks/harness/training.py``), on 2 gloo ranks, the
systems interleaved over rounds. Per measured step, as the mean over both ranks and all measured steps of all
rounds (the median for the step time):

* ``step ms``: wall time from ``on_train_batch_start`` to ``on_train_batch_end``;
* ``main CPU ms``: CPU time of the main thread (``time.thread_time``): forward, backward, optimizer and the
  Python around them, i.e. compute on the main thread;
* ``main waits ms``: step time minus main CPU: the main thread blocked (in a collective's wait) or preempted;
* ``other threads CPU ms``: CPU time of every other thread of the rank (``/proc/self/task/<tid>/stat``, utime +
  stime): gloo's worker threads, which run the collectives and compete with compute for the cores;
* ``collectives``: per step, how many and how many bytes this rank sent under the ring model of
  ``core/comm/data_parallel.py`` (an all-reduce of B bytes sends 2(N-1)/N B). ZeroStrategy: the strategy's
  numbered collectives (the hang watchdog's record) and ``DataParallelComm.bytes_sent``; DDP: its gradient
  buckets, counted by a communication hook around torch's all-reduce hook;
* ``main page faults``: minor page faults of the main thread (``/proc/self/task/<tid>/stat``): first touches of
  freshly allocated buffers cost main-thread CPU;
* ``blocked ms``: ZeroStrategy's ``DataParallelComm.wait_seconds`` (host time blocked in its collectives); DDP's
  waits happen inside autograd's C++ reducer and are only seen in ``main waits``.

Run from the repository root::

    python benchmarks/bench_breakdown.py --model gpt_20m --rounds 3 --steps 7
    python benchmarks/bench_breakdown.py --quick          # a smoke run on the tiny GPT
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEMS = ("ddp", "zero1", "zero2", "zero3")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def other_threads_cpu_s() -> float:
    """CPU seconds (user + system) of every thread of this process but the calling one."""
    me = threading.get_native_id()
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total * _TICK_S


def main_minor_faults() -> int:
    """Minor page faults of the calling thread so far (first touches of fresh memory, among others)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt (field 10 of stat)


def _strategy(system: str, config: Any, counters: dict[str, float]) -> Any:
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from benchmarks.harness.contenders import CONTENDERS

    if system != "ddp":
        return CONTENDERS[system].build(config)

    def counting_hook(state: Any, bucket: Any) -> Any:
        n = bucket.buffer().numel() * bucket.buffer().element_size()
        counters["collectives"] += 1
        counters["bytes"] += 2 * n // 2  # ring all-reduce of n bytes at N = 2 ranks: 2(N-1)/N n
        return default_hooks.allreduce_hook(state, bucket)

    import torch
    import torch.distributed as dist

    # DDP checks the hook's annotations as objects (this module's are strings)
    counting_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}

    class CountedDDP(DDPStrategy):  # Lightning registers ddp_comm_hook on CUDA only
        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            self.model.register_comm_hook(None, counting_hook)

    return CountedDDP(process_group_backend="gloo", bucket_cap_mb=config.bucket_size * 4 / 2**20)


def body(system: str, config: dict[str, Any], probe: str | None = None) -> dict[str, Any]:
    """One fit of ``system`` on this rank; per measured step: wall, main CPU, other threads' CPU, collectives.

    Args:
        system: a name of :data:`SYSTEMS`.
        config: a ``BenchConfig`` as a dict.
        probe: ``"module:factory"`` of a further callback (``factory(warmup)``) whose ``result()`` is returned
            under ``"probe"`` (``bench_faults.py``).
    """
    import lightning.pytorch as pl
    import torch.distributed as dist

    from benchmarks.harness.config import BenchConfig
    from benchmarks.harness.training import loader, module_for
    from lightning_zero import ZeroStrategy
    from lightning_zero.core.reliability.progress_record import RECORD

    cfg = BenchConfig(**config)
    ddp_counters = {"collectives": 0.0, "bytes": 0.0}
    strategy = _strategy(system, cfg, ddp_counters)
    rows: list[dict[str, float]] = []
    extra = []
    if probe is not None:
        module_name, factory = probe.split(":")
        extra.append(getattr(importlib.import_module(module_name), factory)(cfg.warmup))

    def counters(trainer: pl.Trainer) -> dict[str, float]:
        s = trainer.strategy
        if isinstance(s, ZeroStrategy) and s.engine is not None:
            comm = s.engine.comm
            return {"collectives": RECORD.seq, "bytes": comm.bytes_sent, "blocked": comm.wait_seconds}
        return {**ddp_counters, "blocked": 0.0}

    class Breakdown(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            self.start = (time.perf_counter(), time.thread_time(), other_threads_cpu_s(), counters(trainer))
            self.faults = main_minor_faults()

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            wall, cpu, others, before = self.start
            after = counters(trainer)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            rows.append({"wall": wall, "main_cpu": cpu, "main_wait": max(wall - cpu, 0.0),
                         "others_cpu": other_threads_cpu_s() - others, "faults": main_minor_faults() - self.faults,
                         **{k: after[k] - before[k] for k in after}})

    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, precision="32-true",
                         max_steps=cfg.total_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[Breakdown(), *extra])  # fmt: skip
    module = module_for(cfg)
    trainer.fit(module, loader(cfg, dist.get_rank(), dist.get_world_size()))
    out = {"rows": rows[cfg.warmup:], "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}
    return {**out, "probe": extra[0].result()} if extra else out


def summarize(results: dict[str, list[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per system: the median step time and the means of the rest, over ranks, steps and rounds."""
    out = []
    for system, rounds in results.items():
        rows = [row for ranks in rounds for rank in ranks for row in rank["rows"]]
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        out.append({"system": system, "step_ms": 1e3 * statistics.median(r["wall"] for r in rows),
                    "main_cpu_ms": 1e3 * mean["main_cpu"], "main_wait_ms": 1e3 * mean["main_wait"],
                    "others_cpu_ms": 1e3 * mean["others_cpu"], "collectives": mean["collectives"],
                    "mb": mean["bytes"] / 2**20, "blocked_ms": 1e3 * mean["blocked"] if system != "ddp" else None,
                    "faults": mean["faults"], "loss": rounds[-1][0]["loss"]})
    return out


def table(summary: list[dict[str, Any]]) -> str:
    base = next((s["step_ms"] for s in summary if s["system"] == "ddp"), None)
    lines = ["| system | step ms | vs ddp | main CPU ms | main waits ms | other threads CPU ms | collectives "
             "/ step | MB sent / step | blocked ms | main page faults / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        ratio = f"{s['step_ms'] / base:.3f}x" if base else "-"
        blocked = f"{s['blocked_ms']:.1f}" if s["blocked_ms"] is not None else "-"
        lines.append(f"| {s['system']} | {s['step_ms']:.1f} | {ratio} | {s['main_cpu_ms']:.1f} | "
                     f"{s['main_wait_ms']:.1f} | {s['others_cpu_ms']:.1f} | {s['collectives']:.1f} | "
                     f"{s['mb']:.1f} | {blocked} | {s['faults']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt_20m")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="tiny GPT, 1 round, 2 steps")
    p.add_argument("--json", default=None, help="also write the summary rows to this file")
    args = p.parse_args(argv)
    from benchmarks.harness.config import BenchConfig
    from benchmarks.harness.pools import start_pool, stop_pool

    if args.quick:
        args.model, args.rounds, args.steps, args.warmup, args.seq_len = "gpt_tiny", 1, 2, 1, 64
    config = dataclasses.asdict(BenchConfig(model=args.model, micro_batch=args.micro_batch, seq_len=args.seq_len,
                                            steps=args.steps, warmup=args.warmup))
    systems = args.systems.split(",")
    results: dict[str, list[Any]] = {s: [] for s in systems}
    pool = start_pool(2, timeout_s=1800)
    try:
        for r in range(args.rounds):  # interleaved: every system once per round
            for system in systems:
                results[system].append(pool.run("benchmarks.bench_breakdown:body", system=system, config=config))
                print(f"round {r + 1}/{args.rounds} {system}: done", file=sys.stderr, flush=True)
    finally:
        stop_pool(pool)
    load = os.getloadavg()
    print(f"{args.model}, fp32, 2 gloo ranks, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
          f"{args.rounds} interleaved rounds of {args.steps} measured steps (+{args.warmup} warm-up); "
          f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores")
    summary = summarize(results)
    print(table(summary))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
