"""What a user of Lightning's DeepSpeed strategy relies on, with ``strategy="zero_stage_3"`` and a
model built in ``configure_model`` holding a torchmetrics metric and a buffer (2 gloo ranks):
resume from ``trainer.save_checkpoint`` exactly, test / validate / predict from a checkpoint,
manual optimization, accumulation and clipping equal to DDP's, ``ModelSummary`` counts, and the
original error when ``configure_model`` fails.

Stage-3 runs shard every parameter (``param_persistence_threshold=0``) and check that units were
gathered and released, except the one run at the defaults. Comparisons with DDP start from the
same weights: ``init_by_name`` initialises each module from its name (the strategy's
``param_init_fn`` under stage 3; ``configure_model`` itself for DDP, whose modules are real).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import Accuracy

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import consolidate_checkpoint
from tests.models import RankSampler, make_trainer, rank_and_world

WIDTH = 16
NUM_PARAMS = (8 * WIDTH + WIDTH) + 2 * (WIDTH * WIDTH + WIDTH) + (WIDTH * 2 + 2)  # 722


def init_by_name(module: nn.Module, name: str) -> None:
    """Each parameter from a generator seeded by its qualified name (the same at any stage)."""
    with torch.no_grad():
        for pname, p in module.named_parameters(recurse=False):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}.{pname}".encode()))
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


class MetricNet(pl.LightningModule):
    """Built in ``configure_model``: Linear -> 2 blocks (stage 3's units) -> Linear, a buffer
    ``scale`` with values, a buffer ``seen`` counting training samples, and an ``Accuracy``."""

    def __init__(self, manual: bool = False, clip_algorithm: str = "norm") -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.clip_algorithm = clip_algorithm
        self.net: nn.ModuleDict | None = None
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = nn.ModuleDict({
            "inp": nn.Linear(8, WIDTH),
            "blocks": nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2)),
            "out": nn.Linear(WIDTH, 2),
        })
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.acc = Accuracy(task="multiclass", num_classes=2)
        for name, module in self.named_modules():  # no-op on meta parameters (stage 3)
            init_by_name(module, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        h = self.net["inp"](x) * self.scale
        for block in self.net["blocks"]:
            h = torch.tanh(block(h))
        return self.net["out"](h)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits, y), logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, logits = self._loss(batch)
        self.acc(logits, batch[1])
        self.seen += len(batch[0])
        self.losses.append(loss.item())
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            self.lr_schedulers().step()
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.acc(logits, batch[1])
        self.log_dict({"val_loss": loss, "val_acc": self.acc}, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.acc(logits, batch[1])
        self.log_dict({"test_loss": loss, "test_acc": self.acc}, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    """``n`` samples split over the ranks (``n / 2 / batch_size`` batches per rank and epoch)."""
    rank, world = rank_and_world()
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(3))
    y = (x[:, 0] + x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, sampler=RankSampler(n, rank, world))


def zero3(**kw: Any) -> ZeroStrategy:
    return ZeroStrategy(stage=3, param_persistence_threshold=0, param_init_fn=init_by_name, **kw)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Units(pl.Callback):
    """Records the stage-3 units' (name, gathers, releases) at the end of every run."""

    def __init__(self) -> None:
        self.units: list[tuple[str, int, int]] = []
        self.start: dict[str, Any] = {}
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        norm = getattr(trainer.strategy, "last_grad_norm", None)  # measured by clipping by norm
        if norm is not None and (i + 1) % trainer.accumulate_grad_batches == 0:
            self.grad_norms.append(norm)

    def _record(self, trainer: pl.Trainer, *_: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self.units = [(u.name, u.gathers, u.releases) for u in engine.units] if engine is not None else []

    on_train_end = on_test_end = on_validation_end = on_predict_end = _record

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        opt = trainer.optimizers[0]
        self.start = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                      "lr": opt.param_groups[0]["lr"],
                      "sched_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
                      "opt_steps": sorted({int(s["step"]) for s in opt.state.values()}),
                      "seen": int(pl_module.seen),
                      "summary": (ModelSummary(pl_module).total_parameters,
                                  ModelSummary(pl_module).trainable_parameters)}


class _SaveAtEpochEnd(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)  # inside fit: every rank writes its own shards


def _released(units: list[tuple[str, int, int]]) -> bool:
    return bool(units) and all(releases > 0 for _, _, releases in units)


def test_only_parameters_go_to_the_meta_device() -> None:
    from lightning_zero.core.stage3.materialize import parameters_on_meta

    shared = nn.Parameter(torch.ones(3))
    with parameters_on_meta():
        emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        head.weight = emb.weight  # tied after the move: the same meta parameter
        first, second = nn.Module(), nn.Module()
        first.w, second.w = shared, shared  # one real parameter registered twice: one meta twin
        first.register_buffer("scale", torch.arange(3.0))
        acc = Accuracy(task="multiclass", num_classes=2)
    assert emb.weight.is_meta and head.weight is emb.weight
    assert first.w is second.w and first.w.is_meta and not shared.is_meta
    assert torch.equal(first.scale, torch.arange(3.0))  # buffers keep their values
    assert not any(t.is_meta for t in (*acc.buffers(), acc.tp, acc.fn))  # metric states are real
    assert not nn.Linear(2, 2).weight.is_meta  # outside the block nothing changes


# ---------------------------------------------------------------------------- resume, evaluation
def resume_body(tmp: str) -> dict[str, Any]:
    mid, after = str(Path(tmp) / "mid"), str(Path(tmp) / "after")
    straight = MetricNet()  # the reference: 2 epochs without interruption
    make_trainer(zero3(), max_epochs=2, max_steps=-1).fit(straight, loader())

    first = MetricNet()
    trainer = make_trainer(zero3(), max_epochs=1, max_steps=-1, callbacks=[_SaveAtEpochEnd(mid)])
    trainer.fit(first, loader())
    trainer.save_checkpoint(after)  # after fit: the module is whole again

    resumed, units = MetricNet(), _Units()
    make_trainer(zero3(), max_epochs=2, max_steps=-1, callbacks=[units]).fit(resumed, loader(), ckpt_path=mid)
    return {"straight": weights(straight), "straight_losses": straight.losses, "straight_lrs": straight.lrs,
            "first": weights(first), "resumed": weights(resumed), "resumed_losses": resumed.losses,
            "resumed_lrs": resumed.lrs, "start": units.start, "units": units.units,
            "after": {k: v.clone() for k, v in consolidate_checkpoint(after).items()}}


def evaluate_body(tmp: str, strategy: str) -> dict[str, Any]:
    """test / validate / predict from the checkpoint ``resume_body`` saved after fit, each by a
    new Trainer; the reference is a plain module holding the checkpoint's weights."""
    after = str(Path(tmp) / "after")
    out: dict[str, Any] = {}
    for fn in ("test", "validate", "predict"):
        units = _Units()
        make = zero3 if strategy == "zero3" else DDPStrategy
        trainer = make_trainer(make(), callbacks=[units])
        result = getattr(trainer, fn)(MetricNet(), loader(), ckpt_path=after)
        out[fn] = torch.cat(result) if fn == "predict" else result
        out[f"{fn}_units"] = units.units
    reference = MetricNet()
    reference.configure_model()
    reference.load_state_dict(consolidate_checkpoint(after))
    with torch.no_grad():
        batches = list(loader())
        logits = torch.cat([reference(x) for x, _ in batches])
        labels = torch.cat([y for _, y in batches])
    out["expected_predict"] = logits
    out["expected_loss_sum"] = sum(nn.functional.cross_entropy(reference(x), y).item() for x, y in batches)
    out["expected_hits"] = int((logits.argmax(-1) == labels).sum())
    return out


@pytest.fixture(scope="module")
def checkpoints(gloo_pool, tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    tmp = str(tmp_path_factory.mktemp("expectations"))
    return tmp, gloo_pool.run("tests.distributed.test_lightning_expectations:resume_body", tmp=tmp)


@pytest.mark.distributed
def test_resume_from_save_checkpoint_restores_weights_optimizer_loops_and_scheduler(checkpoints) -> None:
    _, results = checkpoints
    for r in results:
        # loops: the second epoch starts after the first's 2 optimizer steps
        assert r["start"]["global_step"] == 2 and r["start"]["epoch"] == 1
        # scheduler: two StepLR(gamma=0.7) steps; optimizer: AdamW's step count per parameter
        assert r["start"]["sched_epoch"] == 2 and r["start"]["lr"] == pytest.approx(0.05 * 0.7**2, rel=1e-12)
        assert r["start"]["opt_steps"] == [2]
        assert r["start"]["seen"] == 8  # the buffer built in configure_model came back (8 samples a rank)
        # then training continues exactly as without the interruption (weights, AdamW moments, lr)
        assert r["resumed_losses"] == r["straight_losses"][2:]
        assert r["resumed_lrs"] == r["straight_lrs"][2:]
        for key, value in r["straight"].items():
            assert torch.equal(r["resumed"][key], value), key
        assert _released(r["units"]), r["units"]
        # the checkpoint written after fit holds the same state as the one written inside it
        assert all(torch.equal(r["after"][k], v) for k, v in r["first"].items())


@pytest.mark.distributed
def test_test_validate_predict_from_a_checkpoint(gloo_pool, checkpoints) -> None:
    tmp, _ = checkpoints
    results = gloo_pool.run("tests.distributed.test_lightning_expectations:evaluate_body", tmp=tmp, strategy="zero3")
    # test_loss: mean over each rank's 2 batches, then over the ranks; accuracy over all 16 samples
    loss = sum(r["expected_loss_sum"] for r in results) / 4
    acc = sum(r["expected_hits"] for r in results) / 16
    for r in results:
        for fn in ("test", "validate", "predict"):  # gathered per unit and released, in every run
            assert _released(r[f"{fn}_units"]), (fn, r[f"{fn}_units"])
        torch.testing.assert_close(r["predict"], r["expected_predict"], rtol=0, atol=1e-6)
        (test,), (val,) = r["test"], r["validate"]
        assert test["test_loss"] == pytest.approx(loss, rel=1e-6)
        assert val["val_loss"] == pytest.approx(loss, rel=1e-6)
        assert test["test_acc"] == pytest.approx(acc) and val["val_acc"] == pytest.approx(acc)


# ---------------------------------------------------------------------------- training like DDP
def training_body(mode: str) -> dict[str, Any]:
    """``mode``: ``norm`` / ``value`` (automatic optimization, 2 micro-batches a step, clipping by
    norm or value) or ``manual`` (``manual_backward``, ``clip_gradients`` by norm, scheduler stepped
    by hand), each with DDP and with stage 3 from the same initial weights."""
    out: dict[str, Any] = {}
    for name, strategy in (("ddp", DDPStrategy()), ("zero3", zero3())):
        model, units = MetricNet(manual=mode == "manual"), _Units()
        kw: dict[str, Any] = {} if mode == "manual" else dict(
            accumulate_grad_batches=2, gradient_clip_val=0.5 if mode == "norm" else 0.05,
            gradient_clip_algorithm=mode)
        make_trainer(strategy, max_steps=3, callbacks=[units], **kw).fit(model, loader(n=48))
        out[name] = {"losses": model.losses, "weights": weights(model), "units": units.units,
                     "start": units.start, "acc": float(model.acc.compute()), "norms": units.grad_norms}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["norm", "value", "manual"])
def test_training_matches_ddp(gloo_pool, mode: str) -> None:
    for r in gloo_pool.run("tests.distributed.test_lightning_expectations:training_body", mode=mode):
        ddp, zero = r["ddp"], r["zero3"]
        assert len(zero["losses"]) == (3 if mode == "manual" else 6)
        torch.testing.assert_close(zero["losses"], ddp["losses"], rtol=1e-5, atol=0)
        for key, value in ddp["weights"].items():
            torch.testing.assert_close(zero["weights"][key], value, rtol=0, atol=1e-6, msg=key)
        assert zero["acc"] == ddp["acc"]  # the metric built in configure_model saw the same predictions
        assert _released(zero["units"]), zero["units"]
        if mode != "value":  # clipping by norm had work to do at every step
            assert len(zero["norms"]) == 3 and min(zero["norms"]) > 0.5, zero["norms"]
        # ModelSummary counts the whole model while it is sharded
        assert zero["start"]["summary"] == ddp["start"]["summary"] == (NUM_PARAMS, NUM_PARAMS)


# ---------------------------------------------------------------------------- defaults, errors
def defaults_body(tmp: str) -> dict[str, Any]:
    """``strategy="zero_stage_3"`` as is (default persistence threshold, default initialisation):
    fit -> save_checkpoint -> resume, and predict from the checkpoint."""
    path = str(Path(tmp) / "default")
    trainer = make_trainer("zero_stage_3", max_epochs=1, max_steps=-1)
    trainer.fit(MetricNet(), loader())
    trainer.save_checkpoint(path)
    resumed, units = MetricNet(), _Units()
    make_trainer("zero_stage_3", max_epochs=2, max_steps=-1, callbacks=[units]).fit(resumed, loader(), ckpt_path=path)
    predicted = make_trainer("zero_stage_3").predict(MetricNet(), loader(), ckpt_path=path)
    reference = MetricNet()
    reference.configure_model()
    reference.load_state_dict(consolidate_checkpoint(path))
    with torch.no_grad():
        expected = torch.cat([reference(x) for x, _ in loader()])
    return {"start": units.start, "losses": resumed.losses, "predict": torch.cat(predicted), "expected": expected}


@pytest.mark.distributed
def test_zero_stage_3_at_its_defaults(gloo_pool, tmp_path) -> None:
    for r in gloo_pool.run("tests.distributed.test_lightning_expectations:defaults_body", tmp=str(tmp_path)):
        assert r["start"]["global_step"] == 2 and r["start"]["opt_steps"] == [2]
        assert len(r["losses"]) == 2
        torch.testing.assert_close(r["predict"], r["expected"], rtol=0, atol=1e-6)


class _BrokenNet(MetricNet):
    def configure_model(self) -> None:
        super().configure_model()  # some parameters exist (on the meta device under stage 3)
        raise ValueError("configure_model failed")


def error_body() -> tuple[str, str, str]:
    try:
        make_trainer(zero3()).fit(_BrokenNet(), loader())
    except Exception as err:
        return type(err).__name__, str(err), repr(err.__context__)
    return "no error", "", ""


@pytest.mark.distributed
def test_an_error_before_setup_is_the_error_the_user_sees(gloo_pool) -> None:
    for name, message, context in gloo_pool.run("tests.distributed.test_lightning_expectations:error_body"):
        # not torch's "Cannot copy out of meta tensor" raised by teardown on top of it
        assert (name, message, context) == ("ValueError", "configure_model failed", "None")


class _Masters(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        engine = trainer.strategy.engine
        self.masters = {engine.names[p]: v.clone() for p, v in engine.full_master_params().items()}


def mixed_resume_body(tmp: str) -> dict[str, Any]:
    """bf16-mixed: the resumed fp32 masters are the checkpoint's, not its 16-bit parameters cast up."""
    path = str(Path(tmp) / "bf16")
    make_trainer(zero3(precision="bf16-mixed"), max_steps=2, callbacks=[_SaveAtEpochEnd(path)]).fit(
        MetricNet(), loader())
    probe = _Masters()
    make_trainer(zero3(precision="bf16-mixed"), max_steps=3, callbacks=[probe]).fit(
        MetricNet(), loader(), ckpt_path=path)
    saved = consolidate_checkpoint(path)
    return {"masters": probe.masters, "saved": {k: saved[k].clone() for k in probe.masters}}


@pytest.mark.distributed
def test_mixed_precision_resume_restores_the_fp32_masters(gloo_pool, tmp_path) -> None:
    for r in gloo_pool.run("tests.distributed.test_lightning_expectations:mixed_resume_body", tmp=str(tmp_path)):
        for key, value in r["saved"].items():
            assert value.dtype == torch.float32 and torch.equal(r["masters"][key], value), key
