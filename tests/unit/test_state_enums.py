"""The state enums of issue 30: the ZeRO stage with its predicates, the offload device, the non-finite policy
(strings and ints from users converted at the boundary, bad values refused with the valid ones), the engine's step
state machine and the reducer's reduction mode."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zero import NonFinitePolicy, OffloadConfig, OffloadDevice, ZeroConfig, ZeroStage
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.memory import model_state_formula
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.engine_step import StepState, StepStateError
from lightning_zero.core.zero.grad_reducer import ReductionMode

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"


@pytest.mark.parametrize(("number", "optimizer", "gradients", "parameters"), [
    (0, False, False, False), (1, True, False, False), (2, True, True, False), (3, True, True, True),
])
def test_each_stage_answers_what_it_shards(number: int, optimizer: bool, gradients: bool, parameters: bool) -> None:
    stage = ZeroStage(number)
    assert stage.shards_optimizer is optimizer
    assert stage.shards_gradients is gradients
    assert stage.shards_parameters is parameters


def test_an_int_stage_becomes_the_enum_and_still_reads_as_its_number() -> None:
    stage = ZeroConfig(stage=3).stage
    assert stage is ZeroStage.PARAMETERS
    assert stage == 3 and stage in (3,)
    assert f"zero{stage}" == "zero3" and str(stage) == "3" and json.dumps({"stage": stage}) == '{"stage": 3}'
    assert ZeroConfig().stage is ZeroStage.GRADIENTS
    assert ZeroConfig.from_kwargs(1, {}).stage is ZeroStage.OPTIMIZER_STATE


@pytest.mark.parametrize("bad", [4, -1, True, 2.0, "two", None])
def test_a_bad_stage_is_refused_with_the_valid_ones(bad: object) -> None:
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3"):
        ZeroConfig(stage=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3"):
        model_state_formula(bad, 1e6, 4)  # type: ignore[arg-type]


def test_the_strategy_takes_an_int_stage() -> None:
    from lightning_zero import ZeroStrategy

    assert ZeroStrategy(stage=1).zero_config.stage is ZeroStage.OPTIMIZER_STATE


def _stage_number_comparisons(source: str, where: str) -> list[str]:
    """``stage >= 2`` and the like: a ZeRO stage compared with a number instead of asking a predicate."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        stage = any((isinstance(s, ast.Name) and s.id == "stage")
                    or (isinstance(s, ast.Attribute) and s.attr == "stage"
                        and ast.unparse(s.value).split(".")[-1] in ("config", "zero_config", "zero"))
                    for s in sides)
        number = any(isinstance(s, ast.Tuple) or (isinstance(s, ast.Constant) and type(s.value) is int) for s in sides)
        if stage and number:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_compares_the_zero_stage_with_a_number() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             for hit in _stage_number_comparisons(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "ask ZeroStage's predicates (shards_optimizer / shards_gradients / shards_parameters):\n" + \
        "\n".join(found)


def test_the_scan_finds_a_stage_comparison() -> None:
    sample = "def f(config, stage, mesh):\n    return config.stage >= 2 or stage in (0, 1) or mesh.stage == 0\n"
    assert len(_stage_number_comparisons(sample, "sample")) == 2  # the pipeline stage index is not a ZeRO stage


def test_offload_devices_from_strings_are_the_enum_and_read_as_the_strings() -> None:
    offload = OffloadConfig(optimizer_device="nvme", param_device="nvme", nvme_path="/tmp")
    assert offload.optimizer_device is OffloadDevice.nvme and offload.param_device is OffloadDevice.nvme
    assert offload.name == "param_nvme" and f"{offload.optimizer_device}" == "nvme" and offload.uses_nvme
    assert OffloadConfig().name == "none" and not OffloadConfig().enabled
    with pytest.raises(ValueError, match=r"`param_device` must be 'none', 'cpu' or 'nvme', got 'disk'"):
        OffloadConfig(optimizer_device="cpu", param_device="disk")  # type: ignore[arg-type]


def test_the_hydra_schema_uses_the_core_offload_enum() -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from lightning_zero.config import schema

    assert {f.name: f.type for f in dataclasses.fields(schema.OffloadSchema)}["optimizer_device"] is OffloadDevice
    node = OmegaConf.merge(OmegaConf.structured(schema.OffloadSchema), {"optimizer_device": "cpu"})
    assert node.optimizer_device is OffloadDevice.cpu
    assert "optimizer_device: cpu" in OmegaConf.to_yaml(node)
    with pytest.raises(ValidationError, match="none, cpu, nvme"):
        OmegaConf.merge(node, {"param_device": "disk"})


@pytest.mark.parametrize(("given", "policy"), [("off", NonFinitePolicy.OFF), ("skip", NonFinitePolicy.SKIP),
                                               ("raise", NonFinitePolicy.RAISE)])
def test_the_nonfinite_policy_from_a_string(given: str, policy: NonFinitePolicy) -> None:
    config = ZeroConfig(nonfinite=given)
    assert config.nonfinite is policy and config.nonfinite == given and repr(config.nonfinite) == repr(given)
    with pytest.raises(ValueError, match=r"`nonfinite` must be 'off', 'skip' or 'raise', got 'warn'"):
        ZeroConfig(nonfinite="warn")


def _engine(stage: int) -> tuple[ZeroEngine, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=stage, param_persistence_threshold=0)
    return ZeroEngine(model, optimizer, config, DataParallelComm()), optimizer


def _backward(engine: ZeroEngine) -> None:
    engine.before_backward()
    engine.module(torch.ones(4, 6)).pow(2).mean().backward()
    engine.finish_backward()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_step_walks_idle_backward_reduced_prepared_idle(stage: int) -> None:
    engine, optimizer = _engine(stage)
    seen = [engine.preparation.state]
    engine.before_backward()
    seen.append(engine.preparation.state)
    engine.module(torch.ones(4, 6)).pow(2).mean().backward()
    engine.finish_backward()
    seen.append(engine.preparation.state)
    assert engine.prepare_step() is False
    seen.append(engine.preparation.state)
    optimizer.step()
    engine.after_step()
    seen.append(engine.preparation.state)
    assert seen == [StepState.IDLE, StepState.BACKWARD, StepState.REDUCED, StepState.PREPARED, StepState.IDLE]


@pytest.mark.parametrize("stage", [0, 2])
def test_preparing_a_step_from_a_no_sync_backward_names_both_states(stage: int) -> None:
    engine, _ = _engine(stage)
    with engine.no_sync():
        _backward(engine)
    assert engine.preparation.state is StepState.ACCUMULATED
    with pytest.raises(StepStateError, match="ACCUMULATED -> PREPARED is not a valid transition"):
        engine.prepare_step()
    with pytest.raises(StepStateError, match="The optimizer step in step state ACCUMULATED"):
        engine.after_step()
    _backward(engine)  # the boundary backward: now the step may go on
    assert engine.preparation.state is StepState.REDUCED and engine.prepare_step() is False


def test_a_backward_after_prepare_step_is_refused_and_a_skipped_step_stays_skipped() -> None:
    engine, _ = _engine(1)
    _backward(engine)
    engine.prepare_step()
    with pytest.raises(StepStateError, match="PREPARED -> BACKWARD is not a valid transition"):
        engine.before_backward()
    engine.zero_grad()
    _backward(engine)
    engine.skip_step()
    _backward(engine)  # e.g. a closure evaluated again: the step stays skipped
    assert engine.step_skipped and engine.preparation.state is StepState.SKIPPED
    assert engine.prepare_step() is True
    engine.after_step()
    assert engine.preparation.state is StepState.IDLE and not engine.step_skipped


def test_the_reduction_mode_of_no_sync_and_a_pipeline_window() -> None:
    engine, _ = _engine(0)
    reducer = engine.reducer
    assert reducer.mode is ReductionMode.IMMEDIATE and reducer.sync and not reducer.deferred
    with engine.no_sync():
        assert reducer.mode is ReductionMode.AT_BOUNDARY and not reducer.sync
        with engine.deferred_reduction():
            engine.module(torch.ones(4, 6)).pow(2).mean().backward()
            assert reducer.mode is ReductionMode.PIPELINE_DEFERRED and reducer.deferred and not reducer.sync
        assert reducer.deferred  # the window stays open until its gradients are reduced
        engine.reduce_deferred()
        assert reducer.mode is ReductionMode.AT_BOUNDARY  # inside no_sync: a micro-step, accumulated
        assert engine.preparation.state is StepState.ACCUMULATED
    assert reducer.mode is ReductionMode.IMMEDIATE
    with pytest.raises(ValueError, match=r"opened with defer\(\)"):
        reducer.set_boundary_mode(ReductionMode.PIPELINE_DEFERRED)
