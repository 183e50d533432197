"""The generated parts of docs/benchmarks.md and docs/tuning.md: markdown from ``run_all.py``'s summaries, written
between ``<!-- run_all:begin -->`` and ``<!-- run_all:end -->`` so that the hand-written rest of each page stays."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.harness.config import MB, STATE_KINDS
from benchmarks.harness.report import _table

BEGIN, END = "<!-- run_all:begin -->", "<!-- run_all:end -->"
LOSS_TOLERANCE = 1e-4  # fp32: systems training the same model agree this closely after N steps
FORMULA_TOLERANCE = 0.02
SAME = 1e-3  # "no larger": equal bytes within 0.1% count as met
STAGE_RATIO_TARGETS = {"zero1": 1.02, "zero2": 1.03, "zero3": 1.05}
Rows = list[dict[str, Any]]


def replace_between_markers(path: Path, body: str) -> None:
    """Put ``body`` between the markers of ``path`` (which must have them: the hand-written parts stay)."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers: add them where the generated part goes")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{body.rstrip()}\n{END}{tail}")


def loss_check(rows: Rows, baseline: str = "ddp") -> tuple[list[str], list[str]]:
    """(lines, disagreeing systems): each compared system's last loss against ``baseline``'s."""
    ref = next((r["loss"] for r in rows if r["name"] == baseline), float("nan"))
    first = next((r.get("first_loss", float("nan")) for r in rows if r["name"] == baseline), float("nan"))
    bad = [r["name"] for r in rows if r.get("compared", True) and not abs(r["loss"] - ref) <= LOSS_TOLERANCE]
    lines = [f"Loss after the last step (mean over ranks): {baseline} {ref:.6f}; every system within "
             f"{LOSS_TOLERANCE:g}: " + ("yes." if not bad else f"**NO: {', '.join(bad)} trained a different model "
                                       "and cannot be compared.**")
             + ("" if math.isnan(first) else
                f" Over the run {baseline}'s loss moved by {abs(first - ref):.1e} (from {first:.6f} at the first step):"
                " a system that skipped or mis-scaled its updates would be off by about that much.")]  # fmt: skip
    return lines, bad


def _mb(x: float) -> str:
    return "-" if not x else f"{x / MB:.1f}"


def rows_table(rows: Rows, baseline: str = "ddp") -> str:
    ref = next((r["loss"] for r in rows if r["name"] == baseline), float("nan"))
    head = ["system", "step ms", "[min-max]", f"vs {baseline}", *[f"{k} MB" for k in STATE_KINDS], "live MB",
            "peak RSS MB", "loss", "loss - " + baseline]  # fmt: skip
    body = [[r["name"], f"{r['step'] * 1e3:.0f}", f"[{r['low'] * 1e3:.0f}-{r['high'] * 1e3:.0f}]",
             f"{r['ratio']:.3f}x", *[_mb(r["state"][k]) for k in STATE_KINDS], _mb(r["live"]),
             f"{r['rss'] / MB:.0f}", f"{r['loss']:.6f}",
             "-" if math.isnan(r["loss"]) else f"{r['loss'] - ref:+.1e}"] for r in rows]  # fmt: skip
    return _table(head, body, markdown=True)


def formula_check(rows: Rows, expected: dict[str, float]) -> list[str]:
    """lightning_zero's model state (params + grads + optimizer) against the estimator's ZeRO formula."""
    out = ["| stage | measured MB | formula MB (estimator) | difference | within 2% |",
           "| :-- | --: | --: | --: | :-- |"]
    for r in rows:
        if r["name"] in expected:
            got = sum(r["state"][k] for k in ("params", "grads", "optimizer"))
            diff = got / expected[r["name"]] - 1
            out.append(f"| {r['name']} | {got / MB:.1f} | {expected[r['name']] / MB:.1f} | {diff:+.2%} | "
                       f"{'yes' if abs(diff) <= FORMULA_TOLERANCE else '**no**'} |")  # fmt: skip
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def targets(rows: Rows) -> list[str]:
    """The issue's targets at 2 ranks: lightning_zero vs DeepSpeed per stage, vs DDP, stage 3 vs FSDP2."""
    by = {r["name"]: r for r in rows}
    out = []
    for name, limit in STAGE_RATIO_TARGETS.items():
        if name in by:
            ratio = by[name]["ratio"]
            out.append(f"- {name} <= {limit:.2f}x ddp: {ratio:.3f}x, {_verdict(ratio <= limit)}")
    for s in range(4):
        ours, theirs = by.get(f"zero{s}"), by.get(f"ds_zero{s}")
        if ours and theirs:
            speed = ours["step"] / theirs["step"]
            out.append(f"- zero{s} vs DeepSpeed stage {s}: step {speed:.3f}x ({_verdict(speed < 1)}); live tensors "
                       f"{ours['live'] / MB:.1f} vs {theirs['live'] / MB:.1f} MB "
                       f"({_verdict(ours['live'] <= theirs['live'] * (1 + SAME))}); peak RSS {ours['rss'] / MB:.0f} vs "
                       f"{theirs['rss'] / MB:.0f} MB ({_verdict(ours['rss'] <= theirs['rss'])})")  # fmt: skip
    if "zero3" in by and "fsdp2" in by:
        z3, f2 = by["zero3"], by["fsdp2"]
        speed, small = z3["step"] / f2["step"], sum(z3["state"].values()) <= sum(f2["state"].values())
        out.append(f"- zero3 vs fsdp2: step {speed:.3f}x ({_verdict(speed < 1)}); model state "
                   f"{sum(z3['state'].values()) / MB:.1f} vs {sum(f2['state'].values()) / MB:.1f} MB "
                   f"({_verdict(small)}); peak RSS {z3['rss'] / MB:.0f} vs {f2['rss'] / MB:.0f} MB "
                   f"({_verdict(z3['rss'] <= f2['rss'])})")  # fmt: skip
    return out


def growth_table(cells: dict[tuple[str, int], Rows], sizes: list[str], worlds: list[int]) -> str:
    systems = list(dict.fromkeys(r["name"] for rows in cells.values() for r in rows))
    head = ["size", "ranks", *[f"{s} (x ddp / MB)" for s in systems]]
    body = []
    for world in worlds:
        for size in sizes:
            by = {r["name"]: r for r in cells.get((size, world), [])}
            if by:
                body.append([size, str(world), *[
                    "-" if s not in by else
                    f"{by[s]['ratio']:.2f}x / {(sum(by[s]['state'].values()) or by[s]['live']) / MB:.0f}"
                    for s in systems]])  # fmt: skip
    return _table(head, body, markdown=True)


def sweep_reading(rows: Rows, baseline: str = "zero2") -> str:
    """One sentence reading a sweep: the fastest and slowest setting, and whether their step-time ranges (min-max
    over rounds) are apart, i.e. whether the knob's effect stands out of this run's spread."""
    points = [r for r in rows if r["name"] != baseline]
    if len(points) < 2:
        return ""
    fast, slow = min(points, key=lambda r: r["ratio"]), max(points, key=lambda r: r["ratio"])
    apart = fast["high"] < slow["low"]
    return (f"Reading: fastest {fast['name']} ({fast['ratio']:.3f}x {baseline}), slowest {slow['name']} "
            f"({slow['ratio']:.3f}x); their step ranges [{fast['low'] * 1e3:.0f}-{fast['high'] * 1e3:.0f}] and "
            f"[{slow['low'] * 1e3:.0f}-{slow['high'] * 1e3:.0f}] ms "
            + ("are apart: a measured effect." if apart else
               "overlap: in this run the knob's effect is within the spread between rounds."))
