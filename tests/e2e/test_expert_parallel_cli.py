"""``lightning-zero train experiment=gpt_tiny model.moe.num_experts=8 expert_parallel=ep2 trainer.devices=2`` (issue
44): the same step-0 validation loss as the same model on one rank (``trainer=cpu1``), and at the end within 1e-5 of
2-rank data parallelism without expert parallelism (the same batches, every rank computing every expert)."""

from __future__ import annotations

import json

import pytest

from tests.launches import SharedLaunches

MOE = ["experiment=gpt_tiny", "model.moe.num_experts=8", "trainer.max_steps=6", "trainer.val_check_interval=null",
       "trainer.checkpoint.enabled=false", "trainer.enable_model_summary=false", "logger=none"]


def _result(launches: SharedLaunches, *args: str) -> dict[str, float]:
    """The command's ``result.json``; a 2-rank run's ranks in the session's pool (Note [shared launches])."""
    done = launches.pool_cli("train", *MOE, *args).check()
    return json.loads((done.run_dir / "result.json").read_text())


@pytest.mark.slow
def test_ep2_starts_like_one_rank_and_ends_like_data_parallel(launches: SharedLaunches) -> None:
    ep2 = _result(launches, "expert_parallel=ep2", "trainer.devices=2")
    one = _result(launches, "trainer=cpu1", "trainer.max_steps=1", "trainer.validate_at_end=false")
    dp2 = _result(launches, "trainer.devices=2")
    assert ep2["global_step"] == dp2["global_step"] == 6
    assert (ep2["layout"]["expert"], ep2["layout"]["expert_split_layers"], dp2["layout"]["expert"]) == (2, 2, 1)
    assert ep2["val_loss_start"] == pytest.approx(one["val_loss_start"], rel=1e-6)
    assert ep2["val_loss_end"] == pytest.approx(dp2["val_loss_end"], rel=1e-5)
    assert ep2["val_loss_end"] < ep2["val_loss_start"] - 0.05  # it trained
