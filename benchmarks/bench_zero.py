"""Step time and memory of ZeRO stages 0-3 against Lightning DDP and PyTorch FSDP2, on CPU processes over gloo.

Run from the repository root (see benchmarks/README.md)::

    python benchmarks/bench_zero.py --model gpt_20m --micro-batch 4 --seq-len 128 --steps 10 --repeats 3

:data:`CONTENDERS` maps a name to a way of training -- a Lightning strategy or a plain PyTorch loop --
added with :func:`register`. Every contender trains the same GPT on the same per-rank batches inside one
long-lived pool of gloo processes (:class:`WorkerPool`), is timed by the same :class:`StepRecorder`, and
the contenders are interleaved over ``--repeats`` so that drifts of a shared machine hit all alike.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from experiments.data import DeterministicShardSampler, RandomTokenDataset, TokenChunkDataset, load_corpus  # noqa: E402
from experiments.gpt import GPT_PRESETS, GPTLightningModule, count_parameters  # noqa: E402
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.core.config import ZeroConfig  # noqa: E402
from lightning_zero.core.memory import StorageCounter  # noqa: E402
from lightning_zero.core.sharded_unit import UnitState  # noqa: E402

PHASES = ("forward", "backward", "reduce", "optimizer", "after_step")
STATE_KINDS = ("params", "grads", "optimizer", "buffers")
DEFAULT_CONTENDERS = "ddp,ddp_nosync,zero0,zero1,zero2"
TARGET_RATIO = 1.10  # stages 1 and 2 should stay within this factor of DDP's step time
TARGET_RATIO_STAGE3 = 1.30  # stage 3: within this factor of DDP, and no slower / no larger than fsdp2
MB = 1e6
Runs = dict[str, list[list[dict[str, Any]]]]  # contender -> repeat -> rank -> run_contender()'s result


# ------------------------------------------------------------------------------------------ contenders
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

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


@dataclass(frozen=True)
class Contender:
    """A way of training. ``build(config)`` returns a Lightning strategy (``kind="lightning"``) or, for
    ``kind="loop"``, a function ``(config, recorder, rank, world_size) -> None`` running its own loop."""

    name: str
    kind: str
    build: Callable[[BenchConfig], Any]
    description: str


CONTENDERS: dict[str, Contender] = {}


def register(name: str, kind: str, description: str) -> Callable[[Callable[[BenchConfig], Any]], Any]:
    """Decorator adding a ``build`` function to :data:`CONTENDERS` under ``name``."""

    def decorate(build: Callable[[BenchConfig], Any]) -> Callable[[BenchConfig], Any]:
        CONTENDERS[name] = Contender(name, kind, build, description)
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


@register("ddp_nosync", "lightning", "ddp with no gradient all-reduce (no_sync on every step): comm baseline")
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
register("zero2_nooverlap", "lightning", "zero2 with {'overlap_comm': False}")(_zero(2, overlap_comm=False))


def _zero3(cls: type[ZeroStrategy] = ZeroStrategy, **options: Any) -> Callable[[BenchConfig], Strategy]:
    def build(config: BenchConfig) -> Strategy:
        kwargs = {"reduce_bucket_size": config.bucket_size,
                  "prefetch_bucket_size": config.prefetch_size or config.bucket_size,
                  "param_persistence_threshold": config.persistence_threshold, **options}  # fmt: skip
        return cls(3, process_group_backend="gloo", monitor=False, **kwargs)

    return build


register("zero3", "lightning", "ZeroStrategy(stage=3), buckets and prefetch of --bucket-size")(_zero3())
for _suffix, _options in (("nocheck", {"check_step_errors": False}), ("rs", {"collective": "reduce_scatter"}),
                          ("noprefetch", {"prefetch_bucket_size": 1}), ("persist0", {"param_persistence_threshold": 0}),
                          ("defaults", {"prefetch_bucket_size": ZeroConfig().prefetch_bucket_size})):  # fmt: skip
    register(f"zero3_{_suffix}", "lightning", f"zero3 with {_options}")(_zero3(**_options))


class _Zero3NoAgreement(ZeroStrategy):
    """Diagnostic prototype, not a supported mode: stage 3 whose unit gathers skip the agreement all-reduce
    (Note [gather agreement] in core/stage3.py), to measure what that synchronous per-unit collective costs.
    ``Stage3Runtime._gather`` is replaced on this run's runtime by the same code minus the agreement; ranks
    that ran different units would exchange the wrong buffers instead of raising."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        runtime = self.engine.runtime if self.engine is not None else None
        if runtime is None:
            return

        def gather(unit: Any) -> None:
            if unit.state is not UnitState.SHARDED:
                return
            unit.start_gather(runtime.comm)
            runtime.live_numel += unit.numel
            runtime.peak_live_numel = max(runtime.peak_live_numel, runtime.live_numel)

        runtime._gather = gather


