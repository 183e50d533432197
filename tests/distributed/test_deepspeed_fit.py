"""DeepSpeed JSON configs inside ``Trainer.fit`` on 2 CPU processes: the seed configs as they are, the JSON's
batch / clipping / optimizer / scheduler settings driving the run exactly like the same settings given by
hand, and precedence conflicts raising on every rank.

``test_seed_fp16_config_trains_on_two_cpu_processes`` and ``test_seed_bf16_config_trains_on_two_cpu_processes``
need the 16-bit precision plugins (issue 6): until they are merged, they fail with NotImplementedError.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.deepspeed import WarmupDecayLR, parse_deepspeed_config
from lightning_zero.deepspeed.strategy import DeepSpeedReport, DeepSpeedZeroStrategy
from tests.models import TinyTransformer, make_trainer, params_of, token_loader
from tests.unit.test_deepspeed_config import SEED_BF16, SEED_FP16


class _Probe(TinyTransformer):
    """Records the parameters' dtype inside training_step and the LR of every optimizer step."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__(optimizer)
        self.dtypes: set[str] = set()
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.dtypes.add(str(self.head.weight.dtype))
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


# ---------------------------------------------------------------------------- the seed configs, as they are
def seed_body(which: str) -> dict[str, Any]:
    """The seed config's run, and the same settings by hand (lightning_zero's default stage, the mode,
    accumulation 4 of micro-batches 8, the module's own optimizer)."""
    config = {"fp16": SEED_FP16, "bf16": SEED_BF16}[which]
    out: dict[str, Any] = {}
    for run in ("json", "hand"):
        model = _Probe()
        before = params_of(model)
        if run == "json":
            trainer = make_trainer(DeepSpeedZeroStrategy.from_deepspeed_config(config), max_steps=6)
        else:
            strategy = ZeroStrategy(stage=ZeroConfig().stage, precision="16-mixed" if which == "fp16" else "bf16-mixed")
            trainer = make_trainer(strategy, max_steps=6, accumulate_grad_batches=4)
        trainer.fit(model, token_loader(n=2 * 8 * 4 * 6, batch_size=8))  # micro-batch 64 / (4 x 2) = 8
        after = [p.detach().float() for p in model.parameters()]
        out[run] = {"accumulate": trainer.accumulate_grad_batches,
                    "precision": trainer.strategy.precision_plugin.precision, "dtypes": sorted(model.dtypes),
                    "losses": model.losses, "micro_steps": len(model.losses), "params": after,
                    "skipped": trainer.strategy.skipped_steps, "loss_scale": trainer.strategy.loss_scale,
                    "moved": max((a - b.float()).abs().max().item() for a, b in zip(after, before)),
                    "checksum": sum(float(p.double().sum()) for p in after)}
    return out


def _check_seed_run(gloo_pool: Any, which: str, dtype: str, precision: str) -> None:
    config = {"fp16": SEED_FP16, "bf16": SEED_BF16}[which]
    DeepSpeedZeroStrategy.from_deepspeed_config(config)  # builds in this process too (before any rank starts)
    results = gloo_pool.run("tests.distributed.test_deepspeed_fit:seed_body", which=which)
    for both in results:
        r, hand = both["json"], both["hand"]
        assert r["accumulate"] == 4 and r["precision"] == precision
        assert r["dtypes"] == [dtype], r["dtypes"]  # the module really computes in 16 bits, on CPU too
        assert r["micro_steps"] == 24 and r["moved"] > 1e-3  # 6 optimizer steps of 4 micro-batches that trained
        # the JSON's run is the run of the same settings by hand: the same losses, loss scale and weights
        assert r["losses"] == hand["losses"], (r["losses"], hand["losses"])
        assert (r["skipped"], r["loss_scale"]) == (hand["skipped"], hand["loss_scale"])
        assert all(torch.equal(a, b) for a, b in zip(r["params"], hand["params"]))
        assert r["skipped"] < 6  # some steps were taken (fp16: the dynamic scale backs off from 2**16)
    assert results[0]["json"]["checksum"] == results[1]["json"]["checksum"]  # every rank holds the same parameters


