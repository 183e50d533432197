"""ZeRO stage 3 on 2 gloo ranks: parity with DDP, gather / release counts, the live-parameter bound.

Tolerances as for stages 0-2 (tests/distributed/test_parity.py): losses within 1e-5 relative with AdamW,
parameters within 1e-6 with SGD.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.models import StackedLM, make_trainer, params_of, token_loader

BLOCK_NUMEL = 688  # one block's flat groups, padded to the world size (687 -> 688)
SAVED_RATIO_BOUND = 0.5  # checkpointed / plain saved-activation bytes per forward; measured 14432 / 41688 = 0.35
SCENARIOS: dict[str, dict[str, Any]] = {
    "adamw": dict(optimizer="adamw", accumulate=1, clip=None),
    "adamw_accum_clip": dict(optimizer="adamw", accumulate=2, clip=0.05),
    "sgd": dict(optimizer="sgd", accumulate=1, clip=None),
    "sgd_accum_clip": dict(optimizer="sgd", accumulate=2, clip=0.05),
}


class _Probe(pl.Callback):
    """Records per optimizer step the gather / release counts of every unit and the gradient norm."""

    def __init__(self) -> None:
        self.counts: list[dict[str, tuple[int, int]]] = []
        self.grad_norms: list[float] = []
        self.units: list[tuple[str, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        self.counts.append({u.name: (u.gathers, u.releases) for u in engine.units})
        self.units = [(u.name, u.numel) for u in engine.units]
        if engine.last_grad_norm is not None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.grad_norms.append(engine.last_grad_norm)


def _fit(strategy: Any, optimizer: str, accumulate: int, clip: float | None) -> dict[str, Any]:
    model = StackedLM(optimizer)
    probe = _Probe()
    trainer = make_trainer(strategy, accumulate_grad_batches=accumulate, gradient_clip_val=clip, max_steps=5,
                           callbacks=[probe])
    trainer.fit(model, token_loader())
    out = {"losses": model.losses, "params": params_of(model), "counts": probe.counts, "units": probe.units,
           "grad_norms": probe.grad_norms}
    if isinstance(strategy, ZeroStrategy):
        out["peak"] = strategy.gathered_peak_numel
        out["bound"] = strategy.gathered_bound_numel
    return out


def parity_body(scenario: str, prefetch: int) -> dict[str, Any]:
    kw = SCENARIOS[scenario]
    return {
        "ddp": _fit(DDPStrategy(find_unused_parameters=True), **kw),
        "zero3": _fit(ZeroStrategy(stage=3, reduce_bucket_size=100, param_persistence_threshold=0,
                                   prefetch_bucket_size=prefetch), **kw),
    }


RUNS = [(s, BLOCK_NUMEL) for s in SCENARIOS] + [("adamw_accum_clip", 10_000_000)]


@pytest.fixture(scope="module")
def results(gloo_pool) -> dict[tuple[str, int], list[dict[str, Any]]]:
    return {run: gloo_pool.run("tests.distributed.test_stage3:parity_body",
                               scenario=run[0], prefetch=run[1]) for run in RUNS}


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-prefetch{r[1]}")
def test_stage3_matches_ddp(results, run: tuple[str, int]) -> None:
    scenario = SCENARIOS[run[0]]
    for rank, r in enumerate(results[run]):
        ref, got = r["ddp"], r["zero3"]
        assert len(got["losses"]) == 5 * scenario["accumulate"]
        assert _rel(got["losses"], ref["losses"]) < 1e-5, (rank, got["losses"], ref["losses"])
        if scenario["optimizer"] == "sgd":
            assert max((a - b).abs().max().item() for a, b in zip(got["params"], ref["params"])) < 1e-6
        if scenario["clip"] is not None:
            assert len(got["grad_norms"]) == 5 and all(n > scenario["clip"] for n in got["grad_norms"])
    a, b = results[run][0]["zero3"]["params"], results[run][1]["zero3"]["params"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-prefetch{r[1]}")
def test_each_unit_is_gathered_and_released_once_per_pass(results, run: tuple[str, int]) -> None:
    for r in results[run]:
        got = r["zero3"]
        assert [name for name, _ in got["units"]] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
        assert [n for _, n in got["units"]][:3] == [BLOCK_NUMEL] * 3
        # Note [kept tail]: once the forward order is recorded (after the first micro-step), the last blocks
        # within prefetch_bucket_size stay gathered from forward into backward
        kept = {"blocks.2"} if run[1] == BLOCK_NUMEL else {"blocks.0", "blocks.1", "blocks.2"}
        for micro_step, counts in enumerate(got["counts"], start=1):
            for name, (gathers, releases) in counts.items():
                # blocks: once for forward, once for backward (the frozen one too: its input
                # gradient needs its weights); the root stays gathered from forward to backward
                expected = micro_step if name == "<root>" else micro_step + 1 if name in kept else 2 * micro_step
                assert (gathers, releases) == (expected, expected), (name, counts)


@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-prefetch{r[1]}")
def test_gathered_peak_stays_within_the_prefetch_bound(results, run: tuple[str, int]) -> None:
    for r in results[run]:
        got = r["zero3"]
        root = dict(got["units"])["<root>"]
        assert got["bound"] == min(root + BLOCK_NUMEL + run[1], root + 3 * BLOCK_NUMEL)
        assert root + BLOCK_NUMEL <= got["peak"] <= got["bound"], (got["peak"], got["bound"])
    if run[1] == BLOCK_NUMEL:  # one unit in flight ahead: never all three blocks at once
        assert r["zero3"]["peak"] < root + 3 * BLOCK_NUMEL


# ---------------------------------------------------------------------------- memory, summary
class _StateProbe(pl.Callback):
    """Samples model_state_bytes() between steps and as blocks.1 starts its forward."""

    def __init__(self) -> None:
        self.between: list[Any] = []
        self.inside: list[Any] = []
        self.summary_total = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.pytorch.utilities.model_summary import summarize

        self.summary_total = summarize(pl_module).total_parameters
        pl_module.blocks[1].register_forward_pre_hook(
            lambda *_: self.inside.append(trainer.strategy.model_state_bytes()) if pl_module.training else None
        )

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.between.append(trainer.strategy.model_state_bytes())


def memory_body() -> dict[str, Any]:
    model = StackedLM("adamw")
    probe = _StateProbe()
    strategy = ZeroStrategy(stage=3, reduce_bucket_size=100, param_persistence_threshold=0,
                            prefetch_bucket_size=BLOCK_NUMEL)
    make_trainer(strategy, max_steps=3, callbacks=[probe]).fit(model, token_loader())
    return {"between": probe.between, "inside": probe.inside, "summary_total": probe.summary_total,
            "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "total": sum(p.numel() for p in model.parameters())}


@pytest.mark.distributed
def test_model_state_bytes_are_16_psi_over_n_and_live_units_are_buffers(gloo_pool) -> None:
    from lightning_zero import model_state_formula

    for r in gloo_pool.run("tests.distributed.test_stage3:memory_body"):
        expected = model_state_formula(3, r["psi"], world_size=2, precision="fp32")
        slack = 4 * 2 * 12 + 4 * 12  # padding (< N elements per flat group) and AdamW's `step` per tensor
        m = r["between"][-1]
        assert abs(m.params - 4 * r["frozen"] / 2 - expected.params) <= slack, (m, expected)
        assert abs(m.grads - expected.grads) <= slack and abs(m.optimizer - expected.optimizer) <= slack
        assert m.comm_buffers == 0  # every unit released between steps
        # while blocks.1 runs forward: the root, blocks.1 and the prefetched blocks.2 are gathered
        inside = r["inside"][-1]
        root = (r["total"] - 3 * 687) * 4
        assert root + 2 * BLOCK_NUMEL * 4 <= inside.comm_buffers <= root + 2 * BLOCK_NUMEL * 4 + 100 * 4
        assert r["summary_total"] == r["total"]  # ModelSummary counts the true shapes, not the shards


# ---------------------------------------------------------------------------- evaluation
def _uneven_val_loader(batch_size: int = 2):
    from torch.utils.data import DataLoader, TensorDataset

    from tests.models import VOCAB, rank_and_world

    rank, _ = rank_and_world()
    data = torch.randint(0, VOCAB, (12, 9), generator=torch.Generator().manual_seed(5))
    own = data[:6] if rank == 0 else data[6:10]  # rank 0: 3 batches, rank 1: 2 batches
    return DataLoader(TensorDataset(own), batch_size=batch_size)


def evaluation_body() -> dict[str, Any]:
    out = {}
    for name, strategy in (("ddp", DDPStrategy(find_unused_parameters=True)),
                           ("zero3", ZeroStrategy(stage=3, param_persistence_threshold=0,
                                                  prefetch_bucket_size=BLOCK_NUMEL))):
        model = StackedLM("adamw")
        trainer = make_trainer(strategy, max_steps=12, num_sanity_val_steps=2)
        trainer.fit(model, token_loader(), _uneven_val_loader())
        out[name] = {"val_losses": model.val_losses, "val_loss": float(trainer.callback_metrics["val_loss"]),
                     "losses": model.losses}
    return out


@pytest.mark.distributed
def test_validation_with_uneven_batches_matches_ddp(gloo_pool) -> None:
    for rank, r in enumerate(gloo_pool.run("tests.distributed.test_stage3:evaluation_body")):
        ref, got = r["ddp"], r["zero3"]
        # sanity check (2 batches) + one validation epoch (3 batches on rank 0, 2 on rank 1)
        assert len(got["val_losses"]) == (2 + 3 if rank == 0 else 2 + 2)
        assert _rel(got["val_losses"], ref["val_losses"]) < 1e-5
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)  # sync_dist mean over both ranks
        assert _rel(got["losses"], ref["losses"]) < 1e-5


# ---------------------------------------------------------------------------- order of units
class _Branchy(StackedLM):
    """Skips blocks.1 when ``skip(step)`` says so (on this rank)."""

    def __init__(self, skip_rank: int | None, skip_from_step: int | None) -> None:
        super().__init__("sgd")
        self.skip_rank, self.skip_from_step = skip_rank, skip_from_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tests.models import rank_and_world

        rank, _ = rank_and_world()
        skip = (self.skip_rank is not None and rank == self.skip_rank) or (
            self.skip_from_step is not None and self.global_step >= self.skip_from_step
        )
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if not (i == 1 and skip):
                h = block(h)
        return self.head(self.norm(h))


def divergent_branch_body() -> str:
    model = _Branchy(skip_rank=1, skip_from_step=None)
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, timeout_s=30)
    try:
        make_trainer(strategy, max_steps=2).fit(model, token_loader())
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.distributed
def test_ranks_running_different_units_fail_on_every_rank(gloo_pool) -> None:
    messages = gloo_pool.run("tests.distributed.test_stage3:divergent_branch_body")
    assert any("ranks ran different modules" in m for m in messages), messages
    assert all(m != "no error" for m in messages), messages


def changing_order_body() -> dict[str, Any]:
    out = {}
    for name, strategy in (("ddp", DDPStrategy(find_unused_parameters=True)),
                           ("zero3", ZeroStrategy(stage=3, param_persistence_threshold=0,
                                                  prefetch_bucket_size=BLOCK_NUMEL))):
        model = _Branchy(skip_rank=None, skip_from_step=3)  # every rank skips blocks.1 from step 3 on
        make_trainer(strategy, max_steps=6).fit(model, token_loader())
        out[name] = {"losses": model.losses, "params": params_of(model)}
        if name == "zero3":
            out["retraces"] = strategy._run.last_runtime.retraces
    return out


@pytest.mark.distributed
def test_a_changed_unit_order_is_retraced(gloo_pool) -> None:
    for r in gloo_pool.run("tests.distributed.test_stage3:changing_order_body"):
        assert r["retraces"] >= 1
        assert _rel(r["zero3"]["losses"], r["ddp"]["losses"]) < 1e-5
        assert max((a - b).abs().max().item() for a, b in zip(r["zero3"]["params"], r["ddp"]["params"])) < 1e-6


# ---------------------------------------------------------------------------- gathered_parameters, checkpointing
class _ModifyOnRank0(pl.Callback):
    """At fit start: read blocks.0.up.weight whole, then set it to a known value on rank 0 only."""

    def __init__(self) -> None:
        self.read_shape: tuple[int, ...] = ()
        self.after: torch.Tensor | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from lightning_zero import gathered_parameters

        w = pl_module.blocks[0].up.weight
        with gathered_parameters(w):
            self.read_shape = tuple(w.clone().shape)
        with gathered_parameters(pl_module.blocks[0].parameters(), modifier_rank=0):
            if trainer.global_rank == 0:
                with torch.no_grad():
                    w.fill_(0.125)
        with gathered_parameters([w]):
            self.after = w.detach().clone()


def gathered_body(stage: int) -> dict[str, Any]:
    model = StackedLM("sgd")
    probe = _ModifyOnRank0()
    strategy = ZeroStrategy(stage=stage, param_persistence_threshold=0)
    make_trainer(strategy, max_steps=1, callbacks=[probe]).fit(model, token_loader())
    return {"shape": probe.read_shape, "after": probe.after}


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [3, 2])
def test_gathered_parameters_reads_whole_and_scatters_one_ranks_change(gloo_pool, stage: int) -> None:
    for r in gloo_pool.run("tests.distributed.test_stage3:gathered_body", stage=stage):
        assert r["shape"] == (24, 13)
        assert torch.equal(r["after"], torch.full((24, 13), 0.125))  # rank 1 sees rank 0's change too


class _SavedActivations(pl.Callback):
    """Bytes autograd saves for backward during each forward (saved-tensor hooks, from the batch's
    start to its backward): what activation checkpointing is meant to shrink."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._ctx: Any = None

    def on_train_batch_start(self, *args: Any) -> None:
        self.per_step.append(0)

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.per_step[-1] += t.numel() * t.element_size()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()

    def on_before_backward(self, *args: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


def checkpointing_body(stage: int) -> dict[str, Any]:
    out = {}
    for name, on in (("plain", False), ("checkpointed", True)):
        model, saved = StackedLM("sgd"), _SavedActivations()
        strategy = ZeroStrategy(stage=stage, param_persistence_threshold=0, activation_checkpointing=on,
                                prefetch_bucket_size=BLOCK_NUMEL)
        make_trainer(strategy, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05,
                     callbacks=[saved]).fit(model, token_loader())
        out[name] = {"losses": model.losses, "params": params_of(model), "saved": saved.per_step}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [3, 2])
def test_activation_checkpointing_changes_nothing_but_memory(gloo_pool, stage: int) -> None:
    for r in gloo_pool.run("tests.distributed.test_stage3:checkpointing_body", stage=stage):
        assert _rel(r["checkpointed"]["losses"], r["plain"]["losses"]) < 1e-6
        diff = max((a - b).abs().max().item() for a, b in zip(r["checkpointed"]["params"], r["plain"]["params"]))
        assert diff < 1e-6
        plain, checkpointed = r["plain"]["saved"], r["checkpointed"]["saved"]
        assert len(plain) == len(checkpointed) == 8 and min(plain) > 0
        # the blocks keep only their inputs for backward: the saved activations shrink by a measured
        # factor (SAVED_RATIO_BOUND), on every micro-batch
        assert all(c < SAVED_RATIO_BOUND * p for c, p in zip(checkpointed, plain)), (checkpointed, plain)
