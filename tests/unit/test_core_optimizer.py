"""Single-rank tests of the sharded optimizer (no process group): pieces, full state, reload."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero import optimizer as zero_optimizer
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.optimizer_state import full_optimizer_state, load_full_optimizer_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(17, 31), nn.Tanh(), nn.Linear(31, 5))


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine | None, n: int) -> None:
    torch.manual_seed(1)
    for _ in range(n):
        loss = model(torch.randn(8, 17)).pow(2).mean()
        if engine is not None:
            engine.before_backward()
        loss.backward()
        if engine is not None:
            engine.finish_backward()
            engine.before_step()
        optimizer.step()
        if engine is not None:
            engine.after_step()
        else:
            optimizer.zero_grad()


@pytest.fixture
def small_pieces(monkeypatch) -> int:
    monkeypatch.setattr(zero_optimizer, "MASTER_PIECE_NUMEL", 50)
    return 50


@pytest.mark.parametrize("stage", [1, 2])
def test_pieces_step_like_the_whole_tensors(small_pieces: int, stage: int) -> None:
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _steps(plain, plain_opt, None, 4)

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=64), DataParallelComm())
    assert len(opt.param_groups[0]["params"]) == -(-engine.groups[0].shard_numel // small_pieces) > 10
    _steps(model, opt, engine, 4)
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    # the gathered state is torch's per-parameter format and equals the plain optimizer's
    full = full_optimizer_state(engine.sharded, engine.comm)
    ref = plain_opt.state_dict()
    assert sorted(full["state"]) == sorted(ref["state"])
    for i, st in ref["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(full["state"][i][key], value, rtol=0, atol=1e-6)

    # reloading into a fresh engine and stepping on equals the plain optimizer stepping on
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    engine2 = ZeroEngine(model2, opt2, ZeroConfig(stage=stage), DataParallelComm())
    load_full_optimizer_state(engine2.sharded, copy.deepcopy(full))
    steps = [opt2.state[p]["step"] for p in opt2.param_groups[0]["params"]]
    assert len({id(s) for s in steps}) == len(steps)  # each piece owns its step counter
    _steps(model2, opt2, engine2, 2)
    _steps(plain, plain_opt, None, 2)
    for a, b in zip(model2.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_detach_restores_a_plain_optimizer_with_the_full_state(small_pieces: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2), DataParallelComm())
    _steps(model, opt, engine, 3)
    engine.detach()
    assert opt.param_groups[0]["params"] == list(model.parameters())
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())