@pytest.mark.distributed
def test_seed_fp16_config_trains_on_two_cpu_processes(gloo_pool) -> None:
    _check_seed_run(gloo_pool, "fp16", "torch.float16", "16-mixed")


@pytest.mark.distributed
def test_seed_bf16_config_trains_on_two_cpu_processes(gloo_pool) -> None:
    _check_seed_run(gloo_pool, "bf16", "torch.bfloat16", "bf16-mixed")


# ---------------------------------------------------------------------------- the JSON drives the run
FP32 = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 500},
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 3,
                                                          "warmup_type": "linear"}},
        "steps_per_print": 2}


class _DefersToConfig(_Probe):
    def configure_optimizers(self) -> None:
        return None


class _ByHand(_Probe):
    """The same optimizer and schedule, written by hand."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01, betas=(0.9, 0.95),
                                weight_decay=0.1)
        sched = WarmupDecayLR(opt, total_num_steps=6, warmup_max_lr=0.01, warmup_num_steps=3, warmup_type="linear")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Bare(pl.LightningModule):
    """No configure_optimizers at all: the JSON's optimizer is used."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyTransformer()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net.training_step(batch, batch_idx)


def settings_body() -> dict[str, Any]:
    runs: dict[str, Any] = {}
    model = _DefersToConfig()
    trainer = make_trainer(DeepSpeedZeroStrategy.from_deepspeed_config(FP32), max_steps=6)
    trainer.fit(model, token_loader(n=2 * 4 * 2 * 6, batch_size=4))
    runs["json"] = {"losses": model.losses, "lrs": model.lrs, "accumulate": trainer.accumulate_grad_batches,
                    "clip": trainer.gradient_clip_val, "optimizer": type(trainer.optimizers[0]).__name__,
                    "scheduler": type(trainer.lr_scheduler_configs[0].scheduler).__name__,
                    "report": any(isinstance(c, DeepSpeedReport) for c in trainer.callbacks),
                    "params": params_of(model)}
    model = _ByHand()
    strategy = ZeroStrategy(stage=2, reduce_bucket_size=500)
    make_trainer(strategy, max_steps=6, accumulate_grad_batches=2, gradient_clip_val=0.05).fit(
        model, token_loader(n=2 * 4 * 2 * 6, batch_size=4))
    runs["hand"] = {"losses": model.losses, "lrs": model.lrs, "params": params_of(model)}
    bare = _Bare()
    make_trainer(DeepSpeedZeroStrategy.from_deepspeed_config(FP32), max_steps=2).fit(
        bare, token_loader(n=32, batch_size=4))
    runs["bare"] = {"losses": bare.net.losses, "patched_after_fit": "configure_optimizers" in bare.__dict__}
    return runs


@pytest.mark.distributed
def test_json_settings_drive_the_run_like_the_same_settings_by_hand(gloo_pool) -> None:
    for r in gloo_pool.run("tests.distributed.test_deepspeed_fit:settings_body"):
        json_run, hand = r["json"], r["hand"]
        assert json_run["accumulate"] == 2 and json_run["clip"] == 0.05  # 16 / (4 x 2 ranks); gradient_clipping
        assert (json_run["optimizer"], json_run["scheduler"]) == ("AdamW", "WarmupDecayLR") and json_run["report"]
        # optimizer step k runs with DeepSpeed's LR at t = k - 1: linear warmup over 3, decay to 0 at 6
        assert json_run["lrs"] == pytest.approx([0.0, 0.0, 0.01 / 3, 0.02 / 3, 0.01, 0.01 * 2 / 3])
        assert json_run["losses"] == hand["losses"] and json_run["lrs"] == hand["lrs"]
        assert all(torch.equal(a, b) for a, b in zip(json_run["params"], hand["params"]))
        assert len(r["bare"]["losses"]) == 4 and not r["bare"]["patched_after_fit"]


