"""Sharded-checkpoint durability and collectives (issue 15 defect 6), and the fp16 loss scaler in a
sharded checkpoint: the temporary directory is fsynced before its rename, the temporary name goes
over the strategy's own group (never Lightning's pickling broadcast), and a user's plain directory
named like the checkpoint is refused, not deleted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError
from lightning_zero.checkpoint import publish as ckpt_publish
from lightning_zero.core.settings.precision import LossScalerConfig
from lightning_zero.lightning.precision import ZeroPrecision
from tests.models import TinyTransformer, make_trainer, token_loader


def test_a_plain_directory_at_the_name_is_refused_and_kept(tmp_path: Path) -> None:
    user = tmp_path / "last.ckpt"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"is not a sharded checkpoint written by lightning_zero.*refused"):
        ckpt_publish.save_sharded(user, {}, None, 0, 1, broadcast=lambda name: name,
                                 failed_ranks=lambda flag: [0] if flag else [])
    tmp = tmp_path / "x.tmp-1"
    tmp.mkdir()
    with pytest.raises(CheckpointError, match="refused to replace it"):
        ckpt_publish.publish(tmp, user)
    assert (user / "notes.txt").read_text() == "mine" and not user.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing published (the temporary removed)


def test_the_temporary_directory_is_fsynced_before_its_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    fsync_dir, replace = ckpt_publish._fsync_dir, os.replace
    monkeypatch.setattr(ckpt_publish, "_fsync_dir", lambda p: (events.append(("fsync", str(p))), fsync_dir(p)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), replace(a, b)))
    tmp = tmp_path / "ck.tmp-1"
    tmp.mkdir()
    (tmp / "rank0.safetensors").write_bytes(b"x")
    target = ckpt_publish.publish(tmp, tmp_path / "ck")
    assert events.index(("fsync", str(tmp))) < events.index(("replace", str(tmp)))
    assert (tmp_path / "ck").is_symlink() and target.name == "ck.v1" and (target / "rank0.safetensors").exists()


def _growing_fp16() -> ZeroPrecision:
    return ZeroPrecision("16-mixed", loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=2))


def scaler_body(root: str) -> dict[str, Any]:
    """fp16 at stage 2 for 4 steps, saved sharded with Lightning's broadcast disabled; a new run
    resumes from it: the loss scaler's state comes back exactly."""
    import lightning.pytorch as pl

    strategy = ZeroStrategy(stage=2, precision=_growing_fp16())
    trainer = make_trainer(strategy, max_steps=4)
    trainer.fit(TinyTransformer("adamw"), token_loader(n=32))
    saved = strategy.precision_plugin.scaler.state_dict()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the sharded save used Lightning's pickling broadcast on the default group")

    original = ZeroStrategy.broadcast
    ZeroStrategy.broadcast = refuse  # type: ignore[method-assign]
    try:
        path = os.path.join(root, "fp16.ckpt")
        trainer.save_checkpoint(path)
    finally:
        ZeroStrategy.broadcast = original  # type: ignore[method-assign]

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.state = trainer.strategy.precision_plugin.scaler.state_dict()

    probe, resumed = Probe(), ZeroStrategy(stage=2, precision=_growing_fp16())
    make_trainer(resumed, max_steps=6, callbacks=[probe]).fit(TinyTransformer("adamw"), token_loader(n=32),
                                                             ckpt_path=path)
    return {"saved": saved, "restored": probe.state, "symlink": os.path.islink(path),
            "after": resumed.precision_plugin.scaler.state_dict()}


@pytest.mark.distributed
def test_fp16_loss_scaler_round_trips_a_sharded_checkpoint_saved_on_the_strategy_group(gloo_pool, tmp_path) -> None:
    for r in gloo_pool.run("tests.distributed.test_checkpoint_durability:scaler_body", root=str(tmp_path)):
        assert r["symlink"]  # the sharded format
        # 4 clean steps, window 2: the scale grew once, at step 2 (stable = 2)
        assert r["saved"]["scale"] == 512.0 and r["saved"]["iteration"] == 4
        assert r["restored"] == r["saved"]
        assert r["after"]["iteration"] == 6 and r["after"]["scale"] == 1024.0  # grew again at step 4
