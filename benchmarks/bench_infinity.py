"""ZeRO-Infinity on a CPU host: whole jobs through the command line, each inside one memory cgroup.

Every run is ``lightning-zero train`` (2 ranks, fp32, seq 128, micro-batch 1, a few steps) started in a fresh
cgroup v1 memory group with a limit for the whole job (root only), so the kernel enforces the memory claim: a job
that needs more than the limit, less the page cache the kernel can take back, is OOM-killed. A sampler reads each
rank's resident memory every 0.2 s; the ranks' monitor logs the step-time breakdown and the swap I/O
(``time/rank<r>/*``, ``io/rank<r>/*``). The fit runs its steps with no time limit and saves no checkpoint at its
end (what is measured is training). Printed (markdown, as in docs/benchmarks.md):

* the jobs: model, configuration, cgroup, exit, the group's peak usage (page cache included) and peak anonymous
  memory, step time, swap bytes read and written per rank per step, the disk's bandwidth measured on the same
  directory (``os.write`` + fsync, cold ``os.read``: benchmarks/bench_offload.py ``disk``);
* the working set: each rank's peak anonymous memory (the working set: page cache and mapped file pages the kernel
  can drop are not) and peak resident set (``VmHWM``) against ``lightning-zero estimate``'s figure;
* the step against the disk: forward, backward, optimizer, the I/O threads' busy time against the training
  thread's wait for them (what was not overlapped), and the step's I/O at the measured bandwidth;
* the losses of runs of the same model step by step (``stage3`` against ``stage3/param_nvme``: equal).

    sudo python benchmarks/bench_infinity.py --runs gpt_1b/stage3/param_nvme,gpt_350m/stage0/none --limit 8G
    sudo python benchmarks/bench_infinity.py --runs gpt_125m/stage3/none,gpt_125m/stage3/param_nvme --steps 2

A run is ``model/zero/offload`` (``zero``: ``stage0`` is DDP, ``stage1`` .. ``stage3``; ``offload``: a
``conf/offload`` name), optionally ``/override;override`` of its own (``gpt_1b/stage3/param_nvme/model.n_layer=26``);
extra Hydra overrides for every run follow ``--``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.bench_offload import _raw  # noqa: E402
from lightning_zero.estimator import estimate_memory  # noqa: E402
from lightning_zero.models.gpt import GPT  # noqa: E402
from lightning_zero.models.gpt_config import resolve_config  # noqa: E402
from lightning_zero.testing.cgroups import cgroups_available, make_group  # noqa: E402

WORKER = "lightning_zero.config.run.worker"  # a rank's command line contains it


def _parse(run: str) -> tuple[str, str, str, list[str]]:
    """``model/zero/offload[/override;override...]``: the model, zero and offload groups, the run's own overrides."""
    model, zero, offload, *rest = run.split("/", 3)
    return model, zero, offload, [o for o in (rest[0].split(";") if rest else []) if o]


def _model(run: str) -> str:
    model, _, _, overrides = _parse(run)
    return model + (f" ({', '.join(overrides)})" if overrides else "")


@dataclass
class Sampled:
    """What the sampler saw: per rank (pid) peak anonymous and resident memory, the group's peak anonymous."""

    anon: dict[int, int] = field(default_factory=dict)
    hwm: dict[int, int] = field(default_factory=dict)
    group_anon: int = 0


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rows = [line.split(":", 1) for line in f]
    return {k: int(v.split()[0]) * 1024 for k, v in rows if k in ("RssAnon", "VmHWM")}


