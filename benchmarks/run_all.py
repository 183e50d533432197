"""Every peer in one run: regenerates the measured parts of docs/benchmarks.md and docs/tuning.md, and the figures.

Run from the repository root::

    python benchmarks/run_all.py                 # the whole run (about 30 minutes on an idle 2-core machine)
    python benchmarks/run_all.py --quick         # a smoke run on a tiny GPT (writes nothing unless --write)

The same GPT, the same rows per rank, fp32, one thread per rank, for every system registered in
``benchmarks/harness/contenders.py``: Lightning DDP, PyTorch's ZeroRedundancyOptimizer, FSDP2 (with and without
``reshard_after_forward``), DeepSpeed stages 0-3 (under ``--deepspeed-python``, auto-detected when this interpreter
imports deepspeed; skipped with a line saying why otherwise) and lightning_zero stages 0-3 with offload. The cells
(``harness/plan.py``): all peers at ~20M parameters on 2 ranks, growth over ~5M/~20M/~80M x 1/2/4 ranks, and the
stage-3 knob sweeps of docs/tuning.md. Within a cell the systems run interleaved over rounds; times are ratios to a
baseline of the same round. Losses must agree within 1e-4: a disagreement is printed loudly and fails the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import pages, plan, plots  # noqa: E402
from benchmarks.harness.config import MB  # noqa: E402
from benchmarks.harness.contenders import CONTENDERS  # noqa: E402
from benchmarks.harness.plan import Cell, parameters  # noqa: E402
from benchmarks.harness.pools import Pools, find_deepspeed_python  # noqa: E402
from benchmarks.harness.report import machine, summarize  # noqa: E402
from lightning_zero.estimator import estimate_memory  # noqa: E402

LIMIT_S = 35 * 60
POOL_STARTUP: dict[tuple[str, int], float] = {}  # (interpreter kind, world size) -> seconds to start the pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="All peers, growth and stage-3 sweeps in one run; regenerates the docs.")
    add = p.add_argument
    add("--quick", action="store_true", help="smoke run: tiny GPT, 1 round, 2 steps; writes pages only with --write")
    add("--deepspeed-python", default=None, help="interpreter that imports deepspeed (default: this one if it does)")
    add("--systems", default=None, help="comma separated peers (default: all registered peers)")
    add("--sizes", default=None, help="comma separated growth sizes (default 5M,20M,80M; --quick: tiny)")
    add("--worlds", default="1,2,4", help="growth world sizes")
    add("--parts", default="peers,items,sweeps,growth", help="which parts to run")
    add("--docs", type=Path, default=REPO_ROOT / "docs", help="where benchmarks.md, tuning.md and img/ are")
    add("--write", action="store_true", help="with --quick: write the pages and figures anyway")
    add("--json", type=Path, help="also write every summary row to this file")
    add("--timeout", type=float, default=900.0, help="seconds one system run may take")
    add("--rounds", type=int, default=None, help="override the rounds of every cell (a partial check; the page "
        "needs >= 3)")
    add("--estimate", action="store_true", help="print the plan and its time estimate, run nothing")
    return p.parse_args(argv)


def _ds_op_cache() -> str:
    """Whether DeepSpeed's JIT-built ops are cached already (else the first initialize builds them)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    built = sorted({p.parent.name for p in root.glob("*/*/*.so")}) if root.exists() else []
    return f"ops cached before the run: {', '.join(built)}" if built else "no DeepSpeed op cached before the run"


def _ram() -> str:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        kb = next(int(ln.split()[1]) for ln in lines if ln.startswith("MemTotal"))
        return f"{kb * 1024 / 2**30:.0f} GiB RAM"
    except (OSError, StopIteration):
        return "RAM unknown"


