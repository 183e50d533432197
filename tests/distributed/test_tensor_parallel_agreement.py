"""Tensor parallel (issue 41, items 1-3, 5, 6): every decision the ranks of a TP group take together. The
non-finite policy agreed over data x tensor, not data alone; ``replicated_with_grad_allreduce`` refused where it
would multiply a whole gradient; the replicated weights of ranks seeded differently made equal at setup; TP
collectives seen by the hang watchdog, and a step error on one TP rank named on the others; the unsplit gather
on the device the TP group's backend takes. TP 2 on the 2-rank gloo pool, or one process."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.models.gpt import GPTLightningModule
from lightning_zero.tensor_parallel import split_dim
from tests.distributed.test_tensor_parallel import CONFIG, _loader
from tests.distributed.test_tensor_parallel_semantics import POISONED, _Poisoned
from tests.lane import pool_task
from tests.models import make_trainer
from tests.pool import GlooPool


class ChangedPerStep(pl.Callback):
    """Whether each training batch left every parameter of the module unchanged (``unchanged``, one per batch)."""

    def __init__(self) -> None:
        self.unchanged: list[bool] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
        self._before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.unchanged.append(all(torch.equal(a, b) for a, b in zip(self._before, module.parameters(), strict=True)))


def nonfinite_body(policy: str) -> dict[str, Any]:
    """fp32, TP 2 on 2 ranks, 3 steps, ``nonfinite=policy``: per step whether this rank's parameters changed, the
    skipped count, or the error the fit stopped with."""
    steps = ChangedPerStep()
    torch.manual_seed(0)
    strategy = ZeroStrategy(stage=1, tensor_parallel=2, nonfinite=policy, timeout_s=60)
    try:  # a nan in TP rank 0's rows of a column-parallel weight's gradient at batch 1
        make_trainer(strategy, devices=2, max_steps=3, callbacks=[steps]).fit(_Poisoned(0, float("nan")), _loader(1))
    except Exception as e:  # every rank's outcome is compared
        return {"error": f"{type(e).__name__}: {e}", "unchanged": steps.unchanged}
    return {"error": None, "unchanged": steps.unchanged, "skipped": strategy.nonfinite_skipped_steps}


@pytest.mark.distributed
def test_a_nan_in_one_tp_ranks_slice_skips_the_step_on_every_rank(gloo_pool: GlooPool) -> None:
    """``nonfinite="skip"``: TP rank 0 alone sees a nan in its slice at step 1; both ranks skip that step (no
    parameter changes: before the fix rank 1 applied it) and step before and after."""
    for rank, r in enumerate(gloo_pool.run("tests.distributed.test_tensor_parallel_agreement:nonfinite_body",
                                           policy="skip")):
        assert r["error"] is None, (rank, r)
        assert r["unchanged"] == [False, True, False] and r["skipped"] == 1, (rank, r)


@pytest.mark.distributed
def test_a_nan_in_one_tp_ranks_slice_raises_on_every_rank_naming_the_parameter(gloo_pool: GlooPool) -> None:
    """``nonfinite="raise"``: both TP ranks raise at step 1, naming the parameter (before the fix only rank 0
    raised; rank 1 stepped on and then waited for it)."""
    for rank, r in enumerate(gloo_pool.run("tests.distributed.test_tensor_parallel_agreement:nonfinite_body",
                                           _timeout_s=120, policy="raise")):  # before the fix: a hang
        assert r["error"] is not None and r["error"].startswith("NonFiniteGradientError: Non-finite gradient at "
                                                                "optimizer step 1"), (rank, r)
        assert f"reduced gradient is '{POISONED}'" in r["error"], (rank, r)
        assert r["unchanged"] == [False], (rank, r)


# ------------------------------------------------------------------------------- replicated_with_grad_allreduce
class _Recorded(GPTLightningModule):
    def __init__(self, config: Any = CONFIG, **kwargs: Any) -> None:
        super().__init__(config, lr=1.0, optimizer="sgd", warmup_steps=0, **kwargs)


def summed_ln_f_body() -> str:
    """The GPT at TP 2 with ``ln_f`` (on the residual stream, before the column-parallel ``lm_head``) planned
    ``replicated_with_grad_allreduce``: the error the fit stops with on this rank, or how ``ln_f`` moved."""
    from lightning_zero import TensorParallelConfig

    torch.manual_seed(0)
    module = _Recorded()
    before = module.model.ln_f.weight.detach().clone()
    plan = {**module.tensor_parallel_plan(), "model.ln_f": "replicated_with_grad_allreduce"}
    strategy = ZeroStrategy(stage=0, tensor_parallel=TensorParallelConfig(2, plan=plan))
    try:
        make_trainer(strategy, devices=2, max_steps=1).fit(module, _loader(1))
    except ValueError as e:
        return str(e)
    return f"trained: ln_f moved by {float((module.model.ln_f.weight - before).abs().max())}"


@pytest.mark.distributed
def test_summing_the_gradient_of_a_norm_on_replicated_activations_is_refused(gloo_pool: GlooPool) -> None:
    """``ln_f`` sits beside the column-parallel ``lm_head`` but acts on the replicated residual stream: summing its
    gradient over TP doubled its update (2.0000 times the normal plan's at SGD lr 1, TP 2). Its input is the same on
    both TP ranks at the first forward: refused on both ranks, before any step, with the fix."""
    for message in gloo_pool.run("tests.distributed.test_tensor_parallel_agreement:summed_ln_f_body"):
        assert message.startswith("tensor_parallel plan: 'model.ln_f' is planned 'replicated_with_grad_allreduce' "
                                  "but its input is the same on every TP rank"), message
        assert "multiply it by the TP size (2). Fix: plan it 'replicate'" in message, message


def summed_gradient_body() -> dict[str, Any]:
    """``sum_grads_over_tp`` on two Linear layers (TP 2): one applied to the same input on both ranks, one to each
    rank's own; the first gradient's check (the forward's input check bypassed, as for a module given no tensor
    argument), and the summed gradient of the second."""
    import torch.distributed as dist

    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.regions import sum_grads_over_tp

    tp = TPGroup(dist.new_group([0, 1]), 2, dist.get_rank())
    torch.manual_seed(0)
    same, own = nn.Linear(4, 3), nn.Linear(4, 3)
    sum_grads_over_tp(same, tp, "same")
    sum_grads_over_tp(own, tp, "own")
    x = torch.randn(2, 4)
    mine = x + dist.get_rank()  # this rank's own activations
    with torch.no_grad():  # the forward checks: decided here, so only the gradient's check remains
        same(mine)
        own(mine)
    out: dict[str, Any] = {}
    try:
        same(x).sum().backward()
    except ValueError as e:
        out["same"] = str(e)
    own(mine).pow(2).sum().backward()
    assert own.weight.grad is not None
    out["own"] = own.weight.grad.clone()
    out["own_local"] = 2 * (own(mine).detach().t() @ mine)  # d/dW of sum((W x + b)^2) on this rank alone
    return out


@pytest.mark.distributed
def test_a_summed_parameter_whose_gradient_is_already_whole_is_refused_at_the_first_backward(
        gloo_pool: GlooPool) -> None:
    """The first backward compares each summed parameter's gradient before the sum: the same on both ranks (its
    activations replicated) is refused naming the parameter; different (split activations) is summed."""
    a, b = gloo_pool.run("tests.distributed.test_tensor_parallel_agreement:summed_gradient_body")
    for r in (a, b):
        assert re.match(r"tensor_parallel plan: 'same' is planned 'replicated_with_grad_allreduce' but its gradient "
                        r"of 'same\.(weight|bias)' \(before the sum\) is the same on every TP rank", r["same"]), r
    torch.testing.assert_close(a["own"], a["own_local"] + b["own_local"])
    assert torch.equal(a["own"], b["own"])


# ------------------------------------------------------------------------------- replicated weights at setup
def unseeded_body(precision: str) -> dict[str, Any]:
    """TP 2, every rank's generator seeded differently before the model is built (processes nobody seeded
    alike): this rank's replicated parameters at the first step and after 2 steps, or the error."""
    import torch.distributed as dist

    first: dict[str, torch.Tensor] = {}

    class AtStart(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            first.update({n: p.detach().float().clone() for n, p in module.named_parameters()
                          if split_dim(p) is None})
            first.update({f"buffer:{n}": b.detach().float().clone() for n, b in module.named_buffers()})

    torch.manual_seed(1000 + dist.get_rank())
    module = _Recorded()
    module.register_buffer("noise", torch.randn(3))  # a replicated buffer: DDP broadcasts these too
    strategy = ZeroStrategy(stage=1, tensor_parallel=2, precision=ZeroPrecision(precision), timeout_s=60)
    try:
        make_trainer(strategy, devices=2, max_steps=2, callbacks=[AtStart()]).fit(module, _loader(1))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None, "first": first,
            "last": {n: p.detach().float().clone() for n, p in module.named_parameters() if split_dim(p) is None}}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_tp_ranks_seeded_differently_start_from_tp_rank_0s_replicated_weights(gloo_pool: GlooPool,
                                                                              precision: str) -> None:
    """Before the fix ``pos_emb`` differed by 0.073 between the TP ranks and the fit stopped at the first backward
    (telling the user to plan ``ln_f`` 'replicated_with_grad_allreduce'); now every replicated parameter (and, in
    bf16-mixed, the fp32 weight its master starts from) is TP rank 0's: bitwise equal at the start and after 2
    steps."""
    a, b = gloo_pool.run("tests.distributed.test_tensor_parallel_agreement:unseeded_body", precision=precision)
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    assert {"model.pos_emb.weight", "buffer:noise"} <= a["first"].keys() and a["first"].keys() == b["first"].keys()
    for when in ("first", "last"):
        differ = {n: float((a[when][n] - b[when][n]).abs().max()) for n in a[when]
                  if not torch.equal(a[when][n], b[when][n])}
        assert not differ, (when, differ)


