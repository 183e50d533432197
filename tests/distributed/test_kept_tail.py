"""Stage 3 keeps the last units of forward gathered into backward (Note [kept tail] in
core/stage3/runtime.py): fewer gathers, the same losses bitwise, the gathered peak within
``max_live_parameters``, the kept tail within ``max_reuse_distance``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_zero import ZeroStrategy
from tests.models import StackedLM, make_trainer, token_loader

BLOCK_NUMEL = 688  # one block's flat groups, padded to the world size (687 -> 688)


def kept_body(keep: bool) -> dict[str, Any]:
    probe: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            engine = trainer.strategy.engine
            probe.update(gathers={u.name: u.gathers for u in engine.units},
                         live=trainer.strategy.gathered_peak_numel)

    model = StackedLM("adamw", num_blocks=4)
    root = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.blocks.parameters())
    max_live = root + 1 + 2 * BLOCK_NUMEL + 1  # the root (padded) and two blocks, not three
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, max_live_parameters=max_live,
                            prefetch_bucket_size=10_000_000 if keep else 1)
    make_trainer(strategy, max_steps=4, callbacks=[Probe()]).fit(model, token_loader())
    return {"losses": model.losses, "max_live": max_live, **probe}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_last_units_stay_gathered_into_backward_within_max_live_parameters(gloo_pool) -> None:
    kept = gloo_pool.run("tests.distributed.test_kept_tail:kept_body", keep=True)
    plain = gloo_pool.run("tests.distributed.test_kept_tail:kept_body", keep=False)
    for k, p in zip(kept, plain):
        assert k["losses"] == p["losses"]  # gathering less changes no value
        steps = 4
        # without keeping: every block twice a step (forward, backward)
        assert all(p["gathers"][f"blocks.{i}"] == 2 * steps for i in range(4)), p["gathers"]
        # kept: the last two blocks (what max_live_parameters allows beside the root) once a step after
        # the first, whose forward recorded the order
        assert [k["gathers"][f"blocks.{i}"] for i in range(4)] == [2 * steps] * 2 + [steps + 1] * 2, k["gathers"]
        assert k["live"] <= k["max_live"], (k["live"], k["max_live"])


def reuse_body(distance: int | None) -> dict[str, Any]:
    """Four blocks, prefetch and ``max_live_parameters`` wide enough to keep all: only ``max_reuse_distance``
    (``None``: its default) bounds the kept tail."""
    gathers: dict[str, int] = {}

    class Probe(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            gathers.update({u.name: u.gathers for u in trainer.strategy.engine.units})

    model = StackedLM("adamw", num_blocks=4)
    kwargs = {} if distance is None else {"max_reuse_distance": distance}
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, prefetch_bucket_size=10_000_000, **kwargs)
    make_trainer(strategy, max_steps=4, callbacks=[Probe()]).fit(model, token_loader())
    return {"losses": model.losses, "gathers": [gathers[f"blocks.{i}"] for i in range(4)]}


@pytest.mark.distributed
@pytest.mark.slow
def test_max_reuse_distance_bounds_the_kept_tail(gloo_pool) -> None:
    steps = 4
    runs = {d: gloo_pool.run("tests.distributed.test_kept_tail:reuse_body", distance=d)
            for d in (0, BLOCK_NUMEL, None)}
    for none, one, default in zip(runs[0], runs[BLOCK_NUMEL], runs[None]):
        assert none["losses"] == one["losses"] == default["losses"]  # gathering less changes no value
        assert none["gathers"] == [2 * steps] * 4, none["gathers"]  # 0: every block gathered again in backward
        # one block's elements: the last block only, once a step after the first (which recorded the order)
        assert one["gathers"] == [2 * steps] * 3 + [steps + 1], one["gathers"]
        # the default (1e9) leaves the tail to the prefetch settings: every block kept, as before the setting
        assert default["gathers"] == [steps + 1] * 4, default["gathers"]


def forward_after_backward_body(extra_forward: bool) -> dict[str, Any]:
    """Manual optimization with a forward under grad after the backward and before the step (e.g. a metric):
    that forward keeps the tail units gathered, and the step must not leave them holding the old weights."""

    class ManualLM(StackedLM):
        def __init__(self) -> None:
            super().__init__("adamw", num_blocks=4)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            loss = self._loss(batch)
            self.losses.append(loss.item())
            self.manual_backward(loss)
            if extra_forward:
                self._loss(batch)  # grad enabled, never backpropagated
            opt.step()
            opt.zero_grad()

    model = ManualLM()
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, prefetch_bucket_size=10_000_000)
    make_trainer(strategy, max_steps=4).fit(model, token_loader())
    return {"losses": model.losses}


@pytest.mark.distributed
def test_a_forward_between_backward_and_step_leaves_no_unit_with_old_weights(gloo_pool) -> None:
    plain = gloo_pool.run("tests.distributed.test_kept_tail:forward_after_backward_body", extra_forward=False)
    extra = gloo_pool.run("tests.distributed.test_kept_tail:forward_after_backward_body", extra_forward=True)
    for p, e in zip(plain, extra):
        assert len(p["losses"]) == 4 and e["losses"] == p["losses"]