def run_cells(cells: list[Cell], ds_python: str | None, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Run every cell (its systems interleaved over its rounds); the summary rows of each cell."""
    results: dict[str, list[dict[str, Any]]] = {}
    pools: Pools | None = None
    try:
        for cell in cells:
            if pools is None or pools.world_size != cell.world_size:
                if pools is not None:
                    POOL_STARTUP.update({(k, pools.world_size): v for k, v in pools.startup_s.items()})
                    pools.close()
                pools = Pools(cell.world_size, 1, timeout, ds_python)
            runs: dict[str, list[Any]] = {e.label: [] for e in cell.entries}
            for round_ in range(cell.rounds):
                # each round starts at another system: whatever the first run in a fresh pool pays is shared
                shift = round_ % len(cell.entries)
                for entry in cell.entries[shift:] + cell.entries[:shift]:
                    t = time.perf_counter()
                    runs[entry.label].append(pools.run(entry.contender, entry.config))
                    print(f"[{cell.key} round {round_ + 1}/{cell.rounds}] {entry.label}: "
                          f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
            baseline = cell.entries[0].label
            rows = summarize(runs, cell.entries[0].config.warmup, baseline)
            for row, entry in zip(rows, cell.entries):
                row["compared"] = CONTENDERS[entry.contender].compared
                row["contender"] = entry.contender
            results[cell.key] = rows
    finally:
        if pools is not None:
            POOL_STARTUP.update({(k, pools.world_size): v for k, v in pools.startup_s.items()})
            pools.close()
    return results


def _formula(rows: list[dict[str, Any]], n: int, world: int) -> dict[str, float]:
    est = estimate_memory(n, world_size=world, precision="fp32", offload="none")
    names = {r["name"] for r in rows}
    return {f"zero{s}": est.config(s).on_device.model_states for s in range(4) if f"zero{s}" in names}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = plan.QUICK if args.quick else plan.FULL
    if args.rounds is not None:
        budget = dataclasses.replace(budget, rounds=args.rounds)
    sizes = tuple((args.sizes or ("tiny" if args.quick else "5M,20M,80M")).split(","))
    peer_size = "tiny" if args.quick else "20M"
    worlds = tuple(int(w) for w in args.worlds.split(","))
    parts = tuple(args.parts.split(","))
    peers = tuple(args.systems.split(",")) if args.systems else plan.PEERS
    if unknown := [n for n in peers if n not in CONTENDERS] + [s for s in sizes if s not in plan.SIZES]:
        raise SystemExit(f"unknown system(s) or size(s) {unknown}; systems: {sorted(CONTENDERS)}, "
                         f"sizes: {list(plan.SIZES)}")
    growth = tuple(n for n in plan.GROWTH if n in peers or not args.systems)
    ds_python, ds_note = None, "no DeepSpeed system asked for"
    if any(CONTENDERS[n].pool == "deepspeed" for n in (*peers, *growth)):
        ds_python, ds_note = find_deepspeed_python(args.deepspeed_python)
    if ds_python is None:
        print(f"DeepSpeed: SKIPPED ({ds_note})", file=sys.stderr)
        peers = tuple(n for n in peers if CONTENDERS[n].pool != "deepspeed")
        growth = tuple(n for n in growth if CONTENDERS[n].pool != "deepspeed")
    cells = plan.build_plan(budget, sizes, worlds, peers, growth, peer_size, parts)
    estimate = plan.estimate_seconds(cells)
    print(f"Plan: {len(cells)} cells, {sum(len(c.entries) * c.rounds for c in cells)} system runs; estimated "
          f"{estimate / 60:.1f} min on this machine at idle (limit {LIMIT_S / 60:.0f} min)", file=sys.stderr)
    for cell in cells:
        print(f"  {cell.key}: {cell.world_size} rank(s), {len(cell.entries)} systems x {cell.rounds} round(s)",
              file=sys.stderr)
    if estimate > LIMIT_S:
        print(f"WARNING: the estimate is over {LIMIT_S / 60:.0f} min: fewer --parts, --sizes or --worlds, or a quieter "
              "machine", file=sys.stderr)  # fmt: skip
    if args.estimate:
        return 0
    # absolute paths (a venv, a temporary directory) are this machine's, not the page's: shown by their role
    given = sys.argv[1:] if argv is None else list(argv)
    shown = [f"<{prev.lstrip('-')}>" if a.startswith("/") else a for prev, a in zip(["", *given], given)]
    command = "python " + " ".join(shlex.quote(a) if not a.startswith("<") else a
                                   for a in ["benchmarks/run_all.py", *shown])  # fmt: skip
    ds_cache = _ds_op_cache()
    load_before, started, t0 = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M %Z"), time.perf_counter()
    results = run_cells(cells, ds_python, args.timeout)
    elapsed, load_after = time.perf_counter() - t0, os.getloadavg()
    facts = [
        f"Command: `{command}`",
        f"Machine: {machine()}, {_ram()}; " + (ds_note if ds_python else "deepspeed: not run"),
        f"Run: {started}, {elapsed / 60:.1f} min (estimated {estimate / 60:.1f}); load average (1, 5, 15 min) "
        f"{'/'.join(f'{x:.2f}' for x in load_before)} before, {'/'.join(f'{x:.2f}' for x in load_after)} after",
        f"Budget: {budget.warmup} warm-up + {budget.peer_steps} measured steps per peer run "
        f"({budget.peer_batch[0]} x {budget.peer_batch[1]} tokens per rank), {budget.growth_steps} per growth run "
        f"({budget.growth_batch[0]} x {budget.growth_batch[1]}), {budget.sweep_steps} per sweep and speed-item run "
        f"({budget.sweep_batch[0]} x {budget.sweep_batch[1]}); {budget.rounds} interleaved round(s) each; a run's "
        "step = max over ranks of the median step, then median over rounds; ratios = median over rounds of the "
        "same-round ratio; each round starts at the next system of the cell",
        "Every system: the same GPT (seed 0), AdamW lr 1e-4, fp32, the same rows per rank (a pipeline replica: "
        "the rows of its ranks), 1 torch thread per rank, gloo on CPU. DeepSpeed: a plain loop over "
        "deepspeed.initialize (Lightning's DeepSpeedStrategy refuses the CPU), DS_ACCELERATOR=cpu"
        + ("" if ds_python else f" -- SKIPPED: {ds_note}"),
        "Pool start-up (spawn, imports, the gloo group; not timed in any step): " + ", ".join(
            f"{kind} {world} rank(s) {s:.1f} s" for (kind, world), s in POOL_STARTUP.items()),
    ]
    ds_init = [r["info"]["ds_first_init_s"] for rows in results.values() for r in rows
               if "ds_first_init_s" in r["info"]]  # fmt: skip
    if ds_init:
        facts.append(f"DeepSpeed's first `deepspeed.initialize` in each pool process (import, JIT op build or load; "
                     f"not timed in any step): up to {max(ds_init):.1f} s; {ds_cache}")
    disagree = write_pages(args, results, cells, facts)
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "results": results}, default=str, indent=1))
    if disagree:
        print(f"LOSSES DISAGREE (> {pages.LOSS_TOLERANCE:g}): {disagree}", file=sys.stderr)
        return 1
    return 0


def write_pages(args: argparse.Namespace, results: dict[str, Any], cells: list[Cell], facts: list[str]) -> list[str]:
    """Print the report; unless --quick (without --write), write the pages and figures. The disagreeing systems."""
    write = args.write or not args.quick
    img = args.docs / "img"
    bench, tuning, disagree = [*(f"- {f}" for f in facts), ""], [], []
    by_key = {c.key: c for c in cells}
    if "peers" in results:
        rows, cell = results["peers"], by_key["peers"]
        n = parameters(cell.entries[0].config)
        base = cell.entries[0].label  # ddp unless --systems leaves it out
        lines, bad = pages.loss_check(rows, base)
        disagree += bad
        bench += [f"### All peers: {cell.size} GPT ({n / 1e6:.1f}M parameters), {cell.world_size} ranks", "",
                  pages.rows_table(rows, base), "", *lines, "",
                  "Model state (params + grads + optimizer) of lightning_zero against the ZeRO formula "
                  "(`lightning_zero.estimator.estimate_memory`, fp32):", "",
                  *pages.formula_check(rows, _formula(rows, n, cell.world_size)), "",
                  "Targets of issue 21:", "", *pages.targets(rows), ""]  # fmt: skip
        if write:
            plots.peers(rows, img / "peers.png", f"{cell.size} GPT, {cell.world_size} ranks, fp32")
            bench += ["", "![peers](img/peers.png)", ""]
    items = [c for c in cells if c.key.startswith("items:")]
    if items:
        bench += ["### Stage 3 speed items (issue 21): before and after, in the same run", "",
                  "`zero3_before` is stage 3 with the three items off (every gather checked, every gather's memory "
                  "allocated afresh, the shard copied at one rank); `zero3_agree_always`, `zero3_nopool` and "
                  "`zero3_copy` switch one item off; `zero3` has all three. Ratios to `zero3_before` in the same "
                  "round.", ""]  # fmt: skip
    for cell in items:
        rows = results[cell.key]
        lines, bad = pages.loss_check(rows, baseline="zero3_before")
        disagree += bad
        c = cell.entries[0].config
        bench += [f"{cell.size} GPT, {cell.world_size} rank(s), {c.micro_batch} x {c.seq_len} tokens per rank:", "",
                  pages.rows_table(rows, baseline="zero3_before"), "", *lines, ""]  # fmt: skip
    growth = {(c.size, c.world_size): results[c.key] for c in cells if c.key.startswith("growth:")}
    if growth:
        sizes = list(dict.fromkeys(c.size for c in cells if c.key.startswith("growth:")))
        worlds = sorted({w for _, w in growth})
        for key, rows in growth.items():
            lines, bad = pages.loss_check(rows, rows[0]["name"])
            disagree += [f"{b} ({key[0]}, {key[1]} ranks)" for b in bad]
        note = ("4 ranks share 2 cores: their times include waiting for a core" if 4 in worlds and
                os.cpu_count() and os.cpu_count() < 4 else "")  # fmt: skip
        bench += ["### Growth: model size x ranks", "", "Step time as a ratio to DDP's and model state per rank "
                  f"(MB; live tensors for DeepSpeed). {note + '.' if note else ''}", "",
                  pages.growth_table(growth, sizes, worlds), ""]
        if write:
            plots.growth(growth, sizes, worlds, "ratio", "step / DDP's", img / "growth_time.png", note)
            plots.growth(growth, sizes, worlds, "state", "model state MB per rank", img / "growth_memory.png", note)
            plots.growth(growth, sizes, worlds, "rss", "peak RSS MB per rank", img / "growth_rss.png", note)
            bench += ["![growth time](img/growth_time.png)", "", "![growth memory](img/growth_memory.png)", "",
                      "![growth rss](img/growth_rss.png)", ""]
    for knob in plan.SWEEPS:
        key = f"sweep:{knob}"
        if key in results:
            rows = results[key]
            lines, bad = pages.loss_check(rows, baseline="zero2")
            disagree += bad
            slug = knob.split(" ")[0]
            tuning += [f"### Sweep: {knob}", "", pages.rows_table(rows, baseline="zero2"), "",
                       "Most elements gathered at once (zero3): " + ", ".join(
                           f"{r['name'].split('=', 1)[1]}: {r['gathered_peak'] / 1e6:.2f}M" for r in rows
                           if r["name"].startswith("zero3")),
                       "", pages.sweep_reading(rows), "", *lines, ""]  # fmt: skip
            if write:
                plots.sweep(rows, knob, img / f"tuning_{slug}.png")
                tuning += [f"![{knob}](img/tuning_{slug}.png)", ""]
    if "peers" in results:
        tuning += advisor_section(results["peers"], by_key["peers"], img, write)
    text = "\n".join(bench)
    print(text + "\n\n" + "\n".join(tuning))
    if disagree:
        print(f"\n**LOSSES DISAGREE: {disagree}**")
    if write:
        pages.replace_between_markers(args.docs / "benchmarks.md", text)
        if tuning:
            pages.replace_between_markers(args.docs / "tuning.md", "\n".join([*(f"- {f}" for f in facts), "", *tuning]))
    return disagree


def advisor_section(rows: list[dict[str, Any]], cell: Cell, img: Path, write: bool) -> list[str]:
    """The estimator (which the advisor walks) against the measured model state, and the advisor's pick for a
    device budget just above each measured stage."""
    from lightning_zero.estimator.advisor import advise

    n, by = parameters(cell.entries[0].config), {r["name"]: r for r in rows}
    expected = _formula(rows, n, cell.world_size)
    data, out = [], ["### Picking a stage: the advisor against measured runs", "",
                     "| stage | estimator MB | measured MB | budget (measured / 0.9) | advisor picks |",
                     "| :-- | --: | --: | --: | :-- |"]  # fmt: skip
    for name, formula in expected.items():
        got = sum(by[name]["state"][k] for k in ("params", "grads", "optimizer"))
        budget = got * 1.01 / 0.9  # the advisor keeps 10% headroom
        advice = advise(n, device_memory=budget, world_size=cell.world_size, precision="fp32", headroom=0.1)
        pick = advice.choice.label if advice.choice is not None else "nothing fits"
        data.append((name, formula, got))
        out.append(f"| {name} | {formula / MB:.1f} | {got / MB:.1f} | {budget / MB:.1f} | {pick} |")
    if write and data:
        plots.advisor(data, img / "advisor.png")
        out += ["", "![advisor](img/advisor.png)"]
    return [*out, ""]


if __name__ == "__main__":
    sys.exit(main())
