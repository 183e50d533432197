"""Expert parallelism's settings in one process (issue 44): the mesh's expert axes, the strategy's switch and its
refusals before launch, the size from DeepSpeed-style MoE layers, DeepSpeed's ``expert_parallel`` JSON section, the
CLI's ``expert_parallel=`` group and ``model.moe``, the model-state formula and the estimator / advisor."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_zero import ExpertParallelConfig, ZeroStrategy
from lightning_zero.core.common.memory import expert_parallel_model_state, model_state_formula
from lightning_zero.core.mesh import Axis, ParallelDims
from lightning_zero.moe import MoE
from lightning_zero.parallel.expert import expert_size


def test_the_expert_axes_split_the_data_axis_expert_inner() -> None:
    dims = ParallelDims(8, tensor=2, expert=2)  # data 4 = expert_data 2 x expert 2, tensor innermost
    assert (dims.data, dims.expert_data, dims.expert) == (4, 2, 2)
    assert dims.all_groups((Axis.EXPERT,)) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # the nearest data ranks
    assert dims.all_groups(dims.expert_zero_axes) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the same experts
    assert dims.all_groups(dims.zero_axes) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # unchanged without experts' axes
    assert dims.coordinates(6)[Axis.DATA] == 3 and dims.rank_of(dims.coordinates(6)) == 6
    assert dims.describe() == "expert_data 2 x expert 2 x tensor 2"
    with pytest.raises(ValueError, match="expert_parallel=4 does not divide the 6 data-parallel ranks"):
        ParallelDims(6, expert=4)


def test_the_strategy_takes_one_switch_and_refuses_what_is_not_built_before_launch() -> None:
    from lightning_zero import PipelineConfig

    assert ZeroStrategy(stage=2, expert_parallel=2).expert_parallel == ExpertParallelConfig(2)
    assert ZeroStrategy(stage=3, expert_parallel=ExpertParallelConfig(4)).expert_parallel.size == 4
    assert ZeroStrategy(stage=1).expert_parallel is None
    with pytest.raises(ValueError, match=r"expert_parallel=2 with tensor_parallel=2: expert parallel with pipeline, "
                       r"tensor or sequence parallel is not built yet .* Fix: expert_parallel=1, or tensor_parallel=1"):
        ZeroStrategy(expert_parallel=2, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"expert_parallel=2 with PipelineConfig\.stages=2: .* is not built yet"):
        ZeroStrategy(expert_parallel=2, pipeline=PipelineConfig(stages=2))
    with pytest.raises(ValueError, match="with sequence_parallel=2"):
        ZeroStrategy(expert_parallel=2, sequence_parallel=2)
    with pytest.raises(ValueError, match="checkpoint_format='sharded' with expert_parallel=2: sharded checkpoints"):
        ZeroStrategy(stage=2, expert_parallel=2, checkpoint_format="sharded")
    with pytest.raises(TypeError, match="an int or an ExpertParallelConfig"):
        ZeroStrategy(expert_parallel="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive integer"):
        ExpertParallelConfig(0)


def test_deepspeed_style_layers_set_the_size_unless_the_strategy_does() -> None:
    expert = nn.Linear(4, 4)
    two = nn.ModuleList([MoE(4, expert, num_experts=4, ep_size=2), MoE(4, expert, num_experts=4)])
    assert expert_size(None, two) == 2 and expert_size(None, nn.Linear(2, 2)) == 1
    assert expert_size(ExpertParallelConfig(2), two) == 2
    with pytest.raises(ValueError, match="built with ep_size=2 but ZeroStrategy\\(expert_parallel=4\\)"):
        expert_size(ExpertParallelConfig(4), two)
    with pytest.raises(ValueError, match="different ep_size"):
        expert_size(None, nn.ModuleList([MoE(4, expert, num_experts=4, ep_size=2),
                                         MoE(4, expert, num_experts=4, ep_size=4)]))


def test_a_size_the_moe_layers_set_is_checked_by_the_settings_rules_at_setup() -> None:
    """``ep_size`` of DeepSpeed-style layers (no ``expert_parallel=``) becomes this setup's settings tree, whose rules
    refuse what is not built as the strategy's argument would be (before: TP 2 with ``ep_size=2`` layers passed the
    constructor's check and reached the mesh)."""
    from lightning_zero.core.settings import ParallelSettings, Settings, TensorParallelConfig
    from lightning_zero.parallel.expert import expert_settings

    layers = nn.ModuleList([MoE(4, nn.Linear(4, 4), num_experts=4, ep_size=2)])
    assert expert_settings(Settings(), layers).parallel.expert == ExpertParallelConfig(2)
    assert expert_settings(Settings(), nn.Linear(2, 2)) == Settings()
    with pytest.raises(ValueError, match="expert parallel with pipeline, tensor or sequence parallel is not built"):
        expert_settings(Settings(parallel=ParallelSettings(tensor=TensorParallelConfig(2))), layers)


