"""Step time and memory of ZeRO stages 0-2 against Lightning DDP, on CPU processes over gloo.

Run from the repository root (see benchmarks/README.md)::

    python benchmarks/bench_zero.py --model gpt_20m --micro-batch 8 --seq-len 128 --steps 10 --repeats 3

Structure: :data:`CONTENDERS` maps a name to a way of training -- a Lightning strategy or a plain PyTorch
loop -- registered with :func:`register`. Every contender trains the same GPT on the same per-rank batches
inside one long-lived pool of gloo processes (:class:`WorkerPool`), is timed by the same
:class:`StepRecorder`, and the contenders are interleaved over ``--repeats`` so that slow drifts of a
shared machine hit all of them alike. To add a row, register a contender.
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
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from experiments.data import DeterministicShardSampler, RandomTokenDataset, TokenChunkDataset, load_corpus  # noqa: E402
from experiments.gpt import GPT_PRESETS, GPTLightningModule, count_parameters  # noqa: E402
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.core.memory import StorageCounter  # noqa: E402

PHASES = ("forward", "backward", "reduce", "optimizer", "after_step")
STATE_KINDS = ("params", "grads", "optimizer", "buffers")
DEFAULT_CONTENDERS = "ddp,ddp_nosync,zero0,zero1,zero2"
TARGET_RATIO = 1.10  # stages 1 and 2 within this factor of DDP's step time
MB = 1e6


# ------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class BenchConfig:
    """What every contender trains; sent to the workers."""

    model: str = "gpt_20m"
    micro_batch: int = 8
    seq_len: int = 128
    steps: int = 10
    warmup: int = 3
    bucket_size: int = 6_553_600  # elements per gradient bucket (fp32: 25 MiB, DDP's default)
    threads: int = 1
    data: str = "random"
    profile: bool = False

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


@dataclass(frozen=True)
class Contender:
    """One way of training. ``build(config)`` returns a Lightning strategy (``kind="lightning"``) or, for
    ``kind="loop"``, a function ``(config, recorder, rank, world_size) -> None`` running its own loop."""

    name: str
    kind: str
    build: Callable[[BenchConfig], Any]
    description: str


CONTENDERS: dict[str, Contender] = {}


def register(name: str, kind: str, description: str) -> Callable[[Callable[[BenchConfig], Any]], Any]:
    """Decorator adding ``build`` to :data:`CONTENDERS` under ``name``."""

    def decorate(build: Callable[[BenchConfig], Any]) -> Callable[[BenchConfig], Any]:
        CONTENDERS[name] = Contender(name, kind, build, description)
        return build

    return decorate


@register("ddp", "lightning", "Lightning DDPStrategy (torch DDP; bucket_cap_mb from --bucket-size)")
def _ddp(config: BenchConfig) -> pl.strategies.Strategy:
    return pl.strategies.DDPStrategy(process_group_backend="gloo", bucket_cap_mb=config.bucket_size * 4 / 2**20)


class _NoSyncDDP(pl.strategies.DDPStrategy):
    """DDP whose gradients are never all-reduced: every step runs as inside ``DDP.no_sync()``."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        assert isinstance(self.model, DistributedDataParallel)
        self.model.require_backward_grad_sync = False  # the flag no_sync() clears


@register("ddp_nosync", "lightning", "ddp without gradient all-reduce (no_sync on every step): comm baseline")
def _ddp_nosync(config: BenchConfig) -> pl.strategies.Strategy:
    return _NoSyncDDP(process_group_backend="gloo", bucket_cap_mb=config.bucket_size * 4 / 2**20)


def _zero(stage: int, **options: Any) -> Callable[[BenchConfig], pl.strategies.Strategy]:
    def build(config: BenchConfig) -> pl.strategies.Strategy:
        return ZeroStrategy(stage=stage, reduce_bucket_size=config.bucket_size, process_group_backend="gloo",
                            **options)  # fmt: skip

    return build


for _stage in (0, 1, 2):
    register(f"zero{_stage}", "lightning", f"ZeroStrategy(stage={_stage}), defaults")(_zero(_stage))
for _stage in (1, 2):  # diagnostic variants (not run by default)
    register(f"zero{_stage}_nocheck", "lightning", f"zero{_stage} with check_step_errors=False")(
        _zero(_stage, check_step_errors=False))
    register(f"zero{_stage}_rs", "lightning", f"zero{_stage} with collective='reduce_scatter'")(
        _zero(_stage, collective="reduce_scatter"))
