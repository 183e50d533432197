"""The stage-3 speed items of issue 21 on 2 gloo ranks: the gather agreement all-reduce runs only while the
unit order is recorded, released gather memory is reused, and neither changes a single bit of training
(against the behaviour before: every gather checked, every gather's memory allocated afresh)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_zero import ZeroStrategy
from lightning_zero.core.stage3.runtime import Agreement
from tests.models import StackedLM, make_trainer, params_of, token_loader


class _Counts(pl.Callback):
    """Per optimizer step: agreement all-reduces so far and gathers served from the pool so far; with
    ``before``, the runtime is switched to the behaviour before issue 21 at the start of training."""

    def __init__(self, before: bool) -> None:
        self.before, self.agreements, self.reused, self.gathers = before, [], [], []

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        runtime = trainer.strategy.engine.runtime
        if self.before:
            runtime.agreement = Agreement.ALWAYS
            for unit in runtime.units:
                unit.pool = None

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        runtime = trainer.strategy.engine.runtime
        self.agreements.append(runtime.agreements)
        self.reused.append(runtime.pool.reused)
        self.gathers.append(sum(u.gathers for u in runtime.units))


def speed_items_body() -> dict[str, Any]:
    out = {}
    for name in ("before", "after"):
        model, counts = StackedLM("adamw"), _Counts(before=name == "before")
        strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, reduce_bucket_size=100)
        make_trainer(strategy, max_steps=4, callbacks=[counts]).fit(model, token_loader())
        out[name] = {"losses": model.losses, "params": params_of(model), "agreements": counts.agreements,
                     "reused": counts.reused, "gathers": counts.gathers}
    return out


@pytest.mark.distributed
def test_agreement_only_while_recording_and_pooled_memory_change_no_bit(gloo_pool) -> None:
    for r in gloo_pool.run("tests.distributed.test_stage3_speed:speed_items_body"):
        before, after = r["before"], r["after"]
        assert after["losses"] == before["losses"]  # bitwise
        assert all((a == b).all() for a, b in zip(after["params"], before["params"]))
        per_step = [b - a for a, b in zip(before["gathers"], before["gathers"][1:])]
        # before: one agreement per gather, every step; after: only in the first step (the recording)
        assert [b - a for a, b in zip(before["agreements"], before["agreements"][1:])] == per_step
        assert after["agreements"][0] > 0 and len(set(after["agreements"])) == 1, after["agreements"]
        # the pool serves later gathers; switched off, nothing is reused
        assert set(before["reused"]) == {0} and after["reused"][-1] > after["reused"][0] > 0, after["reused"]
