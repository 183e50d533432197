"""Single-rank (no process group) tests of ZeroEngine semantics that the strategy relies on:
every accepted (stage x dtype policy) trains, loading keeps fp32 masters exact, gathering is
undone after an exception, a parameter unfrozen after setup is caught, clip-by-value and the
refusals. Each names the defect of issue 15 it guards."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_zero.core.config import DtypePolicy, ZeroConfig
from lightning_zero.core.engine import ZeroEngine

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _model(dtype: torch.dtype = F32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(dtype)


def _engine(model: nn.Module, stage: int, dtypes: DtypePolicy, lr: float = 0.1,
            **config: object) -> tuple[ZeroEngine, torch.optim.Optimizer]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0, **config)  # type: ignore[arg-type]
    return ZeroEngine(model, optimizer, zero, dtypes=dtypes), optimizer


def _step(engine: ZeroEngine, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    engine.zero_grad()
    engine.before_backward()
    engine.module(x).float().pow(2).mean().backward()
    engine.finish_backward()
    engine.before_step()
    skipped = engine.prepare_step()
    assert not skipped
    optimizer.step()
    engine.after_step()


# (param, master, accum): the policies the precision plugin builds (fp32, bf16-mixed, fp16-mixed,
# bf16-true) with every grad_accum_dtype the config accepts
POLICIES = [(F32, F32, a) for a in (F32, BF16, F16)] + [(BF16, F32, a) for a in (F32, BF16)] + \
    [(F16, F32, a) for a in (F32, F16)] + [(BF16, BF16, a) for a in (F32, BF16)]


@pytest.mark.parametrize(("stage", "policy"), list(itertools.product([0, 1, 2, 3], POLICIES)),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_every_stage_and_dtype_policy_trains(stage: int, policy: tuple[torch.dtype, ...]) -> None:
    """Issue 15 defect 1: stage 0 with grad_accum_dtype != param dtype (no separate master) never
    changed the parameters. Expected: one SGD step on the master, worked out by hand."""
    param, master, accum = policy
    plain = _model(param)
    x = _batch(param)
    plain(x).float().pow(2).mean().backward()
    expected = {n: p.detach().to(master).add(p.grad.to(accum).to(master), alpha=-0.1).to(param)
                for n, p in plain.named_parameters()}  # SGD's update, on the master
    model = _model(param)
    engine, optimizer = _engine(model, stage, DtypePolicy(param_dtype=param, master_dtype=master, accum_dtype=accum))
    _step(engine, optimizer, x)
    full = engine.full_state_dict()
    for name, value in expected.items():
        assert not torch.equal(full[name], _model(param).state_dict()[name]), f"{name} did not change"
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=f"{name}")