register("zero2_nooverlap", "lightning", "zero2 with overlap_comm=False")(_zero(2, overlap_comm=False))


@register("local", "loop", "plain PyTorch loop, no Lightning, no communication (each rank alone)")
def _local(config: BenchConfig) -> Callable[..., None]:
    return _plain_loop


# ------------------------------------------------------------------------------------------ measurement
class StepRecorder:
    """Wall time of each optimizer step (``time.perf_counter``), split into :data:`PHASES`."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.extra: dict[str, list[float]] = {}  # --profile probes, seconds per step
        self.state: dict[str, float] = {}  # model-state bytes sampled before the last optimizer step
        self._t0 = self._last = 0.0
        self._now: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self._now = {}

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase``."""
        now = time.perf_counter()
        self._now[phase] = self._now.get(phase, 0.0) + now - self._last
        self._last = now

    def add(self, key: str, seconds: float) -> None:
        self._now["extra:" + key] = self._now.get("extra:" + key, 0.0) + seconds

    def end(self) -> None:
        self.mark("after_step")
        self.times.append(self._last - self._t0)
        for p in PHASES:
            self.phases[p].append(self._now.get(p, 0.0))
        for key in {k[6:] for k in self._now if k.startswith("extra:")} | set(self.extra):
            self.extra.setdefault(key, [0.0] * (len(self.times) - 1)).append(self._now.get("extra:" + key, 0.0))


def _state_bytes(trainer: pl.Trainer) -> dict[str, float]:
    """``model_state_bytes()`` for ZeRO; for other strategies the same counted by hand (for DDP, the
    ``buffers`` are its reducer's gradient buckets, a full copy of the gradients: sized, not counted)."""
    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy):
        return asdict(strategy.model_state_bytes())
    params = list(trainer.lightning_module.parameters())
    counter = StorageCounter()
    counter.add("params", params)
    counter.add("grads", [p.grad for p in params])
    for state in trainer.optimizers[0].state.values():
        counter.add("optimizer", [v for v in state.values() if isinstance(v, torch.Tensor)])
    out = asdict(counter.result())
    if isinstance(strategy.model, DistributedDataParallel):
        out["buffers"] = float(sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    return out


def _attach_probes(strategy: ZeroStrategy, rec: StepRecorder) -> None:
    """--profile: time the engine's per-parameter hooks, bucket launches/retires, after_step and zero_grad by
    wrapping them on this run's objects (the hooks are re-registered through a timing wrapper)."""
    engine = strategy.engine
    assert engine is not None
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
    reducer._launch = timed(reducer._launch, "bucket_launch")  # type: ignore[method-assign]
    reducer._retire = timed(reducer._retire, "bucket_wait")  # type: ignore[method-assign]
    engine.after_step = timed(engine.after_step, "after_step")  # type: ignore[method-assign]
    engine.zero_grad = timed(engine.zero_grad, "zero_grad")  # type: ignore[method-assign]
    strategy._comm.ranks_with = timed(strategy._comm.ranks_with, "step_check")  # type: ignore[union-attr,method-assign]


class TimingCallback(Callback):
    """Feeds a :class:`StepRecorder` from Lightning's hooks: one record per optimizer step (no gradient
    accumulation). Phases end at on_before_backward (forward, incl. zero_grad), on_after_backward
    (backward), on_before_optimizer_step (reduce: what the strategy does between backward and the
    optimizer), the optimizer's step post-hook (optimizer) and on_train_batch_end (after_step)."""

    def __init__(self, rec: StepRecorder, config: BenchConfig) -> None:
        self.rec, self.config = rec, config

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.rec.mark("optimizer"))
        if self.config.profile and isinstance(trainer.strategy, ZeroStrategy):
            _attach_probes(trainer.strategy, self.rec)

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.rec.start()

    def on_before_backward(self, *_: Any) -> None:
        self.rec.mark("forward")

    def on_after_backward(self, *_: Any) -> None:
        self.rec.mark("backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *_: Any) -> None:
        self.rec.mark("reduce")
        if len(self.rec.times) == self.config.total_steps - 1:
            self.rec.state = _state_bytes(trainer)
        self.rec._last = time.perf_counter()  # the sample above is not part of any phase

    def on_train_batch_end(self, *_: Any) -> None:
        self.rec.end()


def _module(config: BenchConfig) -> GPTLightningModule:
    torch.manual_seed(0)  # the same initial weights on every rank and for every contender
    overrides = {"seq_len": config.seq_len} if config.seq_len > GPT_PRESETS[config.model].seq_len else None
    return GPTLightningModule(config.model, lr=1e-4, warmup_steps=0, model_overrides=overrides)


def _loader(config: BenchConfig, rank: int, world_size: int) -> DataLoader:
    """This rank's ``micro_batch`` sequences per step: disjoint across ranks, identical for every contender."""
    n = config.micro_batch * world_size * config.total_steps
    if config.data == "stdlib":
        dataset: Dataset = TokenChunkDataset(load_corpus(max_bytes=(n + 1) * config.seq_len + 1), config.seq_len)
    else:
        dataset = RandomTokenDataset(n, config.seq_len)
    sampler = DeterministicShardSampler(len(dataset), world_size, rank, shuffle=False)
    return DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True)


