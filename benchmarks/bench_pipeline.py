"""Pipeline bubble and per-rank memory of pipeline x ZeRO (CPU processes over gloo).

* bubble: 2 stages, GPipe and 1F1B, 1/2/4/8 micro-batches of one fixed batch (8 layers of width 1024).
  Every compute call of a stage (``forward_one_chunk`` / ``backward_one_chunk``) is timestamped; a step's window starts
  at a barrier and ends when the stage's schedule returns; idle fraction = 1 - busy / window, printed
  beside the theoretical (p - 1) / (m + p - 1).
* reduction: ZeRO-2, 2 stages x 2 data-parallel ranks: the deferred reduction against
  ``reduce_per_micro_batch=True``, step time and peak model-state bytes (docs/pipeline.md).
* memory: 2 stages x 2 data-parallel ranks, ZeRO 1/2/3, fp32 AdamW. ``engine.model_state_bytes()``
  (live tensors) at rest after a step and at its peak (the deferred, whole gradients of the stage,
  just before the once-per-step reduction), beside the formulas of docs/pipeline.md with
  Psi_s = the stage's parameters and N = 2.

Run (the script starts its ranks with torchrun: 2 for ``bubble``, 4 for ``memory`` and ``reduction``):

    python benchmarks/bench_pipeline.py bubble --repeats 3
    python benchmarks/bench_pipeline.py memory
    python benchmarks/bench_pipeline.py reduction --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("PL_DISABLE_FORK", "1")

from lightning_zero.core.common.choices import ZeroStage

WORLD = {"bubble": 2, "memory": 4, "reduction": 4}  # ranks each part runs on


def _model(width: int, layers: int) -> Any:
    import lightning.pytorch as pl
    from torch import nn

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))

        def pipeline_layers(self) -> list[nn.Module]:
            return list(self.layers)

        def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return (out - target).pow(2).mean()

        def training_step(self, batch: Any, batch_idx: int) -> Any:  # unused under a pipeline
            raise AssertionError

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Stack()


def _loader(width: int, batch: int, steps: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch * steps, width, generator=gen)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=batch)


def _trainer(stage: int, config: Any, world: int, steps: int, callbacks: list, bucket: int = 10**7) -> Any:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    return pl.Trainer(strategy=ZeroStrategy(stage=stage, pipeline=config, param_persistence_threshold=0,
                                            monitor=False, reduce_bucket_size=bucket), accelerator="cpu", devices=world,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks)


def bubble(args: argparse.Namespace) -> list[tuple[str, int, int, float]]:
    from torch.distributed.pipelining import PipelineStage

    from lightning_zero.core.settings.pipeline import PipelineConfig
    from lightning_zero.pipeline.runner import PipelineRunner

    busy: list[float] = []
    windows: list[tuple[float, float]] = []

    def timed(fn: Any) -> Any:
        def inner(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                busy.append(time.perf_counter() - t0)
        return inner

    base = PipelineStage
    base.forward_one_chunk = timed(base.forward_one_chunk)  # type: ignore[method-assign]
    base.backward_one_chunk = timed(base.backward_one_chunk)  # type: ignore[method-assign]
    step = PipelineRunner.train_step

    def train_step(self: Any, *a: Any) -> Any:
        dist.barrier(group=self.groups.pp)
        busy.clear()
        t0 = time.perf_counter()
        out = step(self, *a)
        windows.append((t0, time.perf_counter(), sum(busy)))  # type: ignore[arg-type]
        return out

    PipelineRunner.train_step = train_step  # type: ignore[method-assign]
    rows = []
    for rep in range(args.repeats):
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 4, 8) if schedule == "gpipe" else (2, 4, 8):  # 1F1B needs m >= p
                windows.clear()
                config = PipelineConfig(stages=2, micro_batches=m, schedule=schedule, partition_method="uniform")
                trainer = _trainer(1, config, 2, args.steps + 2, [])
                trainer.fit(_model(args.width, args.layers), _loader(args.width, args.batch, args.steps + 2))
                idle = [1 - b / (t1 - t0) for t0, t1, b in windows[2:]]  # 2 warm-up steps
                rows.append((schedule, m, rep, statistics.median(idle)))
    return rows


def memory(args: argparse.Namespace) -> list[tuple[int, str, float, float, int]]:
    import lightning.pytorch as pl

    from lightning_zero.core.settings.pipeline import PipelineConfig
    from lightning_zero.parallel.pipeline import StrategyPipeline

    peaks: list[float] = []
    original = StrategyPipeline.backward

    def backward(self: Any, engine: Any) -> None:
        peaks.append(engine.model_state_bytes().total)
        original(self, engine)

    StrategyPipeline.backward = backward  # type: ignore[method-assign]
    rows = []
    for stage in (1, 2, 3):
        rest: list[float] = []

        class AtRest(pl.Callback):
            def __init__(self, out: list[float]) -> None:
                self.out = out

            def on_train_batch_end(self, trainer: pl.Trainer, *a: Any) -> None:
                self.out.append(trainer.strategy.engine.model_state_bytes().total)

        peaks.clear()
        config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="uniform")
        trainer = _trainer(stage, config, 4, 3, [AtRest(rest)])
        model = _model(args.width, args.layers)
        trainer.fit(model, _loader(args.width, args.batch, 3))
        psi_s = sum(p.numel() for p in model.parameters()) / 2  # equal stages (uniform, equal layers)
        rows.append((stage, "rest", max(rest), psi_s, dist.get_rank()))
        rows.append((stage, "peak", max(peaks), psi_s, dist.get_rank()))
    return rows


def reduction(args: argparse.Namespace) -> list[tuple[str, int, float, float, float]]:
    """ZeRO-2, 2 stages x 2 data-parallel ranks, 1F1B: the deferred reduction (once per step) against
    ``PipelineConfig(reduce_per_micro_batch=True)``. Per step: wall time, and the peak model-state bytes
    (``engine.model_state_bytes()``, buckets in flight included) seen at the end of every micro-batch's
    backward (before its reduction finishes) and before the step's deferred reduction."""
    import lightning.pytorch as pl
    from torch.distributed.pipelining import PipelineStage

    from lightning_zero.core.settings.pipeline import PipelineConfig
    from lightning_zero.parallel.pipeline import StrategyPipeline

    engines: list[Any] = []
    peaks: list[float] = []
    chunk_backward, pipe_backward = PipelineStage.backward_one_chunk, StrategyPipeline.backward

    def backward_one_chunk(self: Any, *a: Any, **k: Any) -> Any:
        out = chunk_backward(self, *a, **k)
        peaks.append(engines[-1].model_state_bytes().total)
        return out

    def backward(self: Any, engine: Any) -> None:
        peaks.append(engine.model_state_bytes().total)
        pipe_backward(self, engine)

    PipelineStage.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]
    StrategyPipeline.backward = backward  # type: ignore[method-assign]

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.peaks: list[float] = []

        def on_train_start(self, trainer: pl.Trainer, *a: Any) -> None:
            engines.append(trainer.strategy.engine)

        def on_train_batch_start(self, *a: Any) -> None:
            peaks.clear()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)
            self.peaks.append(max(peaks))

    rows = []
    for rep in range(args.repeats):
        for mode in ("deferred", "per_micro_batch"):
            timer = Timer()
            config = PipelineConfig(stages=2, micro_batches=args.micro_batches, schedule="1f1b",
                                    partition_method="uniform", reduce_per_micro_batch=mode == "per_micro_batch")
            trainer = _trainer(2, config, 4, args.steps + 2, [timer], args.bucket)
            model = _model(args.width, args.layers)
            trainer.fit(model, _loader(args.width, args.batch, args.steps + 2))
            checksum = float(sum(p.double().sum() for p in model.parameters()))
            rows.append((mode, rep, statistics.median(timer.times[2:]), max(timer.peaks), checksum))
    return rows


