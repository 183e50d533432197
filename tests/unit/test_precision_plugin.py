"""ZeroPrecision in one process: choosing a mode, bad input, logging, manual optimization, module dtype
after fit / validate, and no collective at world size 1."""

from __future__ import annotations

import csv
from typing import Any

import pytest
import torch

from lightning_zero import LossScalerConfig, ZeroPrecision, ZeroStatsMonitor, ZeroStrategy
from tests.distributed.test_precision import NO_NATURAL_OVERFLOW, Model, pattern_loader
from tests.models import ManualOptimization, TinyTransformer, make_trainer, token_loader


# ---------------------------------------------------------------------------- choosing a mode
@pytest.mark.parametrize(("trainer_precision", "expected"), [
    ("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"),
    ("16-mixed", "bf16-mixed"),  # Lightning rewrites fp16 AMP to bf16 on CPU before the strategy sees it
])
def test_trainer_precision_maps_onto_zero_precision(trainer_precision: str, expected: str) -> None:
    trainer = make_trainer(ZeroStrategy(stage=1), devices=1, precision=trainer_precision)
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert trainer.precision_plugin.precision == expected


def test_the_strategys_precision_keeps_fp16_on_cpu_and_wins() -> None:
    for strategy in (ZeroStrategy(precision="16-mixed"), ZeroStrategy(precision=ZeroPrecision("16-mixed"))):
        trainer = make_trainer(strategy, devices=1, precision="bf16-mixed")
        assert trainer.precision_plugin.precision == "16-mixed"
        assert trainer.strategy.loss_scale == 2.0**16
    assert ZeroStrategy(precision="16-mixed", loss_scaler=LossScalerConfig(loss_scale=8.0)).loss_scale == 8.0


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ZeroPrecision("fp8"), r"Unknown precision 'fp8'.*'16-mixed', 'bf16-mixed'"),
    (lambda: ZeroPrecision("16-true"), r"use '16-mixed'"),
    (lambda: ZeroPrecision("bf16-mixed", loss_scaler=LossScalerConfig()), r"fp16 \('16-mixed'\) only.*Fix"),
    (lambda: ZeroPrecision("bf16-true", loss_scaler=LossScalerConfig(hysteresis=4)), r"drop `loss_scaler`"),
    (lambda: ZeroPrecision("bf16-mixed", reduce_dtype="int8"), r"`reduce_dtype` must be a floating dtype"),
    (lambda: ZeroPrecision("16-mixed", grad_accum_dtype=torch.int32), r"`grad_accum_dtype` must be a floating"),
    (lambda: ZeroStrategy(precision="bf16-mixed", loss_scaler=LossScalerConfig()), r"fp16 \('16-mixed'\) only"),
    (lambda: ZeroStrategy(loss_scaler=LossScalerConfig()), r"needs precision='16-mixed'"),
    (lambda: make_trainer(ZeroStrategy(), devices=1, precision="64-true"), r"Unknown precision '64-true'"),
])
def test_bad_precision_input_names_the_fix(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_dtype_names_are_accepted() -> None:
    plugin = ZeroPrecision("bf16-mixed", reduce_dtype="float32", grad_accum_dtype="torch.float32")
    policy = plugin.dtype_policy()
    assert (policy.param_dtype, policy.grad_dtype, policy.grad_accum_dtype, policy.master_dtype) == (
        torch.bfloat16, torch.float32, torch.float32, torch.float32)
    assert ZeroPrecision("bf16-true").dtype_policy().master_dtype == torch.bfloat16


# ---------------------------------------------------------------------------- behaviour in one process
def test_world_size_one_trains_fp16_without_collectives_and_logs_the_stats(monkeypatch, tmp_path) -> None:
    import torch.distributed as dist
    from lightning.pytorch.loggers import CSVLogger

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective was called at world size 1")

    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                 "reduce_scatter_single", "new_group"):
        monkeypatch.setattr(dist, name, forbidden)
    model = Model()
    logger = CSVLogger(str(tmp_path), name="", version="")
    trainer = make_trainer(ZeroStrategy(stage=2, precision="16-mixed"), devices=1, max_steps=6, logger=logger,
                           log_every_n_steps=1, callbacks=[ZeroStatsMonitor()])
    trainer.fit(model, pattern_loader())
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    scales = [float(r["train/loss_scale"]) for r in rows if r.get("train/loss_scale")]
    norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert len(scales) == 6 and scales[0] == 2.0**16 and len(norms) == 6
    assert trainer.strategy.skipped_steps == 0  # the loss is fp32: the default scale fits


def test_a_plain_fp16_loss_overflows_at_the_default_scale_and_backs_off() -> None:
    model = TinyTransformer("adamw")  # cross-entropy in fp16: d(loss * 2**16)/d(loss) is inf in fp16
    trainer = make_trainer(ZeroStrategy(stage=1, precision="16-mixed"), devices=1, max_steps=5)
    trainer.fit(model, token_loader())
    assert trainer.strategy.skipped_steps == 2 and trainer.strategy.loss_scale == 2.0**15  # spend, then halve
    assert len(model.losses) == 5 and all(x == x for x in model.losses)


class _ManualClip(ManualOptimization, Model):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.norms: list[float] = []

    def after_clip(self) -> None:
        self.norms.append(self.trainer.strategy.last_grad_norm)


@pytest.mark.parametrize("stage", [0, 2])
def test_clipping_sees_unscaled_gradients_in_manual_optimization(stage: int) -> None:
    runs = {}
    for mode in ("32-true", "16-mixed"):
        model = _ManualClip()
        plugin = ZeroPrecision(mode, loss_scaler=NO_NATURAL_OVERFLOW if mode == "16-mixed" else None)
        make_trainer(ZeroStrategy(stage=stage, precision=plugin), devices=1, max_steps=4).fit(model, pattern_loader())
        runs[mode] = model
    assert runs["16-mixed"].norms == pytest.approx(runs["32-true"].norms, rel=1e-2)  # not 2**8 times larger
    assert all(n > 0.05 for n in runs["16-mixed"].norms)  # clipping was active
    assert runs["16-mixed"].losses == pytest.approx(runs["32-true"].losses, rel=1e-2)


class _Validated(Model):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)  # records the compute dtype


def test_validate_runs_in_16_bits_and_leaves_the_module_as_it_was() -> None:
    model = _Validated()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(ZeroStrategy(stage=2, precision="bf16-mixed"), devices=1, limit_val_batches=2)
    trainer.validate(model, pattern_loader())
    assert model.compute_dtypes == {torch.bfloat16}
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n


def test_lbfgs_is_refused_with_a_separate_master() -> None:
    class _LBFGS(Model):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="LBFGS re-evaluates the closure"):
        make_trainer(ZeroStrategy(stage=0, precision="bf16-mixed"), devices=1, max_steps=1).fit(
            _LBFGS(), pattern_loader())
