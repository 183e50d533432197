"""The settings tree: each rule across its nodes is written once (its message and its condition), and every route in
(keyword arguments, Hydra, DeepSpeed JSON, the engine itself) refuses a broken rule with that one message, named
as the route's users write the keys (Note [one rule, many spellings] in core/settings/rules.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.config import validate_config
from lightning_zero.config.run.launch import compose_config
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings import (
    RULES,
    ExpertParallelConfig,
    OffloadConfig,
    ParallelSettings,
    PipelineConfig,
    Settings,
    TensorParallelConfig,
    ZeroConfig,
    check_settings,
    settings_problems,
)
from lightning_zero.core.settings import rules as rules_module
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.deepspeed.config import json_keys, parse_deepspeed_config
from lightning_zero.lightning.arguments import KEYWORDS

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"

# one settings tree that breaks each rule (and only that rule), by the rule's phrase
BROKEN = {
    rules_module.PARAM_NEEDS_STAGE_3: Settings(ZeroConfig(stage=2), OffloadConfig("cpu", "cpu")),
    rules_module.PARAM_MOVES_OPTIMIZER: Settings(ZeroConfig(stage=3), OffloadConfig("none", "cpu")),
    rules_module.OPTIMIZER_NEEDS_SHARDS: Settings(ZeroConfig(stage=0), OffloadConfig("cpu")),
    rules_module.NVME_NEEDS_PATH: Settings(ZeroConfig(stage=2), OffloadConfig("nvme")),
    rules_module.SEQUENCE_IN_PIPELINE: Settings(parallel=ParallelSettings(PipelineConfig(stages=2), sequence=2)),
    rules_module.SEQUENCE_WITH_TENSOR: Settings(parallel=ParallelSettings(tensor=TensorParallelConfig(2), sequence=2)),
    rules_module.EXPERT_ALONE: Settings(parallel=ParallelSettings(tensor=TensorParallelConfig(2),
                                                                 expert=ExpertParallelConfig(2))),
    rules_module.EXPERT_SHARDED_CHECKPOINTS: Settings(parallel=ParallelSettings(expert=ExpertParallelConfig(2)),
                                                      checkpoint_format="sharded"),
    rules_module.MICRO_BATCH_REDUCTION_NEEDS_SHARDS: Settings(
        ZeroConfig(stage=1), parallel=ParallelSettings(PipelineConfig(stages=2, reduce_per_micro_batch=True))),
}


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_rule_has_a_broken_example_that_breaks_it_alone() -> None:
    assert sorted(BROKEN) == sorted(r.phrase for r in RULES)
    for phrase, settings in BROKEN.items():
        problems = settings_problems(settings)
        assert len(problems) == 1 and phrase in problems[0], (phrase, problems)
    assert settings_problems(Settings()) == []


def test_each_rule_message_is_written_once_in_the_package() -> None:
    """A rule's phrase is a literal of rules.py alone: no route, node or mechanism words it again."""
    phrases = [r.phrase for r in RULES]
    assert len(set(phrases)) == len(phrases)
    for phrase in phrases:
        found = {p.relative_to(PACKAGE).as_posix(): text.count(phrase) for p, text in _sources().items()
                 if phrase in text}
        assert found == {"core/settings/rules.py": 1}, (phrase, found)


def _conditions_naming(names: set[str], tree: ast.AST) -> list[int]:
    """Lines of the conjunctions (``a and b``: a rule's condition) that read every attribute of ``names``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            read = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if names <= read:
                out.append(node.lineno)
    return out


@pytest.mark.parametrize("names", [{"param_device", "optimizer_device"}, {"param_device", "shards_parameters"},
                                   {"optimizer_device", "shards_optimizer"}, {"uses_nvme", "nvme_path"}],
                         ids=lambda n: "+".join(sorted(n)))
def test_each_offload_rule_condition_is_written_once(names: set[str]) -> None:
    """The conditions tying the offload devices to each other, to the stage or to the swap directory are
    rules.py's alone (before the settings tree each was tested in the offload node, Hydra's validation and the
    DeepSpeed JSON's parser)."""
    found = {p.relative_to(PACKAGE).as_posix(): lines for p, text in _sources().items()
             if (lines := _conditions_naming(names, ast.parse(text)))}
    assert list(found) == ["core/settings/rules.py"], found