register("zero3_noagree", "lightning", "zero3 without the per-unit agreement all-reduce (diagnostic "
         "prototype)")(_zero3(_Zero3NoAgreement))  # fmt: skip


class FSDP2Strategy(ModelParallelStrategy):
    """PyTorch FSDP2 driven by Lightning's ModelParallelStrategy (which, unlike FSDPStrategy, runs on CPU):
    ``fully_shard`` on every transformer block, then on the root, over a 1-D data-parallel mesh of all ranks.
    Defaults otherwise (``reshard_after_forward=True``, fp32, no mixed precision, no CPU offload)."""

    def __init__(self, **fsdp_options: Any) -> None:
        super().__init__(tensor_parallel_size=1, process_group_backend="gloo")
        self.fsdp_options = fsdp_options

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank is a data-parallel rank
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        mesh = self.device_mesh["data_parallel"]
        gpt = self.lightning_module.model
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh, **self.fsdp_options)
        fully_shard(gpt, mesh=mesh, **self.fsdp_options)
        super().setup(trainer)  # then the optimizer is built on the sharded (DTensor) parameters


@register("fsdp2", "lightning", "PyTorch FSDP2 fully_shard per block + root, via ModelParallelStrategy")
def _fsdp2(config: BenchConfig) -> Strategy:
    return FSDP2Strategy()


@register("fsdp2_noreshard", "lightning", "fsdp2 with reshard_after_forward=False (ZeRO-2-like gathers)")
def _fsdp2_noreshard(config: BenchConfig) -> Strategy:
    return FSDP2Strategy(reshard_after_forward=False)


@register("local", "loop", "plain PyTorch loop: no Lightning, no communication (each rank trains alone)")
def _local(config: BenchConfig) -> Callable[..., None]:
    return _plain_loop


# ------------------------------------------------------------------------------------------ measurement
class StepRecorder:
    """Wall time (``perf_counter``) and process CPU time of each optimizer step, split into :data:`PHASES`."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []  # CPU time of the whole process (gloo's threads included)
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.extra: dict[str, list[float]] = {}  # --profile probes
        self.state: dict[str, float] = {}  # model-state bytes, sampled before the last optimizer step
        self._t0 = self._last = self._c0 = self._excluded = 0.0
        self._now: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self._c0, self._excluded, self._now = time.process_time(), 0.0, {}

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase``."""
        now = time.perf_counter()
        self._now[phase] = self._now.get(phase, 0.0) + now - self._last
        self._last = now

    def exclude_since_mark(self) -> None:
        """Leave the time since the previous mark (a measurement of ours) out of the step."""
        now = time.perf_counter()
        self._excluded += now - self._last
        self._last = now

    def add(self, key: str, seconds: float) -> None:
        self.extra.setdefault(key, [0.0] * len(self.times))
        self._now["probe:" + key] = self._now.get("probe:" + key, 0.0) + seconds

    def end(self) -> None:
        self.mark("after_step")
        self.times.append(self._last - self._t0 - self._excluded)
        self.cpu.append(time.process_time() - self._c0)
        for p in PHASES:
            self.phases[p].append(self._now.get(p, 0.0))
        for key, values in self.extra.items():
            values.append(self._now.get("probe:" + key, 0.0))


