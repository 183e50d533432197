"""16-bit training under ZeroStrategy on 2 gloo ranks: fp16 / bf16 parity with fp32, skipped fp16 steps,
model-state bytes, checkpoints; and the plugin's bad-input errors (no processes).

Tolerances: after 30 AdamW steps the loss is within 0.2% (fp16) / 0.3% (bf16) of the fp32 run's
(measured, docs/precision.md: +0.040% fp16, -0.151% bf16, the same at stages 0-3). A master that
does not keep fp32 precision -- bf16-true has none (-0.861%), a master overwritten by the bf16
parameters every step (-0.481%, ``test_a_master_that_is_not_updated_is_caught``) -- fails the
bf16 tolerance.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroPrecision, ZeroStrategy, model_state_formula
from lightning_zero.core.settings.precision import LossScalerConfig
from tests.models import VOCAB, RankSampler, TinyTransformer, make_trainer, rank_and_world

STAGES = (0, 1, 2, 3)
FP16_TOLERANCE, BF16_TOLERANCE = 0.002, 0.003  # relative, final loss vs fp32 (see the module docs)


def _sharded(stage: int) -> dict[str, Any]:
    """Stage 3 with every parameter sharded (the tiny models' parameters would all stay gathered)."""
    return {"param_persistence_threshold": 0} if stage == 3 else {}
NO_NATURAL_OVERFLOW = LossScalerConfig(initial_scale_power=8)  # tiny model: 2**8 never overflows


def pattern_loader(n: int = 96, seq: int = 9, batch_size: int = 4, seed: int = 1) -> DataLoader:
    """Arithmetic sequences mod VOCAB (random start and stride 1-3): learnable in a few dozen steps."""
    rank, world = rank_and_world()
    gen = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
    data = (start + stride * torch.arange(seq)) % VOCAB
    return DataLoader(TensorDataset(data), batch_size=batch_size, sampler=RankSampler(n, rank, world))


class Model(TinyTransformer):
    """TinyTransformer with the loss in fp32 (as DeepSpeed users compute it), a per-step LR schedule,
    and gradient poisoning on one rank at chosen batches."""

    def __init__(self, poison_at: tuple[int, ...] = (), poison_rank: int = 1) -> None:
        super().__init__("adamw")
        self.poison_at, self.poison_rank = poison_at, poison_rank
        self.compute_dtypes: set[torch.dtype] = set()
        self._poison_now = False
        self.head.weight.register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._poison_now:
            return grad
        self._poison_now = False
        grad = grad.clone()
        grad[3, 5] = float("inf")  # one element: after reduction it sits in one rank's shard only
        return grad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        h = self.enc(self.frozen(self.emb(x[:, :-1])))
        self.compute_dtypes.add(h.dtype)
        logits = self.head(h).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        self._poison_now = batch_idx in self.poison_at and rank_and_world()[0] == self.poison_rank
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.98**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _state(trainer: pl.Trainer) -> dict[str, Any]:
    """Everything a step may change, copied: params, masters, optimizer state, lr, scaler."""
    strategy: ZeroStrategy = trainer.strategy  # type: ignore[assignment]
    engine = strategy.engine
    opt = engine.optimizer
    plugin = strategy.precision_plugin
    return {
        # stage 3 keeps only shards between steps (released parameters read as NaN placeholders)
        "params": ([g.own_shard().clone() for g in engine.all_groups] if engine.runtime is not None
                   else [p.detach().clone() for p in trainer.lightning_module.parameters()]),
        "masters": [m.detach().clone() for m in engine.sharded.masters] if engine.sharded else [],
        "opt": [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
        "lr": [g["lr"] for g in opt.param_groups],
        "scale": strategy.loss_scale, "credits": plugin.scaler.hysteresis_left if plugin.scaler else None,
        "skipped": strategy.skipped_steps, "grad_norm": strategy.last_grad_norm,
    }


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.before: list[dict[str, Any]] = []
        self.after: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.before.append(_state(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append(_state(trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine
        self.final = {
            "param_dtypes": {p.dtype for p in pl_module.parameters()},
            "master_dtypes": {m.dtype for m in engine.sharded.masters} if engine.sharded else set(),
            "separate_master": engine.separate_master,
            "state_dtypes": {v.dtype for st in engine.optimizer.state.values() for k, v in st.items()
                             if isinstance(v, torch.Tensor) and k != "step"},
            "compute_dtypes": pl_module.compute_dtypes,
        }


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- skipped steps
def overflow_body(stage: int) -> list[dict[str, Any]]:
    """fp16 fit of 6 steps; rank 1 alone gets an inf gradient at steps 2 and 3."""
    recorder = _Recorder()
    model = Model(poison_at=(2, 3))
    strategy = ZeroStrategy(stage=stage, **_sharded(stage),
                            precision=ZeroPrecision("16-mixed", loss_scaler=NO_NATURAL_OVERFLOW))
    make_trainer(strategy, max_steps=6, callbacks=[recorder]).fit(model, pattern_loader())
    out = []
    for before, after in zip(recorder.before, recorder.after):
        out.append({
            "params_same": _equal(before["params"], after["params"]),
            "masters_same": _equal(before["masters"], after["masters"]),
            "opt_same": _equal(before["opt"], after["opt"]),
            "lr": (before["lr"], after["lr"]),
            "scale": (before["scale"], after["scale"]), "credits": (before["credits"], after["credits"]),
            "skipped": after["skipped"], "grad_norm": after["grad_norm"],
        })
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(gloo_pool, stage: int) -> None:
    for rank, steps in enumerate(gloo_pool.run("tests.distributed.test_precision:overflow_body", stage=stage)):
        assert len(steps) == 6
        for i, s in enumerate(steps):
            skipped = i in (2, 3)
            assert s["params_same"] == s["masters_same"] == skipped, (rank, i, s)
            assert s["opt_same"] == skipped or i == 0, (rank, i)  # step 0 creates the state
            assert (s["lr"][0] == s["lr"][1]) == skipped, (rank, i, s["lr"])
            assert s["skipped"] == sum(j <= i for j in (2, 3))
            assert math.isinf(s["grad_norm"]) == skipped
        assert steps[2]["scale"] == (256.0, 256.0) and steps[2]["credits"] == (2, 1)  # a credit spent
        assert steps[3]["scale"] == (256.0, 128.0) and steps[3]["credits"] == (1, 1)  # then halved
        assert steps[5]["scale"][1] == 128.0


# ---------------------------------------------------------------------------- training parity
def parity_body(modes: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        for stage in STAGES:
            recorder = _Recorder()
            model = Model()
            plugin = ZeroPrecision(mode, loss_scaler=NO_NATURAL_OVERFLOW if mode == "16-mixed" else None)
            trainer = make_trainer(ZeroStrategy(stage=stage, **_sharded(stage), precision=plugin), max_steps=30,
                                   callbacks=[recorder])
            trainer.fit(model, pattern_loader())
            out[f"{mode}/{stage}"] = {"losses": model.losses, **recorder.final,
                                      "skipped": trainer.strategy.skipped_steps,
                                      "after_fit": {p.dtype for p in model.parameters()}}
    return out


@pytest.fixture(scope="module")
def parity_results(gloo_pool) -> list[dict[str, Any]]:
    return gloo_pool.run("tests.distributed.test_precision:parity_body",
                         modes=("32-true", "16-mixed", "bf16-mixed", "bf16-true"),
                         _timeout_s=600)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("mode", "dtype", "tolerance"), [("16-mixed", torch.float16, FP16_TOLERANCE),
                                                          ("bf16-mixed", torch.bfloat16, BF16_TOLERANCE)])
def test_mixed_precision_trains_like_fp32(parity_results, stage: int, mode: str, dtype: torch.dtype,
                                          tolerance: float) -> None:
    for result in parity_results:
        ref, got = result[f"32-true/{stage}"], result[f"{mode}/{stage}"]
        assert len(got["losses"]) == 30 and got["skipped"] == 0
        assert got["losses"][-1] < got["losses"][0] - 0.5  # it learns
        assert abs(got["losses"][-1] / ref["losses"][-1] - 1) < tolerance, (got["losses"][-1], ref["losses"][-1])
        assert got["compute_dtypes"] == {dtype} and got["param_dtypes"] == {dtype}
        assert got["separate_master"] and got["master_dtypes"] == {torch.float32}
        assert got["state_dtypes"] == {torch.float32}
        assert got["after_fit"] == {torch.float32}  # the module has its dtype (and master values) back


def stale_master_body(stage: int) -> dict[str, list[float]]:
    """bf16-mixed whose fp32 master is overwritten with the bf16 parameters before every step (a
    master "not updated" by its own fp32 history), against fp32."""
    from lightning_zero.core.zero.optimizer import ShardedOptimizer

    original = ShardedOptimizer.set_grads

    def stale(self: ShardedOptimizer, grads: list[torch.Tensor]) -> None:
        self.write_masters_from_params(self.groups)  # the master loses what the bf16 rounding dropped
        original(self, grads)

    out = {}
    for mode in ("32-true", "bf16-mixed"):
        model = Model()
        ShardedOptimizer.set_grads = stale if mode == "bf16-mixed" else original  # type: ignore[method-assign]
        try:
            make_trainer(ZeroStrategy(stage=stage, **_sharded(stage), precision=mode), max_steps=30).fit(
                model, pattern_loader())
        finally:
            ShardedOptimizer.set_grads = original  # type: ignore[method-assign]
        out[mode] = model.losses
    return out


@pytest.mark.distributed
def test_a_master_that_is_not_updated_is_caught(gloo_pool, parity_results) -> None:
    """The bf16 tolerance is tight enough to catch a master that does not keep its fp32 values."""
    for result, stale in zip(parity_results, gloo_pool.run("tests.distributed.test_precision:stale_master_body",
                                                           stage=2)):
        assert stale["32-true"] == pytest.approx(result["32-true/2"]["losses"], rel=1e-6)
        assert stale["bf16-mixed"][-1] < stale["bf16-mixed"][0] - 0.5  # it still learns, roughly
        assert abs(stale["bf16-mixed"][-1] / stale["32-true"][-1] - 1) > BF16_TOLERANCE, stale["bf16-mixed"][-1]
        bf16_true = result["bf16-true/2"]["losses"][-1]  # no master at all
        assert abs(bf16_true / result["32-true/2"]["losses"][-1] - 1) > BF16_TOLERANCE, bf16_true


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_true_trains_without_a_master(parity_results, stage: int) -> None:
    for result in parity_results:
        got = result[f"bf16-true/{stage}"]
        assert got["losses"][-1] < got["losses"][0] - 0.5
        assert not got["separate_master"] and got["state_dtypes"] == {torch.bfloat16}
        assert got["param_dtypes"] == got["after_fit"] == got["compute_dtypes"] == {torch.bfloat16}


def accumulation_body() -> dict[str, list[float]]:
    """Accumulation over 2 micro-steps with clipping, fp32 against the dtype options of the mixed modes."""
    fp16 = dict(loss_scaler=NO_NATURAL_OVERFLOW)
    runs = {  # name: (plugin options, collective)
        "fp32": (("32-true", {}), "auto"),
        "fp16/fp32-accum": (("16-mixed", {**fp16, "grad_accum_dtype": "float32"}), "reduce_scatter"),
        "fp16/fp32-reduce": (("16-mixed", {**fp16, "reduce_dtype": "float32"}), "auto"),
        "bf16/fp32-accum": (("bf16-mixed", {"grad_accum_dtype": torch.float32}), "reduce_scatter"),
    }
    out = {}
    for name, ((mode, options), collective) in runs.items():
        for stage in STAGES:
            model = Model()
            strategy = ZeroStrategy(stage=stage, **_sharded(stage), precision=ZeroPrecision(mode, **options),
                                    collective=collective, reduce_bucket_size=300)
            make_trainer(strategy, max_steps=8, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(
                model, pattern_loader())
            out[f"{name}/{stage}"] = model.losses
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_accumulation_reduce_and_accum_dtypes_follow_fp32(gloo_pool) -> None:
    for result in gloo_pool.run("tests.distributed.test_precision:accumulation_body"):
        for stage in STAGES:
            ref = result[f"fp32/{stage}"]
            assert len(ref) == 16
            for name, tol in (("fp16/fp32-accum", 0.01), ("fp16/fp32-reduce", 0.01), ("bf16/fp32-accum", 0.02)):
                got = result[f"{name}/{stage}"]
                assert max(abs(a / b - 1) for a, b in zip(got, ref)) < tol, (name, stage, got, ref)


# ---------------------------------------------------------------------------- model-state bytes
class _Bytes(pl.Callback):
    def __init__(self) -> None:
        self.during_step: list[Any] = []  # after unscaling, before the optimizer steps
        self.after_step: list[Any] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self.during_step.append(trainer.strategy.model_state_bytes())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after_step.append(trainer.strategy.model_state_bytes())


def memory_body(mode: str, stage: int) -> dict[str, Any]:
    model, probe = Model(), _Bytes()
    plugin = ZeroPrecision(mode, loss_scaler=NO_NATURAL_OVERFLOW if mode == "16-mixed" else None)
    make_trainer(ZeroStrategy(stage=stage, **_sharded(stage), precision=plugin, reduce_bucket_size=100), max_steps=2,
                 callbacks=[probe]).fit(model, pattern_loader())
    return {"during": probe.during_step[-1], "after": probe.after_step[-1],
            "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "frozen_16bit_bytes": sum(p.numel() * 2 for p in model.parameters() if not p.requires_grad)}


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_model_state_bytes_follow_the_zero_formulas(gloo_pool, mode: str, stage: int) -> None:
    """mixed: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; bf16-true: 8Ψ, 4Ψ + 4Ψ/N, 2Ψ + 6Ψ/N, 8Ψ/N (AdamW, N = 2)."""
    for r in gloo_pool.run("tests.distributed.test_precision:memory_body", mode=mode, stage=stage):
        psi, got = r["psi"], r["after"]
        expected = model_state_formula(stage, psi, 2, "bf16-true" if mode == "bf16-true" else "mixed")
        total = ({0: 16, 1: 4 + 12 / 2, 2: 2 + 14 / 2, 3: 16 / 2} if mode != "bf16-true"
                 else {0: 8, 1: 4 + 4 / 2, 2: 2 + 6 / 2, 3: 8 / 2})
        assert expected.model_states == pytest.approx(total[stage] * psi)
        # padding: < N elements per group and buffer; AdamW's `step` scalars: 4 bytes per stepped tensor
        slack = 2 * 4 * 4 + 4 * 40
        frozen = r["frozen_16bit_bytes"] / (2 if stage == 3 else 1)  # stage 3 shards frozen parameters too
        assert abs(got.params - frozen - expected.params) <= slack
        assert abs(got.grads - expected.grads) <= slack
        assert abs(got.optimizer - expected.optimizer) <= slack
        assert got.comm_buffers == 0
        # the fp32 gradient of the master exists during the step only (mixed modes: 4 bytes per master element)
        extra = r["during"].grads - got.grads
        master_elements = psi if stage == 0 else psi / 2
        assert abs(extra - (4 * master_elements if mode != "bf16-true" else 0)) <= slack


# ---------------------------------------------------------------------------- checkpoints
class _RestoredState(pl.Callback):
    """What the resumed run starts from, as the strategy holds it after restoring."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy: ZeroStrategy = trainer.strategy  # type: ignore[assignment]
        names = {p: n for n, p in pl_module.named_parameters()}
        self.masters = {names[p]: t.clone() for p, t in strategy.engine.full_master_params().items()}
        # gathered on every rank (a collective): each rank's restored shards are checked, not only rank 0's
        from lightning_zero.core.zero.optimizer_state import full_optimizer_state

        self.optimizer = copy.deepcopy(full_optimizer_state(strategy.engine.sharded, strategy.engine.comm))
        self.scaler = strategy.precision_plugin.scaler.state_dict()


def _fp16_growing() -> ZeroPrecision:
    return ZeroPrecision("16-mixed", loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=3))


def resume_body(stage: int, resume_stages: tuple[int, ...]) -> dict[str, Any]:
    """fp16 for 8 steps with a checkpoint per epoch (4 steps); resume from the first at each of ``resume_stages``.

    (Lightning's resumed run replays other batches than the uninterrupted one, so the resumed runs are
    compared with each other and their starting state with the checkpoint.)
    """
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=os.path.abspath("ckpt_fp16"), save_top_k=-1, every_n_epochs=1)
    make_trainer(ZeroStrategy(stage=stage, **_sharded(stage), precision=_fp16_growing(),
                              checkpoint_format="consolidated"), max_steps=8,
                 enable_checkpointing=True, callbacks=[saver]).fit(Model(), pattern_loader(n=32))
    path = os.path.join("ckpt_fp16", "epoch=0-step=4.ckpt")
    ckpt = torch.load(path, weights_only=False)
    out: dict[str, Any] = {"ckpt_dtypes": {v.dtype for v in ckpt["state_dict"].values() if v.is_floating_point()},
                           "ckpt_scaler": ckpt["ZeroPrecision"]["loss_scaler"], "runs": {}}
    for resume_stage in resume_stages:
        probe, model = _RestoredState(), Model()
        strategy = ZeroStrategy(stage=resume_stage, precision=_fp16_growing())
        make_trainer(strategy, max_steps=8, callbacks=[probe]).fit(model, pattern_loader(n=32), ckpt_path=path)
        weights = all(torch.equal(t, ckpt["state_dict"][n]) for n, t in probe.masters.items())
        saved = ckpt["optimizer_states"][0]["state"]
        restored = probe.optimizer["state"]
        optimizer = len(restored) == len(saved) > 0 and all(  # every parameter's moments, on every rank
            torch.equal(v, saved[i][k]) for i, st in restored.items() for k, v in st.items())
        out["runs"][resume_stage] = {"losses": model.losses, "weights_exact": weights, "optimizer_exact": optimizer,
                                     "scaler": probe.scaler, "scale_after": strategy.loss_scale}
    return out


@pytest.mark.distributed
def test_fp16_checkpoint_holds_fp32_weights_and_the_scaler(gloo_pool) -> None:
    for r in gloo_pool.run("tests.distributed.test_precision:resume_body", stage=1, resume_stages=(2, 0)):
        assert r["ckpt_dtypes"] == {torch.float32}
        assert r["ckpt_scaler"]["scale"] == 512.0 and r["ckpt_scaler"]["iteration"] == 4  # grew at step 3 (stable = 3)
        for run in r["runs"].values():
            assert run["weights_exact"] and run["optimizer_exact"]  # the fp32 masters and moments, exactly
            assert run["scaler"] == r["ckpt_scaler"]
            assert run["scale_after"] == 1024.0  # grew again at step 6
        assert r["runs"][2]["losses"] == pytest.approx(r["runs"][0]["losses"], rel=1e-3)