def test_every_route_refuses_a_broken_rule_with_its_one_message_in_its_own_keys(tmp_path: Path) -> None:
    phrase = rules_module.PARAM_MOVES_OPTIMIZER
    with pytest.raises(ValueError, match=rf"offload_param='cpu' {phrase}. Fix: also set offload_optimizer='cpu'"):
        ZeroStrategy(stage=3, offload=OffloadConfig("none", "cpu"))
    with pytest.raises(ValueError, match=rf"offload.param_device='cpu' {phrase}"):
        validate_config(compose_config(["zero=stage3", "offload=param_cpu", "offload.optimizer_device=none"]))
    with pytest.raises(ValueError, match=rf"zero_optimization.offload_param.device='cpu' {phrase}"):
        parse_deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=phrase):  # the engine, for the nodes it is given
        ZeroEngine(torch.nn.Linear(2, 2), None, ZeroConfig(stage=3), DataParallelComm(),
                   offload=OffloadConfig("none", "cpu"))


def test_the_keys_are_spelled_as_each_route_writes_them() -> None:
    broken = BROKEN[rules_module.SEQUENCE_WITH_TENSOR]
    assert "sequence_parallel=2 with tensor_parallel=2" in settings_problems(broken, KEYWORDS)[0]
    assert "sequence_parallel.size=2 with tensor_parallel.size=2" in settings_problems(broken)[0]
    json = settings_problems(broken, json_keys(given={"sequence_parallel.size": "sequence_parallel_size"}))[0]
    assert "sequence_parallel_size=2 with tensor_parallel.autotp_size=2" in json


def test_check_settings_lists_every_broken_rule() -> None:
    both = Settings(ZeroConfig(stage=0), OffloadConfig("nvme", "nvme"))
    with pytest.raises(ValueError) as info:
        check_settings(both, KEYWORDS)
    text = str(info.value)
    assert text.startswith("invalid settings:") and text.count("\n  - ") == 3, text  # stage 3, stage 1, nvme_path
    assert check_settings(Settings(), KEYWORDS) == Settings()


def test_a_strategy_holds_one_settings_tree_and_refuses_it_given_twice() -> None:
    tree = Settings(ZeroConfig(stage=3), OffloadConfig("cpu", "cpu"))
    strategy = ZeroStrategy(settings=tree)
    assert strategy.settings is tree and strategy.zero_config is tree.zero and strategy.offload is tree.offload
    assert ZeroStrategy(stage=3, offload_param="cpu").settings == tree  # the keyword route makes the same tree
    with pytest.raises(ValueError, match=r"Pass either `settings=` .* \['offload_param', 'reduce_bucket_size'\]"):
        ZeroStrategy(settings=tree, offload_param="cpu", reduce_bucket_size=10)
    strategy.checkpoint_format = "consolidated"  # a new tree replaces the old one
    assert strategy.settings.checkpoint_format == "consolidated" and tree.checkpoint_format == "auto"


def test_a_hydra_config_gets_a_nodes_own_problem_and_the_broken_rules_at_once() -> None:
    """Loss-scaler knobs with bf16 (the precision node's own problem) beside parameter offload at stage 2 (a rule
    across nodes): both, in the Hydra keys (issue 45 item 4; the tree's first version stopped at the node)."""
    with pytest.raises(ValueError) as info:
        validate_config(compose_config(["zero=stage2", "offload=param_cpu", "precision=bf16",
                                        "precision.loss_scale=128"]))
    text = str(info.value)
    assert f"offload.param_device='cpu' {rules_module.PARAM_NEEDS_STAGE_3}" in text, text
    assert "precision.loss_scale set with precision=bf16: loss scaling applies to fp16 only. Fix: precision=fp16" \
        in text, text
    assert "loss_scaler" not in text  # not the Python API's keyword