def _local(t: Any) -> Any:
    """The tensor holding this rank's data: a DTensor's local shard, anything else itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _count_by_hand(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp: bool) -> dict[str, float]:
    """params + grads + optimizer state, each storage once; with ``ddp``, ``buffers`` = DDP's reducer buckets
    (a full gradient copy, since Lightning's DDP keeps ``gradient_as_bucket_view=False``): sized, not counted.
    FSDP2: the DTensors' local shards (padding included), and as ``buffers`` the unsharded parameters alive."""
    params = list(module.parameters())
    counter = StorageCounter()
    counter.add("params", [_local(p) for p in params])
    counter.add("grads", [_local(p.grad) for p in params])
    for state in optimizer.state.values():
        counter.add("optimizer", [_local(v) for v in state.values() if isinstance(v, torch.Tensor)])
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                counter.add("buffers", [t for fp in group.fsdp_params for t in fp.all_gather_outputs])
    out = asdict(counter.result())
    if ddp:
        out["buffers"] = float(sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    return out


def _attach_probes(strategy: ZeroStrategy, rec: StepRecorder) -> None:
    """--profile: time the engine's per-parameter hooks, bucket launches / waits, after_step, zero_grad and
    the strategy's step-error check by wrapping them on this run's objects (hooks are re-registered). Stage 3
    also: ``s3_gather`` (a unit's agreement all-reduce + gather launch), ``s3_gather_launch`` (the launch
    alone: shard copy + broadcasts issued), ``s3_gather_wait`` (waiting for a gather) and ``s3_release``."""
    engine, comm = strategy.engine, strategy._comm
    assert engine is not None and comm is not None
    reducer = engine.reducer

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.add(key, time.perf_counter() - t)

        return wrapper

    reducer.remove_hooks()
    hook = timed(reducer._on_grad_ready, "hooks")
    reducer._hooks = [p.register_post_accumulate_grad_hook(hook) for p in reducer._where]
    targets = [(reducer, "_launch", "bucket_launch"), (reducer, "_retire", "bucket_wait"),
               (engine, "after_step", "after_step"), (engine, "zero_grad", "zero_grad"),
               (comm, "ranks_with", "step_check")]  # fmt: skip
    if engine.runtime is not None:  # stage 3: the unit gathers (the hooks look these up on the objects)
        targets.append((engine.runtime, "_gather", "s3_gather"))
        for unit in engine.units:
            targets += [(unit, "start_gather", "s3_gather_launch"), (unit, "wait", "s3_gather_wait"),
                        (unit, "release", "s3_release")]  # fmt: skip
    for obj, name, key in targets:
        setattr(obj, name, timed(getattr(obj, name), key))


class TimingCallback(Callback):
    """Feeds a :class:`StepRecorder` (one record per optimizer step; no gradient accumulation). The phases
    end at on_before_backward (forward; Lightning's zero_grad included), on_after_backward (backward),
    on_before_optimizer_step (reduce: the strategy's work between backward and the optimizer), the
    optimizer's step post-hook (optimizer) and on_train_batch_end (after_step)."""

    def __init__(self, rec: StepRecorder, config: BenchConfig) -> None:
        self.rec, self.config = rec, config

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.rec.mark("optimizer"))
        if self.config.profile and isinstance(trainer.strategy, ZeroStrategy):
            _attach_probes(trainer.strategy, self.rec)

    def on_train_batch_start(self, *_: Any) -> None:
        self.rec.start()

    def on_before_backward(self, *_: Any) -> None:
        self.rec.mark("forward")

    def on_after_backward(self, *_: Any) -> None:
        self.rec.mark("backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *_: Any) -> None:
        self.rec.mark("reduce")
        if len(self.rec.times) == self.config.total_steps - 1:
            strategy = trainer.strategy
            self.rec.state = (asdict(strategy.model_state_bytes()) if isinstance(strategy, ZeroStrategy) else
                              _count_by_hand(trainer.lightning_module, trainer.optimizers[0],
                                             isinstance(strategy.model, DistributedDataParallel)))  # fmt: skip
            self.rec.exclude_since_mark()

    def on_train_batch_end(self, *_: Any) -> None:
        self.rec.end()


def _module(config: BenchConfig) -> GPTLightningModule:
    torch.manual_seed(0)  # the same initial weights on every rank and for every contender
    overrides = {"seq_len": config.seq_len} if config.seq_len > GPT_PRESETS[config.model].seq_len else None
    return GPTLightningModule(config.model, lr=1e-4, warmup_steps=0, model_overrides=overrides)


def _loader(config: BenchConfig, rank: int, world_size: int) -> DataLoader:
    """This rank's ``micro_batch`` sequences per step: disjoint across ranks, the same for every contender."""
    n = config.micro_batch * world_size * config.total_steps
    if config.data == "stdlib":
        dataset: Dataset = TokenChunkDataset(load_corpus(max_bytes=(n + 1) * config.seq_len + 1), config.seq_len)
    else:
        dataset = RandomTokenDataset(n, config.seq_len)
    sampler = DeterministicShardSampler(len(dataset), world_size, rank, shuffle=False)
    return DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True)


def _fit(strategy: Strategy, config: BenchConfig, rec: StepRecorder, rank: int, world_size: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true",
                         max_steps=config.total_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[TimingCallback(rec, config)])  # fmt: skip
    trainer.fit(_module(config), _loader(config, rank, world_size))


def _plain_loop(config: BenchConfig, rec: StepRecorder, rank: int, world_size: int) -> None:
    module = _module(config)
    optimizer = module.configure_optimizers()
    for step, batch in enumerate(_loader(config, rank, world_size)):
        rec.start()
        optimizer.zero_grad()
        loss = module.loss(batch)
        rec.mark("forward")
        loss.backward()
        rec.mark("backward")
        if step == config.total_steps - 1:
            rec.state = _count_by_hand(module, optimizer, ddp=False)
            rec.exclude_since_mark()
        optimizer.step()
        rec.mark("optimizer")
        rec.end()


def _peak_rss(reset: bool = False) -> tuple[float, str]:
    """(bytes, source): VmHWM since the last reset where /proc allows resetting it, else ru_maxrss (lifetime)."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return float(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024, "VmHWM"
    except (OSError, TypeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "ru_maxrss"


def run_contender(name: str, config: BenchConfig, rank: int, world_size: int) -> dict[str, Any]:
    """Train contender ``name`` for ``config.total_steps`` steps on this rank; its raw measurements."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the previous contender's heap back to the OS
    _peak_rss(reset=True)
    rec, contender = StepRecorder(), CONTENDERS[name]
    built = contender.build(config)
    if contender.kind == "lightning":
        _fit(built, config, rec, rank, world_size)
    else:
        built(config, rec, rank, world_size)
    rss, source = _peak_rss()
    gathered = built.gathered_peak_numel if isinstance(built, ZeroStrategy) else 0  # stage 3, elements
    return {"times": rec.times, "cpu": rec.cpu, "phases": rec.phases, "extra": rec.extra, "state": rec.state,
            "rss": rss, "rss_source": source, "gathered_peak_numel": gathered}  # fmt: skip


# ------------------------------------------------------------------------------------------ process pool
def _worker_main(rank: int, world_size: int, port: int, threads: int, log_path: str, conn: Connection) -> None:
    """Join one gloo group, then run ``(contender, config)`` messages until ``None``; output goes to a log."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS=str(threads))  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    base_env = dict(os.environ)  # Lightning's teardown deletes WORLD_SIZE: restored before every task
    conn.send((True, "ready"))
    while (message := conn.recv()) is not None:
        os.environ.clear()
        os.environ.update(base_env)
        torch.set_num_threads(threads)
        try:
            conn.send((True, run_contender(*message, rank, world_size)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
    os._exit(0)  # skip interpreter teardown


class WorkerPool:
    """``world_size`` spawned processes in one gloo group, kept across contenders: Lightning finds the group
    initialised and the rank variables set, so it neither spawns processes nor re-initialises the group."""

    def __init__(self, world_size: int, threads: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s, self.failed = world_size, timeout_s, False
        self.log_dir = Path(tempfile.mkdtemp(prefix="bench_zero_"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = tmp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, port, threads, str(self.log_dir / f"rank{rank}.log"), child)
            self.procs.append(ctx.Process(target=_worker_main, args=args, daemon=True))
            self.procs[-1].start()
            child.close()
            self.conns.append(parent)
        self._collect("start-up")

    def run(self, name: str, config: BenchConfig) -> list[dict[str, Any]]:
        """Run contender ``name`` on every rank; its measurements by rank."""
        for conn in self.conns:
            conn.send((name, config))
        return self._collect(name)

    def _collect(self, label: str) -> list[Any]:
        replies: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < self.world_size and time.monotonic() < deadline:
            pending = [r for r in range(self.world_size) if r not in replies]
            wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], timeout=1.0)
            for r in pending:
                if self.conns[r].poll():
                    replies[r] = self.conns[r].recv()
                    if not replies[r][0]:  # the others are likely stuck in a collective: 10 s of grace
                        deadline = min(deadline, time.monotonic() + 10)
                elif not self.procs[r].is_alive():
                    deadline = 0.0
        if len(replies) == self.world_size and all(ok for ok, _ in replies.values()):
            return [replies[r][1] for r in range(self.world_size)]
        self.failed = True  # keep the logs
        self.close()
        errors = "\n".join(f"--- rank {r}:\n{value}" for r, (ok, value) in sorted(replies.items()) if not ok)
        raise RuntimeError(f"{label}: failed, died or timed out ({self.timeout_s:g} s); logs: {self.log_dir}\n{errors}")

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(timeout=1 if self.failed else 10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []
        if not self.failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------ report
def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _step(ranks: list[dict[str, Any]], warmup: int, key: str = "times") -> float:
    """One run's step time: the median measured step of each rank, max over ranks (mean for CPU time)."""
    per_rank = [_med(r[key][warmup:]) for r in ranks]
    return max(per_rank) if key == "times" else statistics.fmean(per_rank)


def _part(reps: list[list[dict[str, Any]]], warmup: int, key: str, sub: str) -> float:
    """A phase or probe: its median step per rank, mean over ranks, median over repeats."""
    return _med([statistics.fmean(_med(r[key][sub][warmup:]) for r in ranks) for ranks in reps])


def summarize(runs: Runs, warmup: int) -> list[dict[str, Any]]:
    """One row per contender: medians over the repeats (seconds, bytes); ratios to ddp's run of the same repeat."""
    rows = []
    ddp = runs.get("ddp")
    for name, reps in runs.items():
        steps, cpus = [_step(rk, warmup) for rk in reps], [_step(rk, warmup, "cpu") for rk in reps]
        rows.append({
            "name": name, "step": _med(steps), "low": min(steps), "high": max(steps), "cpu": _med(cpus),
            "ratio": _med([s / _step(d, warmup) for s, d in zip(steps, ddp)]) if ddp else None,
            "best_ratio": min(steps) / min(_step(d, warmup) for d in ddp) if ddp else None,
            "cpu_ratio": _med([c / _step(d, warmup, "cpu") for c, d in zip(cpus, ddp)]) if ddp else None,
            "phases": {p: _part(reps, warmup, "phases", p) for p in PHASES},
            "probes": {k: _part(reps, warmup, "extra", k) for k in reps[0][0]["extra"]},
            "state": {k: max(r["state"].get(k, 0.0) for r in reps[-1]) for k in STATE_KINDS},
            "rss": _med([max(r["rss"] for r in rk) for rk in reps]),
            "gathered_peak": max(r.get("gathered_peak_numel", 0) for rk in reps for r in rk),
            "steps": steps,
        })  # fmt: skip
    return rows


def comm_share(runs: Runs, warmup: int) -> float | None:
    """DDP's communication share: median over repeats of (ddp - ddp_nosync) / ddp (step times as in the rows)."""
    if "ddp" not in runs or "ddp_nosync" not in runs:
        return None
    return _med([1 - _step(n, warmup) / _step(d, warmup) for d, n in zip(runs["ddp"], runs["ddp_nosync"])])


def _table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join("| " + " | ".join(c) + " |" for c in [headers, [":--"] + ["--:"] * (len(headers) - 1), *rows])
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [headers, *rows])  # fmt: skip


