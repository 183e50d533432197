"""Screenshots of the TensorBoard dashboard of a ZeRO-stage sweep, for docs/monitoring.md:

    python docs/screenshots.py                   # sweep into runs/sweep, PNGs into docs/
    python docs/screenshots.py --reuse runs/sweep  # screenshots of an existing sweep only

1. runs ``lightning-zero train -m experiment=gpt_tiny zero=stage0,stage1,stage2,stage3`` (4 short runs,
   2 CPU ranks each) into ``runs/sweep``;
2. starts ``tensorboard --logdir runs/sweep`` bound to 127.0.0.1 only, on a free port;
3. opens the landing view (Time Series), the Custom Scalars tab and the HParams tab in headless
   Chromium (``apt-get install -y chromium``) and writes ``docs/dashboard_{landing,custom_scalars,hparams}.png``.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# view -> (URL fragment, window height)
VIEWS = {"landing": ("#timeseries", 900), "custom_scalars": ("#custom_scalars", 2300), "hparams": ("#hparams", 700)}


def sweep(out: Path) -> None:
    """The 4-stage sweep of ``experiment=gpt_tiny`` into ``out`` (one numbered directory per stage)."""
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "lightning_zero", "train", "-m", "experiment=gpt_tiny",
                    "zero=stage0,stage1,stage2,stage3", f"hydra.sweep.dir={out}"], check=True, cwd=ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no Chromium found: apt-get update && apt-get install -y chromium")


def screenshots(logdir: Path, docs: Path, width: int = 1400) -> list[Path]:
    """Serve ``logdir`` with TensorBoard on 127.0.0.1 and take one PNG per view of :data:`VIEWS`."""
    port = _free_port()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                              "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "data/runs", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        time.sleep(5)  # the first load of the event files
        out = []
        for name, (fragment, height) in VIEWS.items():
            png = docs / f"dashboard_{name}.png"
            subprocess.run([_chromium(), "--headless", "--no-sandbox", "--use-angle=swiftshader",
                            "--enable-unsafe-swiftshader", "--hide-scrollbars",
                            f"--window-size={width},{height}", "--virtual-time-budget=90000",
                            f"--screenshot={png}", url + fragment], check=True, capture_output=True, timeout=120)
            out.append(png)
        return out
    finally:
        board.terminate()
        board.wait(timeout=30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", type=Path, help="an existing sweep directory (skip the runs)")
    args = parser.parse_args()
    logdir = args.reuse or ROOT / "runs" / "sweep"
    if args.reuse is None:
        sweep(logdir)
    for png in screenshots(logdir, ROOT / "docs"):
        print(f"wrote {png.relative_to(ROOT)}")