def _fit(strategy: pl.strategies.Strategy, config: BenchConfig, rec: StepRecorder, rank: int, world: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, precision="32-true",
                         max_steps=config.total_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[TimingCallback(rec, config)])  # fmt: skip
    trainer.fit(_module(config), _loader(config, rank, world))


def _plain_loop(config: BenchConfig, rec: StepRecorder, rank: int, world: int) -> None:
    module = _module(config)
    optimizer = module.configure_optimizers()
    for step, batch in enumerate(_loader(config, rank, world)):
        rec.start()
        optimizer.zero_grad()
        loss = module.loss(batch)
        rec.mark("forward")
        loss.backward()
        rec.mark("backward")
        if step == config.total_steps - 1:
            params = list(module.parameters())
            counter = StorageCounter()
            counter.add("params", params)
            counter.add("grads", [p.grad for p in params])
            for state in optimizer.state.values():
                counter.add("optimizer", [v for v in state.values() if isinstance(v, torch.Tensor)])
            rec.state = asdict(counter.result())
        rec._last = time.perf_counter()
        optimizer.step()
        rec.mark("optimizer")
        rec.end()


def _peak_rss(reset: bool = False) -> tuple[float, str]:
    """(bytes, how): VmHWM since the last reset when /proc allows resetting it, else ru_maxrss (lifetime)."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return float(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024, "VmHWM"
    except (OSError, TypeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "ru_maxrss"


def run_contender(name: str, config: BenchConfig, rank: int, world_size: int) -> dict[str, Any]:
    """Train ``name`` for ``config.total_steps`` steps on this rank; returns its raw measurements."""
    contender = CONTENDERS[name]
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the previous contender's heap back to the OS
    _peak_rss(reset=True)
    rec = StepRecorder()
    built = contender.build(config)
    if contender.kind == "lightning":
        _fit(built, config, rec, rank, world_size)
    else:
        built(config, rec, rank, world_size)
    rss, how = _peak_rss()
    return {"times": rec.times, "phases": rec.phases, "extra": rec.extra, "state": rec.state, "rss": rss,
            "rss_how": how}  # fmt: skip


# ------------------------------------------------------------------------------------------ process pool
def _worker_main(rank: int, world_size: int, port: int, threads: int, log_path: str, conn: Connection) -> None:
    """Join one gloo group, then run ``(contender, config)`` messages until ``None``; output goes to a log."""
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the worker
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": str(threads)})  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    base_env = dict(os.environ)  # Lightning's teardown deletes WORLD_SIZE: restored before every task
    conn.send((True, "ready"))
    while (message := conn.recv()) is not None:
        os.environ.clear()
        os.environ.update(base_env)
        torch.set_num_threads(threads)  # Lightning's launcher may have changed it
        try:
            conn.send((True, run_contender(*message, rank, world_size)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
    os._exit(0)


class WorkerPool:
    """``world_size`` spawned processes in one gloo group, kept alive across contenders (Lightning finds the
    group initialised and the rank variables set, so it neither spawns nor re-initialises)."""

    def __init__(self, world_size: int, threads: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.log_dir = Path(tempfile.mkdtemp(prefix="bench_zero_"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = tmp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            log = str(self.log_dir / f"rank{rank}.log")
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, threads, log, child), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._collect("start-up")

    def run(self, name: str, config: BenchConfig) -> list[dict[str, Any]]:
        """Run contender ``name`` on every rank; its measurements, by rank."""
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
                    if not replies[r][0]:  # the others are likely stuck in a collective: 10 s grace
                        deadline = min(deadline, time.monotonic() + 10)
                elif not self.procs[r].is_alive():
                    deadline = 0.0
        if len(replies) == self.world_size and all(ok for ok, _ in replies.values()):
            return [replies[r][1] for r in range(self.world_size)]
        self.close()
        errors = "\n".join(f"--- rank {r}:\n{value}" for r, (ok, value) in sorted(replies.items()) if not ok)
        raise RuntimeError(f"{label} failed or timed out ({self.timeout_s:g} s); logs in {self.log_dir}\n{errors}")

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []


# ------------------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class Row:
    """One contender's summary over the repeats (seconds and bytes)."""

    name: str
    step: float  # median over repeats of: max over ranks of the median measured step time
    low: float  # fastest and slowest repeat of that
    high: float
    ratio: float | None  # median over repeats of step / ddp's step in the same repeat
    phases: dict[str, float]  # median over repeats of: mean over ranks of each phase's median
    extra: dict[str, float]  # --profile probes, like phases
    state: dict[str, float]  # model-state bytes by kind, max over ranks (last repeat)
    rss: float  # median over repeats of: max over ranks of the peak RSS during the run


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: dict[str, list[list[dict[str, Any]]]], warmup: int) -> dict[str, Row]:
    """``runs[name][repeat][rank]`` (what :func:`run_contender` returned) -> one :class:`Row` per name."""

    def step(ranks: list[dict[str, Any]]) -> float:
        return max(_med(r["times"][warmup:]) for r in ranks)

    def part(ranks: list[dict[str, Any]], key: str, sub: str) -> float:
        return statistics.fmean(_med(r[key].get(sub, [])[warmup:]) for r in ranks)

    rows = {}
    for name, reps in runs.items():
        steps = [step(ranks) for ranks in reps]
        ratio = _med([s / step(d) for s, d in zip(steps, runs["ddp"])]) if "ddp" in runs else None
        rows[name] = Row(
            name, _med(steps), min(steps), max(steps), ratio,
            {p: _med([part(ranks, "phases", p) for ranks in reps]) for p in PHASES},
            {k: _med([part(ranks, "extra", k) for ranks in reps]) for k in reps[0][0]["extra"]},
            {k: max(r["state"].get(k, 0.0) for r in reps[-1]) for k in STATE_KINDS},
            _med([max(r["rss"] for r in ranks) for ranks in reps]),
        )  # fmt: skip
    return rows