def machine() -> str:
    """CPU model (from /proc/cpuinfo), cores, OS, Python, torch and Lightning versions."""
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))  # fmt: skip
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {os.cpu_count()} logical cores ({usable} usable), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, lightning {pl.__version__}")  # fmt: skip


def stage3_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The stage 3 goals: zero3 <= TARGET_RATIO_STAGE3 x ddp, and no slower and no larger than fsdp2 (step time:
    median over repeats of the same-repeat ratio; memory: model state of all kinds, and peak RSS)."""
    by_name = {r["name"]: r for r in rows}
    z3, f2, out = by_name.get("zero3"), by_name.get("fsdp2"), []
    if z3 is None:
        return out
    if z3["ratio"] is not None:
        verdict = "met" if z3["ratio"] <= TARGET_RATIO_STAGE3 else "NOT met"
        out.append(f"Target zero3 <= {TARGET_RATIO_STAGE3:.2f}x ddp: {z3['ratio']:.3f}x, {verdict} (fastest repeat "
                   f"vs fastest ddp repeat {z3['best_ratio']:.3f}x; CPU time {z3['cpu_ratio']:.3f}x).")  # fmt: skip
    if z3["gathered_peak"]:
        out.append(f"zero3 gathered at most {z3['gathered_peak'] / 1e6:.2f}M parameter elements at once per rank "
                   "(ZeroStrategy.gathered_peak_numel, persistent unit excluded).")  # fmt: skip
    if f2 is not None:
        speed = _med([a / b for a, b in zip(z3["steps"], f2["steps"])])
        state_z3, state_f2 = sum(z3["state"].values()), sum(f2["state"].values())
        verdicts = ["met" if speed <= 1.0 else "NOT met", "met" if state_z3 <= state_f2 else "NOT met",
                    "met" if z3["rss"] <= f2["rss"] else "NOT met"]  # fmt: skip
        out.append(f"Target zero3 no slower than fsdp2: {speed:.3f}x fsdp2's step (median over repeats of the "
                   f"same-repeat ratio), {verdicts[0]}.")  # fmt: skip
        out.append(f"Target zero3 no larger than fsdp2: model state {state_z3 / MB:.1f} MB vs {state_f2 / MB:.1f} MB "
                   f"({verdicts[1]}); peak RSS {z3['rss'] / MB:.0f} MB vs {f2['rss'] / MB:.0f} MB ({verdicts[2]}).")
    return out


def report(rows: list[dict[str, Any]], config: BenchConfig, share: float | None, header: list[str],
           markdown: bool) -> str:  # fmt: skip
    """Header, main table, DDP's communication share, the target check, phases and (--profile) probes."""
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.3f}x"  # noqa: E731
    out = [*(f"- {line}" if markdown else line for line in header), ""]
    heads = ["contender", "step ms", "[min-max]", "vs ddp", "cpu ms", "cpu vs ddp",
             *[f"{k} MB" for k in STATE_KINDS], "peak RSS MB (noisy)"]  # fmt: skip
    out.append(_table(heads, [[r["name"], ms(r["step"]), f"[{ms(r['low'])}-{ms(r['high'])}]", ratio(r["ratio"]),
                               ms(r["cpu"]), ratio(r["cpu_ratio"]), *[f"{r['state'][k] / MB:.1f}" for k in STATE_KINDS],
                               f"{r['rss'] / MB:.0f}"] for r in rows], markdown))  # fmt: skip
    out.append("")
    if share is not None:
        out.append(f"DDP communication share: {share:.1%} of DDP's step = median over repeats of (ddp - "
                   "ddp_nosync) / ddp, where ddp_nosync is the same DDP with no_sync() on every step.")  # fmt: skip
    for r in rows:
        if r["name"] in ("zero1", "zero2") and r["ratio"] is not None:
            verdict = "met" if r["ratio"] <= TARGET_RATIO else "NOT met"
            out.append(
                f"Target {r['name']} <= {TARGET_RATIO:.2f}x ddp: {r['ratio']:.3f}x, {verdict} (fastest repeat "
                f"vs fastest ddp repeat {r['best_ratio']:.3f}x; CPU time {r['cpu_ratio']:.3f}x)."
            )
    out += stage3_verdicts(rows)
    out += ["", "Phases, ms per step (each phase's median step, mean over ranks, median over repeats):", ""]
    phase_rows = [[r["name"], *[ms(r["phases"][p]) for p in PHASES], ms(sum(r["phases"].values()))] for r in rows]
    out.append(_table(["contender", *PHASES, "sum"], phase_rows, markdown))
    probes = sorted({k for r in rows for k in r["probes"]})
    if probes:
        out += ["", "ZeroEngine probes (--profile), ms per step as for phases; nested: hooks include the bucket "
                "launches and waits they trigger, after_step includes one zero_grad; s3_gather includes "
                "s3_gather_launch (stage 3):", ""]  # fmt: skip
        out.append(_table(["contender", *probes], [[r["name"], *[f"{r['probes'].get(k, float('nan')) * 1e3:.1f}"
                                                                 for k in probes]] for r in rows if r["probes"]],
                          markdown))  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Step time and memory of ZeRO stages vs Lightning DDP (CPU, gloo).")
    add = p.add_argument
    add("--model", default="gpt_20m", choices=sorted(GPT_PRESETS), help="GPT preset (experiments/gpt.py)")
    add("--micro-batch", type=int, default=BenchConfig.micro_batch, help="sequences per rank per step")
    add("--seq-len", type=int, default=BenchConfig.seq_len, help="tokens per sequence")
    add("--steps", type=int, default=BenchConfig.steps, help="measured steps per run")
    add("--warmup", type=int, default=BenchConfig.warmup, help="steps run before measuring")
    add("--repeats", type=int, default=3, help="runs of every contender, interleaved")
    add("--contenders", default=DEFAULT_CONTENDERS, help="comma separated (see --list); ddp adds ddp_nosync")
    add("--bucket-size", type=int, default=BenchConfig.bucket_size, help="gradient bucket in elements, all rows")
    add("--prefetch-size", type=int, default=None, help="stage 3 prefetch_bucket_size (default: --bucket-size)")
    add("--persistence-threshold", type=int, default=BenchConfig.persistence_threshold,
        help="stage 3 param_persistence_threshold in elements (DeepSpeed's default 1e5)")
    add("--threads", type=int, default=1, help="torch threads per rank")
    add("--world-size", type=int, default=2, help="processes")
    add("--data", default="random", choices=["random", "stdlib"], help="random tokens or stdlib source text")
    add("--markdown", action="store_true", help="print markdown tables (for docs/benchmarks.md)")
    add("--profile", action="store_true", help="also time ZeroEngine internals (small overhead)")
    add("--json", type=Path, help="write the raw per-step measurements to this file")
    add("--timeout", type=float, default=1800.0, help="seconds one contender run may take")
    add("--list", action="store_true", help="list the registered contenders and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{c.name:16} {c.kind:9} {c.description}" for c in CONTENDERS.values()))
        return 0
    names = list(dict.fromkeys(n.strip() for n in args.contenders.split(",") if n.strip()))
    if unknown := [n for n in names if n not in CONTENDERS]:
        raise SystemExit(f"unknown contender(s) {unknown}; registered: {sorted(CONTENDERS)}")
    if "ddp" in names and "ddp_nosync" not in names:  # the baseline of DDP's communication share
        names.insert(names.index("ddp") + 1, "ddp_nosync")
    config = BenchConfig(args.model, args.micro_batch, args.seq_len, args.steps, args.warmup, args.bucket_size,
                         args.threads, args.data, args.profile, args.prefetch_size,
                         args.persistence_threshold)  # fmt: skip
    started, load = time.strftime("%Y-%m-%d %H:%M %Z"), os.getloadavg()[0]
    runs: Runs = {n: [] for n in names}
    pool = WorkerPool(args.world_size, args.threads, args.timeout)
    try:
        for repeat in range(args.repeats):
            for name in names:
                t = time.perf_counter()
                runs[name].append(pool.run(name, config))
                print(f"[repeat {repeat + 1}/{args.repeats}] {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    finally:
        pool.close()
    header = [
        f"Model: {config.model} ({count_parameters(config.model) / 1e6:.2f}M parameters), AdamW, fp32; micro-batch "
        f"{config.micro_batch} x seq {config.seq_len} per rank ({config.data} tokens), no gradient accumulation",
        f"Ranks: {args.world_size} CPU processes, gloo, {config.threads} torch thread(s) each; gradient buckets "
        f"{config.bucket_size:,} elements ({config.bucket_size * 4 / 2**20:.0f} MiB fp32) for every contender",
        f"Timing: {config.warmup} warm-up + {config.steps} measured steps per run, contenders interleaved over "
        f"{args.repeats} repeat(s); step = max over ranks of the median step, then median over repeats",
        f"Machine: {machine()}",
        f"Run: {started}; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (above "
        f"{args.world_size} means other processes competed for the cores)",
        "Memory: MB = 10^6 bytes per rank, sampled before the last optimizer step; ZeRO rows are "
        "ZeroStrategy.model_state_bytes(), the others are counted by hand (params + grads + AdamW state; buffers "
        "= DDP's reducer buckets, a full gradient copy, sized from the parameters). Peak RSS = VmHWM per run, max "
        "over ranks: noisy (allocator caching, Lightning, imports).",
    ]  # fmt: skip
    if any(n.startswith("zero3") for n in names):
        header.append(f"Stage 3: prefetch_bucket_size {config.prefetch_size or config.bucket_size:,} elements, "
                      f"param_persistence_threshold {config.persistence_threshold:,}, max_live_parameters "
                      f"{ZeroConfig().max_live_parameters:,}; gathered units count as buffers")  # fmt: skip
    if any(n.startswith("fsdp2") for n in names):
        header.append("FSDP2: torch.distributed.fsdp.fully_shard on every block, then the root, through Lightning's "
                      "ModelParallelStrategy (1-D data-parallel mesh, gloo), reshard_after_forward=True "
                      "(fsdp2_noreshard: False); memory counted from the DTensors' local shards (params, grads, AdamW "
                      "state), buffers = unsharded parameters alive")  # fmt: skip
    print(report(summarize(runs, config.warmup), config, comm_share(runs, config.warmup), header, args.markdown))
    if args.json:
        args.json.write_text(json.dumps({"config": asdict(config), "argv": sys.argv[1:], "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
