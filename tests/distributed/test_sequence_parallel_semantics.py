"""Sequence parallelism (issue 41, items 1, 4, 5) beyond parity at dropout 0, SP 2 on the 2-rank gloo pool: each
rank's dropout masks are its own (attention heads, embedding and residual tokens), the split run is the unsplit
model with the masks it drew, and activation checkpointing recomputes them exactly; the non-finite policy agreed
by both ranks; the all-to-all seen by the hang watchdog, and a step error on one rank named on the other."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPTConfig, GPTLightningModule
from lightning_zero.sequence_parallel import SequenceGroup
from tests.lane import pool_task
from tests.models import make_trainer
from tests.pool import GlooPool

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32, dropout=0.2)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _world() -> SequenceGroup:
    import torch.distributed as dist

    return SequenceGroup.of(dist.new_group([0, 1]))


class _Replay(nn.Module):
    """A dropout that records the masks it draws (``masks``), or, given ``replay``, applies those instead."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.masks, self.replay = p, [], None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.replay.pop(0) if self.replay is not None else F.dropout(torch.ones_like(x), self.p, True)
        if self.replay is None:
            self.masks.append(mask)
        return x * mask


def _replayable() -> tuple[GPTLightningModule, list[_Replay]]:
    """The GPT (dropout 0.2, seed 0) with its embedding and residual dropouts recording or replaying their masks
    and no attention dropout (SDPA's masks cannot be replayed; they are checked on their own)."""
    torch.manual_seed(0)
    module = GPTLightningModule(CONFIG, warmup_steps=0)
    gpt = module.model
    drops = [_Replay(CONFIG.dropout) for _ in range(1 + 2 * CONFIG.n_layer)]
    gpt.drop = drops[0]
    for i, block in enumerate(gpt.blocks):
        block.attn.dropout = 0.0
        block.attn.resid_drop, block.mlp.drop = drops[1 + 2 * i], drops[2 + 2 * i]
    return module, drops


