"""From raw per-step measurements to the tables: medians over repeats, ratios to DDP, the targets."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness.config import MB, PHASES, STATE_KINDS, TARGET_RATIO, TARGET_RATIO_STAGE3, BenchConfig, Runs


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _step(ranks: list[dict[str, Any]], warmup: int, key: str = "times") -> float:
    """One run's step time: the median measured step of each rank, max over ranks (mean for CPU time)."""
    per_rank = [_med(r[key][warmup:]) for r in ranks]
    return max(per_rank) if key == "times" else statistics.fmean(per_rank)


def _part(reps: list[list[dict[str, Any]]], warmup: int, key: str, sub: str) -> float:
    """A phase or probe: its median step per rank, mean over ranks, median over repeats."""
    return _med([statistics.fmean(_med(r[key][sub][warmup:]) for r in ranks) for ranks in reps])


def summarize(runs: Runs, warmup: int, baseline: str = "ddp") -> list[dict[str, Any]]:
    """One row per contender: medians over the repeats (seconds, bytes); ratios to ``baseline``'s run of the same
    repeat; ``loss``: the last step's training loss, mean over ranks (the same in every repeat)."""
    rows = []
    ddp = runs.get(baseline)
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
            "loss": _med([statistics.fmean(r["losses"][-1] for r in rk) for rk in reps if rk[0].get("losses")]),
            "first_loss": _med([statistics.fmean(r["losses"][0] for r in rk) for rk in reps if rk[0].get("losses")]),
            "live": max(r["state"].get("live", 0.0) for r in reps[-1]),
            "info": reps[0][0].get("info", {}),
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
