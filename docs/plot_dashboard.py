"""Render ZeroStatsMonitor's TensorBoard dashboard (its custom-scalars layout) from event files with matplotlib:

    python docs/plot_dashboard.py <TensorBoard log dir> [out.png]    # default out: docs/monitoring_dashboard.png

One row per layout category, one chart per layout chart, one line per matching tag (per rank for the
``time/`` and ``memory/`` charts), as TensorBoard's CUSTOM SCALARS tab draws them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_zero.monitoring import dashboard_layout


def plot(log_dir: str | Path, out: str | Path) -> Path:
    """Draw every non-empty chart of :func:`~lightning_zero.monitoring.dashboard_layout` into ``out``."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    rows = []
    for category, charts in dashboard_layout().items():
        found = [(title, [t for t in tags if any(re.search(p, t) for p in spec[1])]) for title, spec in charts.items()]
        found = [(title, lines) for title, lines in found if lines]
        if found:
            rows.append((category, found))
    cols = max(len(charts) for _, charts in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(3.4 * cols, 2.6 * len(rows)), squeeze=False)
    for r, (category, charts) in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(charts):
                ax.axis("off")
                continue
            title, lines = charts[c]
            unit = 2**20 if "(bytes)" in title else 1  # memory in MiB
            for tag in sorted(lines):
                events = acc.Scalars(tag)
                rank = re.search(r"/(rank\d+)/", tag)
                ax.plot([e.step for e in events], [e.value / unit for e in events], lw=1,
                        label=rank.group(1) if rank else tag.split("/")[-1])
            title = title.replace("(bytes)", "(MiB)")
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
            ax.set_title(title, fontsize=9)
            ax.tick_params(labelsize=7)
            if "loss scale" in title:
                ax.set_yscale("log", base=2)
            if len(lines) > 1:
                ax.legend(fontsize=7)
            if c == 0:
                ax.set_ylabel(category.removeprefix("ZeRO "), fontsize=9)
            if r == len(rows) - 1:
                ax.set_xlabel("optimizer step", fontsize=8)
    fig.suptitle(f"ZeroStatsMonitor dashboard: {log_dir}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return Path(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(plot(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else Path(__file__).parent / "monitoring_dashboard.png"))
