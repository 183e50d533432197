"""Single-rank (no process group) tests of ZeroEngine semantics that the strategy relies on:
every accepted (stage x dtype policy) trains, loading keeps fp32 masters exact, gathering is
undone after an exception, a parameter unfrozen after setup is caught, clip-by-value and the
refusals. Each names the defect of issue 15 it guards."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine

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
    return ZeroEngine(model, optimizer, zero, DataParallelComm(), dtypes=dtypes), optimizer


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


MIXED = [(BF16, BF16), (F16, F16), (BF16, F32)]  # (param dtype, grad accumulation dtype), fp32 masters


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("param", "accum"), MIXED, ids=lambda v: str(v).replace("torch.", ""))
def test_load_full_state_dict_gives_masters_the_fp32_values(stage: int, param: torch.dtype,
                                                            accum: torch.dtype) -> None:
    """Issue 15 defect 2: loading under mixed precision rounded the fp32 master through the 16-bit
    parameter (1.001 became 1.0 in bf16). The master must hold the loaded values exactly."""
    from lightning_zero.core.zero.loading import load_full_state_dict

    engine, _ = _engine(_model(param), stage, DtypePolicy(param_dtype=param, master_dtype=F32, accum_dtype=accum))
    torch.manual_seed(3)
    loaded = {n: 1.001 + 1e-4 * torch.randn(p.shape) for n, p in _model().named_parameters()}
    assert any(not torch.equal(v, v.to(param).float()) for v in loaded.values())  # 16 bits would round these
    load_full_state_dict(engine, loaded)
    names = {p: n for n, p in engine.module.named_parameters()}
    for p, master in engine.full_master_params().items():
        assert master.dtype == F32
        torch.testing.assert_close(master, loaded[names[p]], rtol=0, atol=0, msg=names[p])
    full = engine.full_state_dict()
    for name, value in loaded.items():
        torch.testing.assert_close(full[name], value.to(param), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("param", [F32, BF16, F16], ids=str)
def test_gathered_parameters_modifies_params_and_masters(stage: int, param: torch.dtype) -> None:
    """gathered_parameters under bf16 / fp16 (issue 15, untested): whole inside, the modification
    lands in the parameters and in the fp32 master (the value the 16-bit parameter holds)."""
    from lightning_zero import gathered_parameters

    master = F32
    engine, _ = _engine(_model(param), stage, DtypePolicy(param_dtype=param, master_dtype=master))
    weight = engine.module[0].weight
    with gathered_parameters(engine.module.parameters(), modifier_rank=0):
        assert weight.shape == (8, 6)
        with torch.no_grad():
            weight.fill_(0.3)
    expected = torch.full((8, 6), 0.3, dtype=param)
    torch.testing.assert_close(engine.full_state_dict()["0.weight"], expected, rtol=0, atol=0)
    torch.testing.assert_close(engine.full_master_params()[weight], expected.to(master), rtol=0, atol=0)


def test_an_exception_inside_gathered_parameters_releases_the_units() -> None:
    """Issue 15 defect 4: without a try/finally the units stayed gathered after an exception."""
    from lightning_zero import gathered_parameters
    from lightning_zero.core.stage3.sharded_unit import UnitState

    engine, _ = _engine(_model(), 3, DtypePolicy())
    assert engine.runtime is not None and engine.runtime.live_numel == 0
    assert {u.state for u in engine.units if not u.persistent} == {UnitState.SHARDED}
    with pytest.raises(KeyError, match="boom"), gathered_parameters(engine.module.parameters()):
        assert engine.runtime.live_numel > 0
        raise KeyError("boom")
    assert engine.runtime.live_numel == 0
    assert {u.state for u in engine.units if not u.persistent} == {UnitState.SHARDED}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_unfrozen_after_setup_is_refused_by_name(stage: int) -> None:
    """Issue 15 defect 5: a parameter frozen at setup and unfrozen later was stepped with an unreduced
    gradient (stage 0) or silently not updated (stage >= 1)."""
    model = _model()
    model[0].requires_grad_(False)
    engine, optimizer = _engine(model, stage, DtypePolicy())
    model[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"\['0.weight', '0.bias'\] were frozen .* at setup .*fit again"):
        _step(engine, optimizer, _batch(F32))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("param", [F32, BF16], ids=str)
def test_clip_by_value_through_the_engine(stage: int, param: torch.dtype) -> None:
    """Clip-by-value (issue 15, untested): the optimizer steps on gradients clamped to the value."""
    clip = 1e-3
    plain = _model(param)
    x = _batch(param)
    plain(x).float().pow(2).mean().backward()
    grads = [p.grad.float() for p in plain.parameters()]
    assert max(g.abs().max() for g in grads) > 10 * clip  # the clip bites
    engine, optimizer = _engine(_model(param), stage, DtypePolicy(param_dtype=param, master_dtype=F32))
    engine.zero_grad()
    engine.before_backward()
    engine.module(x).float().pow(2).mean().backward()
    engine.finish_backward()
    engine.before_step()
    engine.prepare_step()
    engine.clip_grad_value_(clip)
    optimizer.step()
    engine.after_step()
    full = engine.full_state_dict()
    for (name, p), g in zip(plain.named_parameters(), grads):
        expected = p.detach().float().add(g.to(param).float().clamp(-clip, clip), alpha=-0.1).to(param)
        torch.testing.assert_close(full[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_add_param_group_after_setup_is_refused(stage: int) -> None:
    model = _model()
    extra = nn.Parameter(torch.zeros(3))
    engine, optimizer = _engine(model, stage, DtypePolicy())
    optimizer.add_param_group({"params": [extra]})
    with pytest.raises(NotImplementedError, match=r"add_param_group.*configure_optimizers"):
        _step(engine, optimizer, _batch(F32))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_backward_the_engine_did_not_finish_is_refused(stage: int) -> None:
    """A plain ``loss.backward()`` the strategy never finished (manual optimization without
    ``manual_backward``): gradients were not reduced, so the step is refused."""
    engine, _ = _engine(_model(), stage, DtypePolicy())
    engine.zero_grad()
    engine.before_backward()
    engine.module(_batch(F32)).pow(2).mean().backward()  # no finish_backward
    with pytest.raises(RuntimeError, match=r"call `self.manual_backward\(loss\)` instead of `loss.backward\(\)`"):
        engine.before_step()


def test_an_engine_refuses_a_comm_built_with_another_collective_than_its_config() -> None:
    """The engine takes its comm from the caller (the strategy's mesh, or ``DataParallelComm()``) and makes none:
    ``ZeroConfig``'s collective must be the comm's, else the setting would do nothing."""
    model = nn.Linear(4, 2)
    config = ZeroConfig(stage=2, collective="all_reduce")
    with pytest.raises(ValueError, match=r"collective='all_reduce'.*DataParallelComm"):
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config, DataParallelComm())
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config,
                        DataParallelComm(collective="all_reduce"))
    assert engine.comm.use_all_reduce
