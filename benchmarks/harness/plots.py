"""The figures of ``run_all.py`` (PNG, matplotlib's Agg backend): peers side by side, growth with model size and
ranks (one line per system), the stage-3 knob sweeps and the estimator against the measured model state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.config import MB

Rows = list[dict[str, Any]]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("run_all.py draws its figures with matplotlib: pip install 'lightning_zero[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    fig.clf()
    return path


def peers(rows: Rows, path: Path, title: str) -> Path:
    """Step time as a ratio to DDP, and model state / peak RSS per rank, one bar per system."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in rows]
    left.barh(names, [r["ratio"] for r in rows], color="tab:blue")
    left.axvline(1.0, color="black", lw=0.8)
    left.set_xlabel("median step time / DDP's (same round)")
    left.invert_yaxis()
    state = [(sum(r["state"].values()) or r["live"]) / MB for r in rows]
    y = range(len(rows))
    right.barh([i - 0.2 for i in y], state, height=0.4, label="model state (live tensors for DeepSpeed)")
    right.barh([i + 0.2 for i in y], [r["rss"] / MB for r in rows], height=0.4, label="peak RSS")
    right.set_yticks(list(y), names)
    right.invert_yaxis()
    right.set_xlabel("MB per rank")
    right.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2)  # above: no bar under it
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def growth(cells: dict[tuple[str, int], Rows], sizes: list[str], worlds: list[int], key: str, ylabel: str,
           path: Path, note: str) -> Path:  # fmt: skip
    """``key`` of every system against model size (one panel per world size) and against ranks (one per size)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, max(len(worlds), len(sizes)), figsize=(4 * max(len(worlds), len(sizes)), 7),
                             squeeze=False)  # fmt: skip
    systems = list(dict.fromkeys(r["name"] for rows in cells.values() for r in rows))
    value = (lambda r: r[key] / MB) if key in ("rss", "live") else (lambda r: r[key])
    if key == "state":
        value = lambda r: (sum(r["state"].values()) or r["live"]) / MB  # noqa: E731
    for col, world in enumerate(worlds):
        ax = axes[0][col]
        for name in systems:
            points = [(i, value(r)) for i, s in enumerate(sizes) for r in cells.get((s, world), [])
                      if r["name"] == name]  # fmt: skip
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_title(f"{world} rank(s)", fontsize=9)
        ax.set_xlabel("model size (parameters)")
        ax.set_ylabel(ylabel)
    for col, size in enumerate(sizes):
        ax = axes[1][col]
        for name in systems:
            points = [(w, value(r)) for w in worlds for r in cells.get((size, w), []) if r["name"] == name]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xticks(worlds)
        ax.set_title(f"{size} parameters", fontsize=9)
        ax.set_xlabel("ranks (4 ranks share 2 cores)" if 4 in worlds else "ranks")
        ax.set_ylabel(ylabel)
    for row in axes:
        for ax in row:
            if not ax.has_data():
                ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(note, fontsize=9)
    return _save(fig, path)


def sweep(rows: Rows, knob: str, path: Path) -> Path:
    """One stage-3 knob: step time against zero2's, and the most parameter elements gathered at once."""
    plt = _pyplot()
    points = [r for r in rows if r["name"].startswith("zero3")]
    labels = [r["name"].split("=", 1)[1] for r in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(labels, [r["ratio"] for r in points], marker="o")
    left.axhline(1.0, color="black", lw=0.8, label="zero2")
    left.set_xlabel(knob)
    left.set_ylabel("zero3 step time / zero2's")
    left.legend(fontsize=8)
    right.plot(labels, [r["gathered_peak"] / 1e6 for r in points], marker="o", color="tab:orange")
    right.set_xlabel(knob)
    right.set_ylabel("most elements gathered at once (M)")
    fig.suptitle(f"stage 3: {knob}", fontsize=10)
    return _save(fig, path)


def advisor(rows: list[tuple[str, float, float]], path: Path) -> Path:
    """Estimator's model state per rank against the measured one, per stage."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] / MB for r in rows], width=0.4, label="estimator (ZeRO formula)")
    ax.bar([i + 0.2 for i in x], [r[2] / MB for r in rows], width=0.4, label="measured")
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_ylabel("model state MB per rank")
    ax.legend(fontsize=8)
    return _save(fig, path)