def test_a_deepspeed_json_expert_parallel_section_sets_the_size_and_refuses_what_is_not_built() -> None:
    from lightning_zero.deepspeed.config import parse_deepspeed_config
    from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy

    section = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    ds = parse_deepspeed_config({"zero_optimization": {"stage": 2}, "expert_parallel": section})
    assert ds.expert_parallel == 2 and ds.given["expert_parallel.size"] == "expert_parallel.autoep_size"
    assert parse_deepspeed_config({"expert_parallel": {**section, "enabled": False}}).expert_parallel == 1
    assert DeepSpeedZeroStrategy.from_deepspeed_config({"expert_parallel": section}).expert_parallel.size == 2
    with pytest.raises(ValueError, match=r"expert_parallel\.autoep_size=2, but expert_parallel=4"):
        DeepSpeedZeroStrategy.from_deepspeed_config({"expert_parallel": section}, expert_parallel=4)
    with pytest.raises(ValueError, match=r"`expert_parallel\.use_grouped_mm`=False is not built"):
        parse_deepspeed_config({"expert_parallel": {**section, "use_grouped_mm": False}})
    with pytest.raises(ValueError, match=r"`expert_parallel\.layer_specs`"):
        parse_deepspeed_config({"expert_parallel": {**section, "layer_specs": [{"x": 1}]}})
    with pytest.raises(ValueError, match="preset_model`='gpt5' is not one of DeepSpeed's presets"):
        parse_deepspeed_config({"expert_parallel": {**section, "preset_model": "gpt5"}})
    assert "expert_parallel.overlap" in parse_deepspeed_config({"expert_parallel": {**section, "overlap": 1}},
                                                               warn=False).unsupported


@pytest.mark.slow
def test_the_cli_config_builds_expert_parallel_and_refuses_what_is_not_built_before_launch() -> None:
    from lightning_zero.config.model_zoo import gpt_config
    from lightning_zero.config.run.build import strategy_arguments
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.validate import validate_config

    ok = ["experiment=gpt_tiny", "model.moe.num_experts=8", "expert_parallel=ep2", "trainer.devices=2"]
    cfg = validate_config(compose_config(ok))
    assert strategy_arguments(cfg)["settings"].parallel.expert == ExpertParallelConfig(2)
    assert gpt_config(cfg.model).moe.num_experts == 8
    assert strategy_arguments(validate_config(compose_config(["experiment=gpt_tiny"])))["settings"].parallel.expert \
        is None
    cases = {
        "trainer.devices=3": "does not divide the 3 data-parallel ranks",
        "model.moe.num_experts=0": "expert_parallel needs MoE layers",
        "model.moe.num_experts=3": "num_experts=3 does not split over expert_parallel.size=2",
        "tensor_parallel=tp2": "expert_parallel.size=2 with tensor_parallel.size=2: expert parallel with pipeline",
        "model.build_in_configure_model=true": "build_in_configure_model=true is not built yet",
    }
    for override, message in cases.items():
        with pytest.raises(ValueError, match=message):
            validate_config(compose_config([*ok, override]))
    from lightning_zero.config.parallel_checks import expert_parallel_problems
    from lightning_zero.config.schema import HFCausalLMSchema

    hf = replace(cfg, model=HFCausalLMSchema(config={"model_type": "qwen3_moe"}))  # its plan is found at setup
    assert expert_parallel_problems(hf) == []
    (why,) = expert_parallel_problems(replace(hf, zero=replace(hf.zero, stage=3)))
    assert "hf_causal_lm at zero.stage=3 is not built yet" in why


def test_the_model_state_formula_adds_the_dense_and_the_experts_partitions() -> None:
    dense, experts = 1000.0, 8000.0
    for stage in range(4):
        mine = expert_parallel_model_state(stage, dense, experts, 2, 4)
        parts = [model_state_formula(stage, dense, 4), model_state_formula(stage, experts / 2, 2)]
        assert mine.params == parts[0].params + parts[1].params and mine.optimizer == sum(p.optimizer for p in parts)
    # stage 3: each parameter once over the 4 data ranks, with or without expert parallelism; stage 2: half the experts
    assert expert_parallel_model_state(3, dense, experts, 2, 4).params == model_state_formula(3, 9000, 4).params
    assert expert_parallel_model_state(2, dense, experts, 2, 4).params == 4 * (dense + experts / 2)
    with pytest.raises(ValueError, match="dividing data_parallel=4"):
        expert_parallel_model_state(1, dense, experts, 3, 4)


def test_the_estimator_counts_experts_per_rank_and_the_all_to_all_bytes() -> None:
    from lightning_zero.estimator import estimate_memory
    from lightning_zero.estimator.advisor import advise
    from lightning_zero.estimator.model_spec import spec_of_module
    from lightning_zero.estimator.report import all_to_all_bytes
    from lightning_zero.models.gpt import GPTConfig, GPTLightningModule

    with torch.device("meta"):
        gpt = GPTLightningModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32,
                                           moe={"num_experts": 4, "top_k": 2}))
    spec = spec_of_module(gpt)
    assert (spec.num_experts, spec.top_k, spec.moe_layers) == (4, 2, 2)
    assert spec.expert_params == 2 * 2 * 4 * 32 * 128  # 2 layers x (up + down) x 4 experts x 32 x 128
    est = estimate_memory(model=gpt, world_size=4, expert_parallel=2, precision="fp32", offload="none")
    expected = expert_parallel_model_state(2, spec.num_params - spec.expert_params, spec.expert_params, 2, 4)
    assert est.config(2).on_device.params == expected.params
    assert "a rank holds 2 expert(s) per layer" in est.table().replace("\n  ", " ")
    # 8 x 16 tokens, top-2, half of them to the other rank, 4 exchanges of 32 fp32 values per row, 2 layers
    assert all_to_all_bytes(replace(spec, hidden=32), 2, 8 * 16, 4) == 4 * 8 * 16 * 2 * 0.5 * 32 * 4 * 2
    mixtral = estimate_memory(model="mixtral-8x7b", world_size=8, expert_parallel=8, micro_batch=1)
    assert "The all-to-alls send" in mixtral.table().replace("\n  ", " ")
    advice = advise(model="mixtral-8x7b", world_size=8, expert_parallel=8, device_memory="80GB", cpu_memory="1TB")
    assert advice.choice is not None and "expert_parallel.size=8" in advice.choice.overrides("mixed")
    with pytest.raises(ValueError, match="--expert-parallel needs a model with MoE layers"):
        estimate_memory(model="gpt2", world_size=8, expert_parallel=2)
