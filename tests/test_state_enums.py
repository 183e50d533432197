"""The state enums of issue 30: the ZeRO stage with its predicates, the offload device, the non-finite policy:
strings and ints from users converted at the boundary, bad values refused with the valid ones."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from lightning_zero import NonFinitePolicy, OffloadConfig, OffloadDevice, ZeroConfig, ZeroStage
from lightning_zero.core.zero.memory import model_state_formula

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"


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
    with pytest.raises(ValueError, match=r"`param_device` must be one of 'none', 'cpu', 'nvme', got 'disk'"):
        OffloadConfig(optimizer_device="cpu", param_device="disk")  # type: ignore[arg-type]


def test_the_hydra_schema_uses_the_core_offload_enum() -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from lightning_zero.config import schema

    assert schema.OffloadDevice is OffloadDevice
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
    with pytest.raises(ValueError, match=r"`nonfinite` must be one of 'off', 'skip', 'raise', got 'warn'"):
        ZeroConfig(nonfinite="warn")
