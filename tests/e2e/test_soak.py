"""Soak: consecutive short 2-rank launches through ``lightning-zero train`` (one Hydra multirun, each job
its own torchrun launch of 2 ranks: tiny MLP, 1 step, no logger, no checkpoint, no validation) end with
zero abnormal exits: no rank aborts at interpreter exit (Note [clean exit] in
lightning_zero/core/comm/process_groups.py), no failed job.

A long check: ``pytest -q`` skips it; the soak of record (50 launches, ~15 minutes on 2 cores) runs on its own with
``.venv/bin/python -m pytest --long tests/e2e/test_soak.py`` (docs/reliability.md has the measurement; docs/design.md
"Tests" lists the long checks). In the suite, every real 2-rank launch of tests/e2e/test_cli.py is checked for the
same signs of an abnormal exit (:func:`tests.launches.assert_clean_exit`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launches import assert_clean_exit

LAUNCHES = int(os.environ.get("LZ_SOAK_LAUNCHES", "50"))
TINY = ["experiment=mlp", "trainer.max_epochs=null", "trainer.max_steps=1", "logger=none", "logger.monitor=false",
        "trainer.checkpoint.enabled=false", "trainer.validate_at_start=false", "trainer.validate_at_end=false",
        "trainer.enable_model_summary=false", "trainer.limit_val_batches=0", "data.num_train=128", "data.num_val=8",
        "model.hidden_dim=8"]


@pytest.mark.long
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
    assert_clean_exit(out)
    results = sorted(tmp_path.glob("multirun/*/*/*/result.json"))
    assert len(results) == LAUNCHES, (len(results), out[-3000:])
    print(f"{LAUNCHES} launches in {seconds:.0f} s ({seconds / LAUNCHES:.1f} s per launch)")