def formula(stage: int, psi_s: float, n: int, peak: bool) -> float:
    """fp32 AdamW bytes per rank of one stage (docs/pipeline.md): 4 (param) + 4 (grad) + 8 (Adam)."""
    zero = ZeroStage.of(stage)
    gathered = 4 * psi_s if peak else 0  # stage 3's units gathered at the peak
    params = 4 * psi_s / n + gathered if zero.shards_parameters else 4 * psi_s
    grads = 4 * psi_s / n if zero.shards_gradients else 4 * psi_s
    if peak and zero.shards_gradients:
        grads += 4 * psi_s  # the deferred whole gradient of the stage, beside the (empty) shard
    return params + grads + 8 * psi_s / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["bubble", "memory", "reduction"])
    parser.add_argument("--micro-batches", type=int, default=8, help="reduction: micro-batches per step")
    parser.add_argument("--bucket", type=int, default=50_000, help="reduction: reduce_bucket_size (elements)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=None,
                        help="layer width (default: 1024 for bubble, so compute outweighs the schedule's overhead; "
                             "384 for memory and reduction)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    args.width = args.width or (1024 if args.part == "bubble" else 384)
    if "RANK" not in os.environ:  # started by hand: launch the ranks (torchrun), one thread each
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD[args.part]}",
               os.path.abspath(__file__), *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False).returncode)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = {"bubble": bubble, "memory": memory, "reduction": reduction}[args.part](args)
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, rows)
    if dist.get_rank() == 0:
        {"bubble": print_bubble, "memory": print_memory, "reduction": print_reduction}[args.part](everything)
    dist.barrier()
    dist.destroy_process_group()


