"""Step safety: the non-finite gradient policy in fp32 / bf16 (Note [non-finite policy] in
lightning_zero/core/precision/nonfinite.py) and the setup agreement across ranks (Note [setup agreement] in
lightning_zero/core/comm/agreement.py): what each rank raises or skips, on the shared 2-rank pool."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import Logger

from lightning_zero import ZeroStrategy
from lightning_zero.core.comm.agreement import describe_mismatch, first_difference
from tests.models import TinyTransformer, make_trainer, params_of, rank_and_world, token_loader


class _NaNAt(TinyTransformer):
    """Rank 1's ``head.weight`` gradient becomes nan at step 2 (its sum over ranks is nan everywhere)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 2 and rank_and_world()[0] == 1:
            self.hook = self.head.weight.register_hook(lambda g: g * float("nan"))
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        if getattr(self, "hook", None) is not None:
            self.hook.remove()  # one step only
            self.hook = None
        self.snapshots.append(params_of(self))


class _Recorder(Logger):
    """Keeps what the loggers get (TensorBoard would get the same calls)."""

    name, version = "recorder", "0"

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def nonfinite_body(policy: str, stage: int, precision: str, root: str) -> dict[str, Any]:
    model = _NaNAt("adamw")
    model.snapshots = []
    logger = _Recorder()
    trainer = make_trainer(ZeroStrategy(stage=stage, precision=precision, nonfinite=policy), max_steps=5,
                           logger=logger)
    error = None
    try:
        trainer.fit(model, token_loader())
    except Exception as exc:  # the test inspects what every rank raised
        error = f"{type(exc).__name__}: {exc}"
    snaps = model.snapshots
    unchanged = len(snaps) > 2 and all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2]))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    key = "train/nonfinite_skipped_steps"
    logged = [(step, m[key]) for step, m in logger.metrics if key in m]
    return {"error": error, "steps": trainer.global_step, "step2_unchanged": unchanged, "finite": finite,
            "logged": logged, "losses": model.losses}


@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "precision"), [(0, "32-true"), (2, "32-true"), (1, "bf16-mixed"), (3, "bf16-true")])
def test_skip_leaves_the_parameters_untouched_counts_and_goes_on(gloo_pool, tmp_path, stage: int,
                                                                 precision: str) -> None:
    results = gloo_pool.run("tests.distributed.test_step_safety:nonfinite_body",
                            policy="skip", stage=stage, precision=precision,
                            root=str(tmp_path))
    for r in results:
        assert r["error"] is None and r["steps"] == 5, r
        assert r["step2_unchanged"] and r["finite"], r  # the nan step changed nothing, later steps trained
    assert results[0]["logged"] == [(2, 1.0)] and results[1]["logged"] == []  # rank 0 logs, at the step


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2])
def test_raise_names_the_step_and_first_parameter_on_every_rank(gloo_pool, tmp_path, stage: int) -> None:
    results = gloo_pool.run("tests.distributed.test_step_safety:nonfinite_body", policy="raise", stage=stage,
                            precision="32-true", root=str(tmp_path))
    for r in results:
        assert r["error"] is not None and r["error"].startswith("NonFiniteGradientError"), r
        assert "optimizer step 2" in r["error"] and "'head.weight'" in r["error"], r


@pytest.mark.distributed
def test_off_lets_the_nan_through(gloo_pool, tmp_path) -> None:
    """The default does not check: the nan reaches the weights (what the policy guards against)."""
    for r in gloo_pool.run("tests.distributed.test_step_safety:nonfinite_body",
                           policy="off", stage=2, precision="32-true",
                           root=str(tmp_path)):
        assert r["error"] is None and not r["finite"], r


def test_nonfinite_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="'off', 'skip' or 'raise'"):
        ZeroStrategy(nonfinite="ignore")


# ---------------------------------------------------------------------------------------------- setup agreement
def config_mismatch_body() -> dict[str, Any]:
    rank = rank_and_world()[0]
    strategy = ZeroStrategy(stage=2)
    strategy.resolved_config = {"data": {"seed": 0 if rank == 0 else 5}, "trainer": {"node_rank": rank}}
    try:
        make_trainer(strategy, max_steps=2).fit(TinyTransformer("adamw"), token_loader())
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": None}


@pytest.mark.distributed
def test_a_config_that_differs_between_ranks_is_named_with_the_rank(gloo_pool) -> None:
    for r in gloo_pool.run("tests.distributed.test_step_safety:config_mismatch_body"):
        assert r["message"] is not None and "rank 1: setting config.data.seed: 5 (rank 0 has 0)" in r["message"], r
        assert "node_rank" not in r["message"]  # per-node keys are not compared


def test_the_first_difference_is_described() -> None:
    a = [("parameter 'w'", "shape=(2,)"), ("setting x", "1")]
    assert first_difference(a, a) is None
    assert first_difference(a, [a[0], ("setting x", "2")]) == "setting x: 2 (rank 0 has 1)"
    assert first_difference(a, a[:1]) == "entry 1: nothing (rank 0 has setting x = 1)"
    assert first_difference(a, [("parameter 'v'", "shape=(2,)")]) == (
        "entry 0: parameter 'v' = shape=(2,) (rank 0 has parameter 'w' = shape=(2,))")
    assert describe_mismatch([a, a, a[:1]]) == "rank 2: entry 1: nothing (rank 0 has setting x = 1)"
