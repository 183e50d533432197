"""``lightning-zero train trainer.resume_from=...`` continues exactly: a run resumed from its step-3
checkpoint logs the same training losses at steps 4-6 as the uninterrupted run (the CLI's training
loader resumes mid-epoch, Note [resumable loader] in models/data.py), without Lightning's "not
resumable" warning, and its lines say the true steps: the start validation at the checkpoint's step,
the summary the steps of this run. Both runs are the CLI's with its ranks in the session's pool (Note [shared
launches] in tests/launches.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.launches import SharedLaunches

RUN = ["experiment=gpt_tiny", "trainer.max_steps=6", "trainer.val_check_interval=null", "logger=csv",
       "trainer.log_every_n_steps=1", "data.max_bytes=200000", "trainer.checkpoint.every_n_train_steps=3",
       "trainer.checkpoint.save_top_k=-1", "trainer.enable_model_summary=false"]


def _losses(run: Path) -> dict[int, float]:
    with open(run / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


@pytest.mark.slow
def test_a_resumed_cli_run_equals_the_uninterrupted_one(launches: SharedLaunches) -> None:
    first = launches.pool_cli("train", *RUN).check()
    checkpoint = first.run_dir / "checkpoints" / "epoch=0-step=3.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    second = launches.pool_cli("train", *RUN, f"trainer.resume_from='{checkpoint}'").check()
    out = second.output
    full, resumed = _losses(first.run_dir), _losses(second.run_dir)
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [4, 5, 6]
    assert resumed == {step: full[step] for step in (4, 5, 6)}  # the same batches, the same updates
    assert "not resumable" not in out
    validations = [line for line in out.splitlines() if "val_loss" in line and line.startswith("step ")]
    assert validations[0].startswith("step 3  val_loss"), validations  # the checkpoint's step, not 0
    result = json.loads((second.run_dir / "result.json").read_text())
    assert result["global_step"] == 6 and result["resumed_at"] == 3
    assert "steps=6 (3 in this run, resumed at step 3)" in out
