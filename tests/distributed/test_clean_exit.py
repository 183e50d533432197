"""Clean exits (Note [clean exit] in lightning_zero/core/comm/process_groups.py): a strategy keeps one
process mesh (and its data-parallel group) over several fits, and closing what was registered really
ends the group's gloo threads (so nothing of it is left to be destroyed during interpreter
finalization, where it could abort the process)."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from lightning_zero.core.comm.process_groups import _owned
from tests.models import TinyTransformer, make_trainer, token_loader


def _threads() -> int:
    gc.collect()
    time.sleep(0.2)
    return len(os.listdir("/proc/self/task"))


def group_threads_body() -> dict[str, Any]:
    base = _threads()
    probe = dist.new_group(timeout=timedelta(seconds=60))
    per_group = _threads() - base  # the threads one gloo group owns
    dist.destroy_process_group(probe)
    del probe
    after_probe = _threads() - base
    strategy = ZeroStrategy(stage=2, hang_timeout_s=0)
    model, trainer = TinyTransformer("adamw"), make_trainer(strategy, max_steps=1)
    trainer.fit(model, token_loader())  # two setups (fit, fit again), one group
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(model, token_loader())
    after_fits = _threads() - base
    registered = strategy._run.comm in _owned and strategy._run.mesh in _owned
    for holder in (strategy._run.comm, strategy._run.mesh):  # what close_all closes at exit
        holder.close()
    after_close = _threads() - base
    return {"per_group": per_group, "after_probe": after_probe, "after_fits": after_fits,
            "after_close": after_close, "registered": registered}


@pytest.mark.distributed
@pytest.mark.slow
def test_one_group_per_strategy_and_closing_it_ends_its_threads(gloo_pool) -> None:
    for r in gloo_pool.run("tests.distributed.test_clean_exit:group_threads_body"):
        assert r["per_group"] >= 1 and r["after_probe"] == 0, r
        assert r["registered"] and r["after_fits"] == r["per_group"], r  # not one group per setup
        assert r["after_close"] == 0, r  # the group's threads are gone before any interpreter exit