def masks_body() -> dict[str, Any]:
    """SP 2: the attention masks this rank drew for its heads, its embedding / residual masks, and the split run
    (loss and summed gradients) against the unsplit GPT replaying every rank's masks at their tokens."""
    import torch.distributed as dist

    sg = _world()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 4, 2, generator=gen) for _ in range(3))  # [b, heads, seq / P, d]
    drawn: list[torch.Tensor] = []

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        drawn.append(F.dropout(torch.ones_like(q), 0.5, True))  # this rank's heads, the whole sequence
        return q

    torch.manual_seed(7)  # the same default stream on both ranks, as after seed_everything
    sg.attention(q, k, v, attention)

    module, drops = _replayable()
    module.configure_sequence_parallel(sg)
    torch.manual_seed(7)
    batch = _batch()
    loss = module.loss(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    for g in grads.values():  # ZeRO averages over data x sequence: each rank holds its share of P x dL/dw
        dist.all_reduce(g)
        g /= sg.size
    masks = [d.masks[0] for d in drops]
    every = [[torch.empty_like(m) for _ in range(sg.size)] for m in masks]
    for out, m in zip(every, masks):
        dist.all_gather(out, m)
    reference, replay = _replayable()
    for d, parts in zip(replay, every):
        d.replay = [torch.cat(parts, dim=1)]  # the whole sequence's masks: rank r's tokens at r * T/P
    whole = reference.loss(batch)
    whole.backward()
    return {"attention": drawn[0], "masks": masks, "loss": float(loss), "whole": float(whole),
            "grad_diff": max(float((g - reference.get_parameter(n).grad).abs().max()) for n, g in grads.items())}


@pytest.mark.distributed
def test_each_sp_rank_draws_its_own_masks_and_the_split_run_is_the_unsplit_model_with_them(
        gloo_pool: GlooPool) -> None:
    """Before the fix both ranks drew the same attention mask for their heads (head j and head j + H/P shared one)
    and the same token masks (token i and i + T/P). Now they differ, and at dropout 0.2 the split run's loss and
    gradients are the unsplit GPT's with those masks placed at each rank's tokens (within 1e-6)."""
    a, b = gloo_pool.run("tests.distributed.test_sequence_parallel_semantics:masks_body")
    assert a["attention"].shape == (1, 2, 8, 2) and not torch.equal(a["attention"], b["attention"])
    assert len(a["masks"]) == 1 + 2 * CONFIG.n_layer
    for i, (ma, mb) in enumerate(zip(a["masks"], b["masks"], strict=True)):
        assert 0 < int((ma == 0).sum()) < ma.numel(), i  # dropout on
        assert not torch.equal(ma, mb), i  # rank 1's tokens do not repeat rank 0's masks
    for r in (a, b):
        assert r["loss"] == pytest.approx(r["whole"], rel=1e-6), r
        assert r["grad_diff"] < 1e-6, r


def recompute_body() -> dict[str, Any]:
    """SP 2, the GPT at dropout 0.2 (attention dropout included): loss and gradients of one step with every block
    under activation checkpointing (ZeRO's ``activation_checkpointing``) and without, from one seed."""
    from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing

    sg = _world()
    out: dict[str, Any] = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        module = GPTLightningModule(CONFIG, warmup_steps=0)
        module.configure_sequence_parallel(sg)
        if recompute:
            apply_activation_checkpointing(list(module.model.blocks))
        torch.manual_seed(11)
        loss = module.loss(_batch())
        loss.backward()
        out[str(recompute)] = {"loss": float(loss), "state": torch.get_rng_state(),
                               "grads": [p.grad.clone() for p in module.parameters()]}
    return out


@pytest.mark.distributed
def test_activation_checkpointing_recomputes_each_sp_ranks_masks_exactly(gloo_pool: GlooPool) -> None:
    """The recompute in backward draws the forward's masks: loss, gradients and the default stream after are
    bitwise those of the run without checkpointing."""
    for r in gloo_pool.run("tests.distributed.test_sequence_parallel_semantics:recompute_body"):
        plain, recomputed = r["False"], r["True"]
        assert plain["loss"] == recomputed["loss"]
        assert torch.equal(plain["state"], recomputed["state"])
        assert all(torch.equal(g, h) for g, h in zip(plain["grads"], recomputed["grads"], strict=True))


# ------------------------------------------------------------------------------- the non-finite policy at SP 2
def nonfinite_body() -> dict[str, Any]:
    """SP 2, ``nonfinite="skip"``, 3 steps, a nan in SP rank 0's gradient at batch 1: per step whether this rank's
    parameters changed, and the count."""
    from tests.distributed.test_tensor_parallel_agreement import ChangedPerStep
    from tests.distributed.test_tensor_parallel_semantics import _Poisoned

    steps = ChangedPerStep()
    torch.manual_seed(0)
    strategy = ZeroStrategy(stage=2, sequence_parallel=2, nonfinite="skip")
    loader = torch.utils.data.DataLoader(list(zip(*_batch())) * 3, batch_size=2)
    make_trainer(strategy, devices=2, max_steps=3, callbacks=[steps]).fit(
        _Poisoned(0, float("nan"), replace(CONFIG, dropout=0.0)), loader)
    return {"unchanged": steps.unchanged, "skipped": strategy.nonfinite_skipped_steps}


@pytest.mark.distributed
def test_a_nan_on_one_sp_rank_skips_the_step_on_both(gloo_pool: GlooPool) -> None:
    """The sequence group is inside ZeRO's data x sequence group: both ranks skip step 1, and step 0 and 2."""
    for rank, r in enumerate(gloo_pool.run("tests.distributed.test_sequence_parallel_semantics:nonfinite_body")):
        assert r["unchanged"] == [False, True, False] and r["skipped"] == 1, (rank, r)


# ------------------------------------------------------------------------------- the hang watchdog, step errors
def blocked_body() -> dict[str, Any]:
    """The all-to-all rank 1 joins late (``late_on_rank_1``): where rank 0's progress record says it waited."""
    from lightning_zero.sequence_parallel import scatter_heads
    from tests.distributed.test_tensor_parallel_agreement import late_on_rank_1

    sg = _world()
    out, seen = late_on_rank_1(lambda: scatter_heads(torch.ones(1, 4, 2, 3), sg.group))
    return {"shape": tuple(out.shape), "seen": seen}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane(run=pool_task("tests.distributed.test_sequence_parallel_semantics:blocked_body"))  # tests/lane.py
def test_a_rank_blocked_in_the_all_to_all_is_recorded_as_waiting_in_it(lane_result: list[Any]) -> None:
    """Before the fix rank 0, blocked in the all-to-all, counted as in user code (waiting number 0)."""
    a, b = lane_result
    assert a["shape"] == b["shape"] == (1, 2, 4, 3)
    (seq, kind), = a["seen"]
    assert seq > 0 and kind == "sequence-parallel all_to_all", a["seen"]


class _RaisesOnRank1(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(replace(CONFIG, dropout=0.0), lr=1e-2, warmup_steps=0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import torch.distributed as dist

        if batch_idx == 1 and dist.get_rank() == 1:
            raise ValueError("boom on rank 1")
        return self.loss(batch)


def step_error_body() -> str:
    """SP 2: rank 1's ``training_step`` raises at batch 1, before the all-to-all rank 0 waits in; what it raised."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(list(zip(*_batch())) * 3, batch_size=2)
    try:
        make_trainer(ZeroStrategy(stage=1, sequence_parallel=2, timeout_s=8), devices=2,
                     max_steps=3).fit(_RaisesOnRank1(), loader)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane(run=pool_task("tests.distributed.test_sequence_parallel_semantics:step_error_body", _timeout_s=120))
def test_a_step_error_on_one_sp_rank_is_named_on_the_other(lane_result: list[Any]) -> None:
    """Rank 0 waits in the all-to-all rank 1 never joins; once it breaks, it names rank 1 by its sequence
    coordinate (Note [first step error])."""
    a, b = lane_result
    assert b == "ValueError: boom on rank 1", b
    assert a.startswith("StepFailedElsewhere: training_step raised on rank(s) [1] (rank 1: sequence-parallel "
                        "rank 1)"), a