def print_bubble(by_rank: list[Any]) -> None:
    print("| schedule | micro-batches m | idle stage 0 | idle stage 1 | theory (p-1)/(m+p-1) |")
    print("| :-- | --: | --: | --: | --: |")
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 2, 4, 8) if schedule == "gpipe" else (2, 4, 8):
            cells = [statistics.median([i for s, mm, _, i in by_rank[r] if s == schedule and mm == m]) for r in (0, 1)]
            print(f"| {schedule} | {m} | {cells[0]:.3f} | {cells[1]:.3f} | {1 / (m + 1):.3f} |")


def print_reduction(by_rank: list[Any]) -> None:
    print("| reduction at ZeRO-2 | step time (median over steps and repeats, slowest rank) | peak model-state bytes, "
          "ranks 0-3 | final parameter checksum |")
    print("| :-- | --: | --: | --: |")
    for mode in ("deferred", "per_micro_batch"):
        step = max(statistics.median([t for m, _, t, _, _ in rows if m == mode]) for rows in by_rank)
        peaks = " / ".join(str(int(max(p for m, _, _, p, _ in rows if m == mode))) for rows in by_rank)
        checksum = next(c for m, _, _, _, c in by_rank[0] if m == mode)
        print(f"| {mode} | {step * 1e3:.1f} ms | {peaks} | {checksum:.6f} |")


def print_memory(by_rank: list[Any]) -> None:
    print("| ZeRO stage | when | measured bytes, ranks 0-3 (stage 0: 0-1, stage 1: 2-3) | formula | formula / Psi_s |")
    print("| :-- | :-- | --: | --: | --: |")
    for stage in (1, 2, 3):
        for when in ("rest", "peak"):
            got = [int(v) for r in range(4) for s, w, v, _, _ in by_rank[r] if s == stage and w == when]
            psi_s = next(p for s, w, _, p, _ in by_rank[0] if s == stage)
            f = formula(stage, psi_s, 2, when == "peak")
            print(f"| {stage} | {when} | {' / '.join(map(str, got))} | {f:.0f} | {f / psi_s:.0f} |")


if __name__ == "__main__":
    main()
