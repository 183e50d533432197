"""``lightning-zero train experiment=gpt_tiny model.moe.num_experts=8 expert_parallel=ep2 trainer.devices=2`` (issue
44): the same step-0 validation loss as the same model on one rank (``trainer=cpu1``), and at the end within 1e-5 of
2-rank data parallelism without expert parallelism (the same batches, every rank computing every expert)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MOE = ["experiment=gpt_tiny", "model.moe.num_experts=8", "trainer.max_steps=6", "trainer.val_check_interval=null",
       "trainer.checkpoint.enabled=false", "trainer.enable_model_summary=false", "logger=none"]


def _result(args: list[str], cwd: Path, name: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "lightning_zero", "train", *MOE, *args, f"hydra.run.dir={name}"],
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads((cwd / name / "result.json").read_text())


@pytest.mark.slow
def test_ep2_starts_like_one_rank_and_ends_like_data_parallel(tmp_path: Path) -> None:
    ep2 = _result(["expert_parallel=ep2", "trainer.devices=2"], tmp_path, "ep2")
    one = _result(["trainer=cpu1", "trainer.max_steps=1", "trainer.validate_at_end=false"], tmp_path, "one")
    dp2 = _result(["trainer.devices=2"], tmp_path, "dp2")
    assert ep2["global_step"] == dp2["global_step"] == 6
    assert (ep2["layout"]["expert"], ep2["layout"]["expert_split_layers"], dp2["layout"]["expert"]) == (2, 2, 1)
    assert ep2["val_loss_start"] == pytest.approx(one["val_loss_start"], rel=1e-6)
    assert ep2["val_loss_end"] == pytest.approx(dp2["val_loss_end"], rel=1e-5)
    assert ep2["val_loss_end"] < ep2["val_loss_start"] - 0.05  # it trained