def _sample(group, seen: Sampled, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        try:
            pids = [int(p) for p in (group.path / "cgroup.procs").read_text().split()]
            seen.group_anon = max(seen.group_anon, group.stat("total_rss"))
        except (OSError, KeyError):
            continue
        for pid in pids:
            try:
                if WORKER not in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                    continue
                st = _status(pid)
            except (OSError, KeyError):
                continue
            seen.anon[pid] = max(seen.anon.get(pid, 0), st.get("RssAnon", 0))
            seen.hwm[pid] = max(seen.hwm.get(pid, 0), st.get("VmHWM", 0))


@dataclass
class Result:
    run: str
    code: int
    seconds: float
    peak: int
    kills: int
    seen: Sampled
    steps: list[dict[str, float]]  # metrics.csv rows with a loss (one per step)


def _job(run: str, args: argparse.Namespace, extra: list[str], work: Path) -> Result:
    model, zero, offload, own = _parse(run)
    name = f"lz_bench_inf_{os.getpid()}_{abs(hash(run))}"
    group = make_group(name, args.limit)
    cwd = work / name
    cwd.mkdir(parents=True, exist_ok=True)
    nvme = Path(args.nvme) / f"lz_inf_{os.getpid()}"
    nvme.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "lightning_zero.cli", "train", f"model={model}", f"zero={zero}",
               f"offload={offload}", f"offload.nvme_path={nvme}", "precision=fp32", f"data.seq_len={args.seq_len}",
               "data.micro_batch_size=1", f"trainer.max_steps={args.steps}", "trainer.validate_at_start=false",
               "trainer.validate_at_end=false", "trainer.val_check_interval=1000", "trainer.log_every_n_steps=1",
               "logger=csv", "model.build_in_configure_model=true", "trainer.max_time=null",
               "trainer.checkpoint.enabled=false", *own, *extra]
    join = f'echo $$ > "{group.path}/cgroup.procs" && exec "$0" "$@"'
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    seen, stop = Sampled(), threading.Event()
    sampler = threading.Thread(target=_sample, args=(group, seen, stop), daemon=True)
    print(f"[{run}] in {args.limit >> 20} MiB: {' '.join(command[3:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    sampler.start()
    try:
        proc = subprocess.run(["sh", "-c", join, *command], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        code = proc.returncode
        if code != 0:
            print("\n".join(proc.stderr.splitlines()[-5:]), file=sys.stderr)
    except subprocess.TimeoutExpired:
        code = 124
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    _reap(group)
    result = Result(run, code, seconds, group.peak, group.oom_kills, seen, _metrics(cwd))
    group.remove()
    subprocess.run(["rm", "-rf", str(nvme)], check=False)
    print(f"[{run}] exit {code} in {seconds:.0f} s, oom kills {result.kills}", file=sys.stderr, flush=True)
    return result


def _reap(group) -> None:
    """Kill what is left in the group (a rank whose peer was killed) and wait for it to go."""
    for _ in range(50):
        pids = (group.path / "cgroup.procs").read_text().split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        time.sleep(0.2)


def _metrics(cwd: Path) -> list[dict[str, float]]:
    files = sorted(cwd.glob("outputs/**/metrics.csv"))
    if not files:
        return []
    rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(files[-1].open())]
    return [r for r in rows if "train/loss" in r]


def _steady(res: Result, key: str) -> float:
    """The median over ranks' max and steps after the first (setup and first writes of the swap files) of ``key``
    (``time/rank{r}/step``-like, ``{r}`` filled per rank)."""
    steps = res.steps[1:] or res.steps
    per_step = [max(s.get(key.format(r=r), 0.0) for r in range(2)) for s in steps]
    return statistics.median(per_step) if per_step else float("nan")


def _estimate(run: str, seq_len: int) -> float:
    """The estimator's per-rank working set of stage 3 + ``param_nvme`` for the run's GPT (``nan`` where it has
    none)."""
    preset, _, offload, own = _parse(run)
    offload = "param_nvme"
    shape = {k.removeprefix("model."): int(v) for k, v in (o.split("=", 1) for o in own) if k.startswith("model.")}
    config = resolve_config(preset, shape)
    with torch.device("meta"):  # the preset with its shape overrides, counted on meta
        model = GPT(config)
    est = estimate_memory(model=model, world_size=2, precision="fp32", offload=offload, micro_batch=1,
                          seq_len=seq_len, accelerator="cpu", layers=config.n_layer, hidden=config.n_embd,
                          heads=config.n_head)
    row = next(c for c in est.configs if c.stage == 3 and c.offload == offload)
    return float("nan") if row.working_set is None else row.working_set.total


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def report(results: list[Result], args: argparse.Namespace, bandwidth: tuple[float, float]) -> None:
    write_bw, read_bw = bandwidth
    print(f"\n{len(results)} job(s), 2 ranks each, fp32, seq {args.seq_len}, micro-batch 1, {args.steps} steps; "
          f"cgroup v1 limit {args.limit / 2**30:g} GiB for the whole job; disk under the swap directory: "
          f"{write_bw / 1e6:.0f} MB/s write (+fsync), {read_bw / 1e6:.0f} MB/s cold read\n")
    print("| model | configuration | cgroup | exit | peak usage (page cache incl.) | peak anonymous (job) | step s "
          "| read / written per rank per step | disk bandwidth |")
    print("| :-- | :-- | --: | :-- | --: | --: | --: | --: | --: |")
    for res in results:
        _, zero, offload, _ = _parse(res.run)
        model = _model(res.run)
        config = ("DDP" if zero == "stage0" else zero.replace("stage", "stage ")) + (
            "" if offload == "none" else f" + {offload}")
        exit_text = (f"0 ({len(res.steps)} steps)" if res.code == 0 else f"{res.code} (OOM-killed x{res.kills})"
                     if res.kills else str(res.code))
        ok = bool(res.steps) and res.code == 0
        io = (f"{_gb(_steady(res, 'io/rank{r}/read'))} / {_gb(_steady(res, 'io/rank{r}/written'))}"
              if ok and offload.endswith("nvme") else "-")
        step = f"{_steady(res, 'time/rank{r}/step'):.1f}" if ok else "-"
        print(f"| {model} | {config} | {args.limit / 2**30:g} GiB | {exit_text} | {_gb(res.peak)} "
              f"| {_gb(res.seen.group_anon)} | {step} | {io} | {write_bw / 1e6:.0f} / {read_bw / 1e6:.0f} MB/s |")
    nvme = [r for r in results if _parse(r.run)[2] == "param_nvme" and r.code == 0]
    if nvme:
        print("\nWorking set per rank (stage 3 + param_nvme): peak anonymous memory (sampled every 0.2 s) and peak "
              "resident set (VmHWM, mapped file pages included) of each rank, against `lightning-zero estimate`\n")
        print("| model | rank peak anonymous | rank VmHWM | estimated | measured / estimated |")
        print("| :-- | --: | --: | --: | --: |")
        for res in nvme:
            est = _estimate(res.run, args.seq_len)
            anon, hwm = max(res.seen.anon.values(), default=0), max(res.seen.hwm.values(), default=0)
            print(f"| {_model(res.run)} | {_gb(anon)} | {_gb(hwm)} | {_gb(est)} | {anon / est:.2f} |")
        print("\nThe step against the disk (steps after the first, max over ranks): compute, the I/O threads' busy "
              "time, the training thread's wait for them (the part not overlapped), and the bytes that reached the "
              "disk (/proc/self/io; the rest of the swap I/O was served by the page cache) at the measured "
              "bandwidth (both ranks on the one disk)\n")
        print("| model | step s | forward | backward | optimizer | I/O busy | I/O waited | overlapped | disk read / "
              "written per rank | disk time at bandwidth | step / max(compute, disk) |")
        print("| :-- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
        for res in nvme:
            step, busy, wait = (_steady(res, f"{k}") for k in ("time/rank{r}/step", "io/rank{r}/busy",
                                                                "io/rank{r}/wait"))
            parts = [_steady(res, f"time/rank{{r}}/{k}") for k in ("forward", "backward", "optimizer")]
            disk_read, disk_written = _steady(res, "io/rank{r}/disk_read"), _steady(res, "io/rank{r}/disk_written")
            disk_s = 2 * (disk_read / read_bw + disk_written / write_bw)
            compute = step - wait
            print(f"| {_model(res.run)} | {step:.1f} | {parts[0]:.1f} | {parts[1]:.1f} | {parts[2]:.1f} "
                  f"| {busy:.1f} | {wait:.1f} | {max(busy - wait, 0.0):.1f} | {_gb(disk_read)} / {_gb(disk_written)} "
                  f"| {disk_s:.1f} "
                  f"| {step / max(compute, disk_s):.2f} |")
    by_model: dict[str, list[Result]] = {}
    for res in results:
        if res.code == 0 and res.steps:
            by_model.setdefault(_model(res.run), []).append(res)
    for model, runs in by_model.items():
        if len(runs) > 1:
            print(f"\nLosses of {model}, step by step\n")
            print("| run | " + " | ".join(f"step {i + 1}" for i in range(len(runs[0].steps))) + " |")
            print("| :-- |" + " --: |" * len(runs[0].steps))
            for res in runs:
                print(f"| {res.run} | " + " | ".join(repr(s["train/loss"]) for s in res.steps) + " |")
            same = all([s["train/loss"] for s in r.steps] == [s["train/loss"] for s in runs[0].steps] for r in runs)
            print(f"\nequal: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="gpt_1b/stage3/param_nvme,gpt_350m/stage0/none",
                        help="comma separated model/zero/offload")
    parser.add_argument("--limit", default="8G", help="the whole job's memory cgroup limit (K, M, G suffixes)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--nvme", default=tempfile.gettempdir(), help="the swap files' directory (measured too)")
    parser.add_argument("--disk-mib", type=int, default=1024, help="bytes the disk measurement writes and reads")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds a job may take")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    if not cgroups_available():
        sys.exit("bench_infinity needs root and cgroup v1's memory hierarchy at /sys/fs/cgroup/memory: run it with "
                 "sudo on a host that mounts it")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    args.limit = int(float(args.limit[:-1]) * units[args.limit[-1].upper()]) if args.limit[-1].isalpha() \
        else int(args.limit)
    write_s, read_s = _raw(args.nvme, args.disk_mib << 20)
    bandwidth = ((args.disk_mib << 20) / write_s, (args.disk_mib << 20) / read_s)
    with tempfile.TemporaryDirectory(prefix="lz_bench_inf_") as work:
        results = [_job(run, args, extra, Path(work)) for run in args.runs.split(",")]
    report(results, args, bandwidth)


if __name__ == "__main__":
    main()