# ---------------------------------------------------------------------------- precedence conflicts
class _ReturnsSGD(_Probe):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ReturnsScheduler(_Probe):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)}


class _ReturnsTheSameAdamW(_Probe):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)


CONFLICTS: dict[str, tuple[dict, type, dict, int, str | None]] = {
    # kind: (JSON changes, module, Trainer kwargs, DataLoader batch size, expected message or None)
    "accumulate": ({}, _DefersToConfig, {"accumulate_grad_batches": 3}, 4,
                   r"gives gradient_accumulation_steps=2 \(train_batch_size=16 = .*x 2 data-parallel rank\(s\)\), "
                   r"but Trainer\(accumulate_grad_batches=3\)"),
    "clip": ({}, _DefersToConfig, {"gradient_clip_val": 1.0}, 4,
             r"sets gradient_clipping=0.05, but Trainer\(gradient_clip_val\)=1.0"),
    "clip_by_value": ({}, _DefersToConfig, {"gradient_clip_algorithm": "value"}, 4, "clips by global norm"),
    "loader": ({}, _DefersToConfig, {}, 3, r"DataLoader's batch_size=3, but .* train_micro_batch_size_per_gpu=4.*"
                                          r"Fix: DataLoader\(batch_size=4\)"),
    "optimizer": ({}, _ReturnsSGD, {}, 4, r"sets optimizer AdamW\(betas=\(0.9, 0.95\), lr=0.01, weight_decay=0.1\), "
                                          r"but configure_optimizers returned SGD \(class SGD vs AdamW\)"),
    "scheduler": ({"optimizer": None}, _ReturnsScheduler, {}, 4, "define an LR scheduler. Set it in one place"),
    "batch_triple": ({"gradient_accumulation_steps": 4}, _DefersToConfig, {}, 4,
                     r"train_batch_size=16 does not equal .* = 32\. Fix: train_batch_size=32"),
    "no_optimizer": ({"optimizer": None}, _DefersToConfig, {}, 4, "nothing to train with"),
    "equal_values": ({}, _ReturnsTheSameAdamW, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, 4, None),
}


def conflict_body(kind: str) -> dict[str, Any]:
    changes, module, trainer_kwargs, batch_size, _ = CONFLICTS[kind]
    config = {k: v for k, v in {**FP32, **changes}.items() if v is not None}
    try:
        trainer = make_trainer(DeepSpeedZeroStrategy.from_deepspeed_config(config), max_steps=2, **trainer_kwargs)
        trainer.fit(module(), token_loader(n=32, batch_size=batch_size))
    except Exception as exc:  # the test inspects what every rank raised
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": "", "scheduler": type(trainer.lr_scheduler_configs[0].scheduler).__name__}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", list(CONFLICTS))
def test_precedence_conflicts_raise_on_every_rank(gloo_pool, kind: str) -> None:
    expected = CONFLICTS[kind][-1]
    for rank, r in enumerate(gloo_pool.run("tests.distributed.test_deepspeed_fit:conflict_body", kind=kind)):
        if expected is None:
            assert r["type"] is None, r
            assert r["scheduler"] == "WarmupDecayLR"  # the JSON's scheduler joins the module's (equal) optimizer
            continue
        assert r["type"] == "ValueError", (rank, r)
        assert re.search(expected, r["message"]), (rank, r["message"])


def test_trainer_precision_conflicting_with_the_json_raises() -> None:
    ds = parse_deepspeed_config({"bf16": {"enabled": True}})
    strategy = DeepSpeedZeroStrategy(deepspeed_config=ds)  # the plugin itself needs issue 6: not built here
    strategy.connect(TinyTransformer())
    trainer = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None,
                              callbacks=[])
    strategy._apply_to_trainer(trainer)  # the Trainer's default precision: no conflict
    strategy._trainer_precision = "16-mixed"
    with pytest.raises(ValueError, match=r"sets bf16.enabled=true \(precision='bf16-mixed'\), but "
                                         r"Trainer\(precision\)='16-mixed'.*leave the Trainer's precision unset"):
        strategy._apply_to_trainer(trainer)
