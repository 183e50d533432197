"""Soak: consecutive short 2-rank launches through ``lightning-zero train`` (one Hydra multirun, each job
its own torchrun launch of 2 ranks: tiny MLP, 1 step, no logger, no checkpoint, no validation) end with
zero abnormal exits: no rank aborts at interpreter exit (Note [clean exit] in
lightning_zero/core/comm/process_groups.py), no failed job.

The suite runs 8 launches (about 2 minutes of its time budget); the soak of record is 50, run on its own with
``LZ_SOAK_LAUNCHES=50 .venv/bin/python -m pytest tests/e2e/test_soak.py`` (docs/reliability.md has the
measurement)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

LAUNCHES = int(os.environ.get("LZ_SOAK_LAUNCHES", "8"))
TINY = ["experiment=mlp", "trainer.max_epochs=null", "trainer.max_steps=1", "logger=none", "logger.monitor=false",
        "trainer.checkpoint.enabled=false", "trainer.validate_at_start=false", "trainer.validate_at_end=false",
        "trainer.enable_model_summary=false", "trainer.limit_val_batches=0", "data.num_train=128", "data.num_val=8",
        "model.hidden_dim=8"]


@pytest.mark.slow
@pytest.mark.timeout(120 + 30 * LAUNCHES)  # ~7 s per launch idle (torchrun + 2 ranks), 28 s under CI's load
def test_consecutive_cli_launches_exit_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lightning_zero", "train", "-m", f"seed=range(0,{LAUNCHES})", *TINY],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100 + 30 * LAUNCHES,
                          check=False)
    seconds = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    for sign in ("terminate called", "Signal 6", "SIGABRT", "exitcode  : -", "ChildFailedError", "core dumped"):
        assert sign not in out, f"{sign!r} in the output:\n{out[-5000:]}"
    results = sorted(tmp_path.glob("multirun/*/*/*/result.json"))
    assert len(results) == LAUNCHES, (len(results), out[-3000:])
    print(f"{LAUNCHES} launches in {seconds:.0f} s ({seconds / LAUNCHES:.1f} s per launch)")