# ------------------------------------------------------------------------------- the hang watchdog, step errors
def late_on_rank_1(collective: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """Run ``collective`` with rank 1 joining it 1.5 s late; its result, and where rank 0's progress record
    (what the hang watchdog publishes) said rank 0 waited 0.7 s in (empty on rank 1)."""
    import torch.distributed as dist

    from lightning_zero.core.reliability.progress_record import RECORD

    seen: list[tuple[int, str]] = []
    sampler = threading.Timer(0.7, lambda: seen.append(RECORD.current_wait()))
    if dist.get_rank() == 0:
        sampler.start()
    else:
        time.sleep(1.5)
    out = collective()
    if dist.get_rank() == 0:
        sampler.join()
    return out, seen


def blocked_body() -> dict[str, Any]:
    """A TP all-reduce rank 1 joins late: where rank 0 waited meanwhile, and after."""
    import torch.distributed as dist

    from lightning_zero.core.reliability.progress_record import RECORD
    from lightning_zero.tensor_parallel.collectives import TPGroup, reduce_from_tp

    tp = TPGroup(dist.new_group([0, 1]), 2, dist.get_rank())
    out, seen = late_on_rank_1(lambda: reduce_from_tp(torch.ones(3), tp))
    return {"sum": out.tolist(), "seen": seen, "after": RECORD.current_wait()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane(run=pool_task("tests.distributed.test_tensor_parallel_agreement:blocked_body"))  # tests/lane.py
def test_a_rank_blocked_in_a_tp_collective_is_recorded_as_waiting_in_it(lane_result: list[Any]) -> None:
    """docs/reliability.md: every collective the strategy issues is recorded. Before the fix rank 0, blocked in the
    TP all-reduce, counted as in user code (waiting number 0)."""
    a, b = lane_result
    assert a["sum"] == b["sum"] == [2.0, 2.0, 2.0]
    (seq, kind), = a["seen"]
    assert seq > 0 and kind == "tensor-parallel all_reduce", a["seen"]
    assert a["after"][0] == 0  # back in user code after it


class _RaisesOnRank1(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(CONFIG, lr=1e-2, warmup_steps=0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import torch.distributed as dist

        if batch_idx == 1 and dist.get_rank() == 1:
            raise ValueError("boom on rank 1")
        return self.loss(batch)


def step_error_body() -> dict[str, Any]:
    """TP 2 (data 1): rank 1's ``training_step`` raises at batch 1, before its forward's TP all-reduces, where rank 0
    waits for it; what each rank raised, and when (the groups' timeout is 8 s)."""
    start = time.monotonic()
    torch.manual_seed(0)
    strategy = ZeroStrategy(stage=1, tensor_parallel=2, timeout_s=8)
    try:
        make_trainer(strategy, devices=2, max_steps=3).fit(_RaisesOnRank1(), _loader(1))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "cause": repr(e.__cause__), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane(run=pool_task("tests.distributed.test_tensor_parallel_agreement:step_error_body", _timeout_s=120))
def test_a_step_error_on_one_tp_rank_is_named_on_the_other(lane_result: list[Any]) -> None:
    """With pure TP (data size 1) the step-error agreement was skipped: rank 0, inside the forward's TP all-reduce
    rank 1 never joined, got gloo's error naming no rank. Now rank 1 posts itself as the first failure and waits at
    most 5 s for the agreement; rank 0's broken collective (here the groups' 8 s timeout: the pool's processes stay;
    in a launched job rank 1's exit closes the connection at once) raises the agreement's message naming rank 1
    by its TP coordinate, chained to gloo's error (Note [first step error])."""
    a, b = lane_result
    assert b["error"] == "ValueError: boom on rank 1", b
    assert a["error"] is not None and a["error"].startswith(
        "StepFailedElsewhere: training_step raised on rank(s) [1] (rank 1: tensor-parallel rank 1); stopping this "
        "rank too"), a
    assert "RuntimeError" in a["cause"], a  # gloo's, kept as the cause


# ------------------------------------------------------------------------------- the unsplit gather's device
def test_the_unsplit_gather_runs_on_the_device_of_the_tp_groups_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a fit Lightning's teardown leaves the split module on the CPU; ``save_checkpoint`` /
    ``lightning_module_state_dict()`` all-gather its slices over the TP group, which on NCCL takes GPU tensors
    only. The group's device is the current GPU on NCCL (the CPU on gloo), and the gather hands the collective
    tensors on that device (here ``meta`` stands for it: no GPU), not the module's CPU tensors.
    (tests/unit/test_cuda.py runs it on NCCL.)"""
    import torch.distributed as dist

    from lightning_zero.core.mesh import ParallelDims
    from lightning_zero.tensor_parallel.checkpoint import TensorParallelCheckpoint
    from lightning_zero.tensor_parallel.collectives import TPGroup
    from lightning_zero.tensor_parallel.layers import ColumnParallelLinear

    group = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl" if g is group else "gloo")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tp = TPGroup(group, 2, 0)  # type: ignore[arg-type]
    assert tp.device == torch.device("cuda", 0)
    assert TPGroup(object(), 2, 0).device == torch.device("cpu")  # type: ignore[arg-type]

    class Seen(Exception):
        pass

    devices: list[set[str]] = []

    def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, **_: Any) -> None:
        devices.append({t.device.type for t in (*outputs, tensor)})
        raise Seen

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(TPGroup, "device", property(lambda self: torch.device("meta")))
    layer = nn.Sequential(ColumnParallelLinear(nn.Linear(4, 8), tp, {}, "0"))
    checkpoint = TensorParallelCheckpoint(tp, ParallelDims(2, tensor=2), 0)
    with pytest.raises(Seen):
        checkpoint.unsplit_state_dict(layer.state_dict(), layer)
    assert devices == [{"meta"}], devices
