"""Parity of ZeRO stages 0-2 with Lightning's DDP on 2 gloo ranks (same seed, data and model).

Tolerances: losses within 1e-5 relative with AdamW (stage 2 reduces every micro-step where DDP
sums locally first; Adam amplifies the rounding difference), final parameters within 1e-6 with SGD.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.models import ManualTinyTransformer, TinyTransformer, make_trainer, params_of, token_loader

STAGES = (0, 1, 2)
SCENARIOS: dict[str, dict[str, Any]] = {
    # two param groups, a frozen layer, an unused parameter, an odd parameter count
    "adamw": dict(optimizer="adamw", accumulate=1, clip=None),
    # accumulation and a clip value below the observed norm (asserted active at every step)
    "adamw_accum_clip": dict(optimizer="adamw", accumulate=2, clip=0.05),
    "sgd": dict(optimizer="sgd", accumulate=1, clip=None),
    "sgd_accum_clip": dict(optimizer="sgd", accumulate=2, clip=0.05),
    # manual optimization: manual_backward, clip_gradients and step in training_step
    "manual_sgd_clip": dict(optimizer="sgd", accumulate=1, clip=None, manual=True),
    # master shards stepped as many small pieces (Note [master pieces] in core/zero/optimizer.py)
    "adamw_pieces": dict(optimizer="adamw", accumulate=2, clip=0.05, piece_numel=16),
}


def _fit(strategy: Any, optimizer: str, accumulate: int, clip: float | None, manual: bool = False) -> dict[str, Any]:
    model = (ManualTinyTransformer if manual else TinyTransformer)(optimizer, record_grad_norm=True)
    trainer = make_trainer(strategy, accumulate_grad_batches=accumulate, gradient_clip_val=clip, max_steps=5)
    state_counts: list[int] = []

    class CountOptimizerTensors(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            state_counts.append(sum(len(g["params"]) for g in trainer.optimizers[0].param_groups))

    trainer.callbacks.append(CountOptimizerTensors())
    trainer.fit(model, token_loader())
    return {"losses": model.losses, "params": params_of(model), "grad_norms": model.grad_norms,
            "optimizer_tensors": state_counts[0]}


def parity_body(scenario: str, collective: str = "auto") -> dict[str, Any]:
    """Runs DDP and every stage on this rank; returns their losses, parameters and norms."""
    from lightning_zero.core.zero import optimizer as zero_optimizer

    kw = dict(SCENARIOS[scenario])
    piece_numel = kw.pop("piece_numel", zero_optimizer.MASTER_PIECE_NUMEL)
    out = {"ddp": _fit(DDPStrategy(find_unused_parameters=True), **kw)}
    default_piece, zero_optimizer.MASTER_PIECE_NUMEL = zero_optimizer.MASTER_PIECE_NUMEL, piece_numel
    try:
        for stage in STAGES:
            # a bucket smaller than the largest parameter, so several buckets and a split parameter run
            out[stage] = _fit(ZeroStrategy(stage=stage, reduce_bucket_size=100, collective=collective), **kw)
            if stage > 0 and piece_numel < 1000:
                assert out[stage]["optimizer_tensors"] > 10, out[stage]["optimizer_tensors"]
    finally:
        zero_optimizer.MASTER_PIECE_NUMEL = default_piece
    return out


@pytest.fixture(scope="module")
def parity_results(gloo_pool) -> dict[tuple[str, str], list[dict[str, Any]]]:
    runs = [(s, "auto") for s in SCENARIOS] + [("adamw_accum_clip", "reduce_scatter")]
    return {run: gloo_pool.run("tests.distributed.test_parity:parity_body",
                               scenario=run[0], collective=run[1]) for run in runs}


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(
    "run", [(s, "auto") for s in SCENARIOS] + [("adamw_accum_clip", "reduce_scatter")], ids=lambda r: "-".join(r)
)
def test_parity_with_ddp(parity_results, run: tuple[str, str], stage: int) -> None:
    scenario = SCENARIOS[run[0]]
    for rank, result in enumerate(parity_results[run]):
        ref, got = result["ddp"], result[stage]
        steps = 5 * scenario["accumulate"]
        assert len(got["losses"]) == steps
        assert _rel(got["losses"], ref["losses"]) < 1e-5, (rank, got["losses"], ref["losses"])
        if scenario["optimizer"] == "sgd":
            assert _max_diff(got["params"], ref["params"]) < 1e-6
        if scenario["clip"] is not None:
            norms = got["grad_norms"]
            assert len(norms) == 5 and all(n > scenario["clip"] for n in norms), norms  # clipping was active
    # every rank ends with the same parameters
    assert _max_diff(parity_results[run][0][stage]["params"], parity_results[run][1][stage]["params"]) == 0.0


def test_world_size_one_makes_no_collective_calls(monkeypatch) -> None:
    import torch.distributed as dist

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective was called at world size 1")

    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                 "reduce_scatter_tensor", "reduce_scatter_single", "new_group", "init_process_group"):
        monkeypatch.setattr(dist, name, forbidden)
    results = {}
    for stage in STAGES:
        model = TinyTransformer("sgd")
        make_trainer(ZeroStrategy(stage=stage), devices=1, max_steps=3).fit(model, token_loader())
        results[stage] = (model.losses, params_of(model))
    assert not dist.is_initialized()
    for stage in (1, 2):
        assert results[stage][0] == results[0][0]
        assert _max_diff(results[stage][1], results[0][1]) == 0.0