def comm_share(runs: dict[str, list[list[dict[str, Any]]]], warmup: int) -> float | None:
    """DDP's communication share: median over repeats of (ddp - ddp_nosync) / ddp, step times as in Row."""
    if "ddp" not in runs or "ddp_nosync" not in runs:
        return None
    step = [[max(_med(r["times"][warmup:]) for r in ranks) for ranks in runs[n]] for n in ("ddp", "ddp_nosync")]
    return _med([(d - n) / d for d, n in zip(*step)])


def _table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [headers, [":--"] + ["--:"] * (len(headers) - 1), *rows]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(headers), *(fmt(r) for r in rows)])


def machine() -> str:
    """CPU model, cores, OS and library versions."""
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), cpu)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {os.cpu_count()} logical cores ({usable} usable), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, lightning {pl.__version__}")  # fmt: skip


def report(rows: dict[str, Row], config: BenchConfig, share: float | None, world: int, notes: list[str],
           markdown: bool) -> str:  # fmt: skip
    """The printable report: header, main table, DDP's comm share, the target check, phases (and probes)."""
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    out = [
        f"Model: {config.model} ({count_parameters(config.model) / 1e6:.2f}M parameters), AdamW, fp32; micro-batch "
        f"{config.micro_batch} x seq {config.seq_len} per rank, {config.data} tokens",
        f"Ranks: {world} CPU processes (gloo), {config.threads} torch thread(s) each; gradient buckets "
        f"{config.bucket_size:,} elements ({config.bucket_size * 4 / 2**20:.0f} MiB fp32)",
        f"Timing: {config.warmup} warm-up + {config.steps} measured steps per run; {len(rows)} contenders "
        f"interleaved over the repeats; step = max over ranks of the median step; table = median over repeats",
        f"Machine: {machine()}", *notes, "",
    ]  # fmt: skip
    headers = ["contender", "step ms", "[min-max]", "vs ddp", *[f"{k} MB" for k in STATE_KINDS], "peak RSS MB"]
    out.append(_table(headers, [
        [r.name, ms(r.step), f"[{ms(r.low)}-{ms(r.high)}]", "-" if r.ratio is None else f"{r.ratio:.3f}x",
         *[f"{r.state.get(k, 0.0) / MB:.1f}" + ("*" if k == "buffers" and r.name.startswith("ddp") else "")
           for k in STATE_KINDS], f"{r.rss / MB:.0f}"] for r in rows.values()], markdown))  # fmt: skip
    out += ["", "MB = 10^6 bytes per rank. Model state sampled before the last optimizer step: ZeRO rows from "
            "ZeroStrategy.model_state_bytes(), others counted by hand (params + grads + AdamW state). * = DDP's "
            "reducer buckets (a full gradient copy), sized from the parameters, not counted. Peak RSS: VmHWM of "
            "each run, max over ranks; noisy (allocator caching, Lightning, the 2 worker processes).", ""]  # fmt: skip
    if share is not None:
        out.append(f"DDP communication share: {share:.1%} of the DDP step (median over repeats of "
                   "(ddp - ddp_nosync) / ddp; ddp_nosync = the same DDP with no_sync() on every step)")  # fmt: skip
    for name in ("zero1", "zero2"):
        if name in rows and rows[name].ratio is not None:
            ok = "met" if rows[name].ratio <= TARGET_RATIO else "NOT met"
            out.append(f"Target {name} <= {TARGET_RATIO:.2f}x ddp: {rows[name].ratio:.3f}x, {ok}")
    out += ["", "Phases (ms per step; mean over ranks of each phase's median, median over repeats):", ""]
    out.append(_table(["contender", *PHASES, "sum"], [[r.name, *[ms(r.phases[p]) for p in PHASES],
                                                       ms(sum(r.phases.values()))] for r in rows.values()], markdown))  # fmt: skip
    probes = sorted({k for r in rows.values() for k in r.extra})
    if probes:
        out += ["", "Probes (--profile; ms per step, nested: hooks includes the bucket launches and waits it "
                "triggers, after_step includes zero_grad):", ""]  # fmt: skip
        out.append(_table(["contender", *probes], [[r.name, *[f"{r.extra[k] * 1e3:.1f}" if k in r.extra else "-"
                                                               for k in probes]] for r in rows.values() if r.extra],
                          markdown))  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Step time and memory of ZeRO stages vs Lightning DDP (CPU, gloo).")
    p.add_argument("--model", default="gpt_20m", choices=sorted(GPT_PRESETS), help="GPT preset")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--repeats", type=int, default=3, help="times every contender runs (interleaved)")
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="comma separated names (see --list)")
    p.add_argument("--bucket-size", type=int, default=BenchConfig.bucket_size, help="gradient bucket, elements")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--world-size", type=int, default=2, help="processes")
    p.add_argument("--data", default="random", choices=["random", "stdlib"], help="random tokens or stdlib text")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (docs/benchmarks.md)")
    p.add_argument("--profile", action="store_true", help="also time ZeroEngine internals (adds overhead)")
    p.add_argument("--json", type=Path, help="also write the raw per-step measurements here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one contender run may take")
    p.add_argument("--list", action="store_true", help="list the registered contenders and exit")
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
                         args.threads, args.data, args.profile)  # fmt: skip
    started, load = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    pool = WorkerPool(args.world_size, args.threads, args.timeout)
    try:
        for repeat in range(args.repeats):
            for name in names:
                t = time.perf_counter()
                runs[name].append(pool.run(name, config))
                print(f"[repeat {repeat + 1}/{args.repeats}] {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    finally:
        pool.close()
    notes = [f"Run: {started}, load average {load[0]:.2f} at the start and {os.getloadavg()[0]:.2f} at the end "
             f"({os.cpu_count()} cores; above {args.world_size} means other processes competed for them)"]  # fmt: skip
    rows = summarize(runs, config.warmup)
    print(report(rows, config, comm_share(runs, config.warmup), args.world_size, notes, args.markdown))
    if args.json:
        args.json.write_text(json.dumps({"config": asdict(config), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
