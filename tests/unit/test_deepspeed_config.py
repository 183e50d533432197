"""DeepSpeed JSON configs: parsing into lightning_zero's settings, the strategy / precision arguments they
produce, unsupported keys, the batch-size triple, offload (compared field by field with the Hydra
options), and the precedence of ``from_deepspeed_config``'s keyword arguments over nothing."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import DeepSpeedZeroStrategy, ZeroConfig, ZeroEngine
from lightning_zero.config.run.build import strategy_arguments as hydra_strategy_arguments
from lightning_zero.config.run.deepspeed import apply_deepspeed_config
from lightning_zero.config.run.launch import compose_config
from lightning_zero.config.schema import to_train_config
from lightning_zero.config.settings import settings_of
from lightning_zero.config.validate import invalid_combinations, validate_config
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.precision import LossScalerConfig, PrecisionConfig
from lightning_zero.deepspeed import BatchSizes, parse_deepspeed_config
from lightning_zero.deepspeed.strategy_args import json_strategy_arguments
from lightning_zero.lightning.precision import ZeroPrecision

# The two DeepSpeed configs the project started from, exactly as written there.
# DeepSpeed's seed configs, as docs/deepspeed_config.md shows and its commands use them
_EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
SEED_FP16 = json.loads((_EXAMPLES / "seed_fp16.json").read_text())
SEED_BF16 = json.loads((_EXAMPLES / "seed_bf16.json").read_text())


def _plugin_args(plugin: ZeroPrecision) -> tuple[str, dict[str, Any]]:
    """What a real ZeroPrecision was built with: its mode and keyword arguments (defaults left out)."""
    kwargs: dict[str, Any] = {}
    if plugin.scaler is not None and plugin.scaler.config != LossScalerConfig():
        kwargs["loss_scaler"] = plugin.scaler.config
    for name in ("reduce_dtype", "grad_accum_dtype"):
        if getattr(plugin, name) is not None:
            kwargs[name] = getattr(plugin, name)
    return plugin.precision, kwargs


def _write(tmp_path: Path, config: dict, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------------------- the seed configs
@pytest.mark.parametrize(("config", "precision"), [(SEED_FP16, "16-mixed"), (SEED_BF16, "bf16-mixed")],
                         ids=["fp16", "bf16"])
def test_seed_configs_parse_into_precision_and_batch(config: dict, precision: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of the seeds is supported: no warning
        ds = parse_deepspeed_config(_write(tmp_path, config))
    assert ds.precision == precision and ds.unsupported == ()
    assert ds.source == str(tmp_path / "ds.json")
    assert ds.batch == BatchSizes(train_batch_size=64, accumulation_steps=4)
    resolved = ds.batch.resolve(2)
    assert (resolved.train_batch_size, resolved.micro_batch_size, resolved.accumulation_steps) == (64, 8, 4)
    assert ds.batch.resolve(1).micro_batch_size == 16
    assert ds.zero == ZeroConfig() and ds.offload == OffloadConfig()  # no zero section: lightning_zero's defaults
    if precision == "16-mixed":
        # loss_scale 0 = dynamic; window 1000, hysteresis 2, min 1 happen to be the defaults
        assert ds.loss_scaler == LossScalerConfig(loss_scale=0.0, loss_scale_window=1000, hysteresis=2,
                                                  min_loss_scale=1.0) == LossScalerConfig()
        assert set(ds.given) == {"precision.name", "precision.loss_scale", "precision.loss_scale_window",
                                 "precision.hysteresis", "precision.min_loss_scale"}
    else:
        assert ds.loss_scaler is None and set(ds.given) == {"precision.name"}
    # the precision node: the mode with the plugin's default loss scaler; the strategy builds its plugin of it
    assert ds.precision_settings() == PrecisionConfig(precision)
    kwargs = json_strategy_arguments(ds, {})
    assert kwargs["settings"].precision == PrecisionConfig(precision) and kwargs["precision_plugin"] is None
    plugin = ZeroPrecision.of(kwargs["settings"].precision)
    assert isinstance(plugin, ZeroPrecision) and _plugin_args(plugin) == (precision, {})
    assert (plugin.scaler is not None) == (precision == "16-mixed")
    assert kwargs["settings"].zero == ZeroConfig()


def test_fp16_loss_scaler_keys_and_dtypes_reach_the_precision_plugin() -> None:
    ds = parse_deepspeed_config({
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2},
        "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}})
    scaler = LossScalerConfig(loss_scale=0.0, initial_scale_power=12, loss_scale_window=500, hysteresis=3,
                              consecutive_hysteresis=True, min_loss_scale=2)
    expected = ("16-mixed", {"loss_scaler": scaler, "reduce_dtype": torch.float32, "grad_accum_dtype": torch.float32})
    assert ds.precision_settings() == PrecisionConfig("16-mixed", scaler, torch.float32, torch.float32)
    plugin = ZeroPrecision.of(ds.precision_settings())
    assert isinstance(plugin, ZeroPrecision) and _plugin_args(plugin) == expected
    assert plugin.scaler is not None and plugin.scaler.scale == 2.0**12  # the real scaler runs the JSON's policy
    static = parse_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.precision_settings() == PrecisionConfig("16-mixed", LossScalerConfig(loss_scale=128.0))
    # no precision section: the Trainer's precision decides, nothing is fixed on the strategy
    assert parse_deepspeed_config({"fp16": {"enabled": False, "loss_scale": 4}}).precision_settings() is None
    assert json_strategy_arguments(parse_deepspeed_config({}), {})["settings"].precision is None


# ---------------------------------------------------------------------------- zero_optimization
def test_zero_section_maps_onto_zero_config() -> None:
    ds = parse_deepspeed_config({"zero_optimization": {
        "stage": 1, "reduce_bucket_size": 5e8, "overlap_comm": False, "reduce_scatter": False,
        "contiguous_gradients": True, "allgather_partitions": True, "stage3_prefetch_bucket_size": 1e6,
        "stage3_max_live_parameters": 2e6, "stage3_param_persistence_threshold": 1e3}})
    assert ds.zero == ZeroConfig(stage=1, reduce_bucket_size=500_000_000, overlap_comm=False, collective="all_reduce",
                                 prefetch_bucket_size=1_000_000, max_live_parameters=2_000_000,
                                 param_persistence_threshold=1000)
    assert ds.given["zero.collective"] == "zero_optimization.reduce_scatter"
    assert ds.given["zero.reduce_bucket_size"] == "zero_optimization.reduce_bucket_size"
    assert ds.unsupported == ()
    auto = parse_deepspeed_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                                   "train_batch_size": "auto", "gradient_clipping": "auto"})
    assert auto.zero == ZeroConfig(stage=2) and not auto.batch.given and auto.gradient_clipping is None
    assert parse_deepspeed_config({"zero_optimization": True}).zero.stage == 1  # DeepSpeed's legacy switch
    assert ZeroConfig().max_reuse_distance == 10**9  # DeepSpeed's default: the kept tail as before
    assert parse_deepspeed_config({"zero_optimization": {"reduce_scatter": True}}).zero.collective == "reduce_scatter"


def test_unsupported_keys_are_named_in_one_warning_or_a_strict_error(tmp_path: Path) -> None:
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "allgather_bucket_size": 5e8,
                                                           "contiguous_gradients": False, "sub_group_size": 1e9},
              "tensorboard": {"enabled": True}, "prescale_gradients": True, "activation_checkpointing": {},
              "fp16": {"enabled": False, "auto_cast": True}}
    with pytest.warns(UserWarning) as record:
        ds = parse_deepspeed_config(config)
    assert len(record) == 1
    message = str(record[0].message)
    for key in ("zero_optimization.allgather_bucket_size", "zero_optimization.contiguous_gradients=false",
                "tensorboard", "prescale_gradients=true",
                "activation_checkpointing", "fp16.auto_cast=true", "strict=True"):
        assert key in message, key
    assert len(ds.unsupported) == 6 and ds.zero.stage == 2  # the supported keys still apply (sub_group_size too)
    assert ds.offload.sub_group_size == 10**9
    with pytest.raises(ValueError, match=r"does not support these keys.*allgather_bucket_size.*tensorboard"):
        parse_deepspeed_config(_write(tmp_path, config), strict=True)
    with pytest.raises(ValueError, match="tensorboard"):
        DeepSpeedZeroStrategy.from_deepspeed_config(config, strict=True)
    with warnings.catch_warnings():  # values lightning_zero has anyway are accepted silently
        warnings.simplefilter("error")
        parse_deepspeed_config({"prescale_gradients": False, "gradient_predivide_factor": 1.0,
                                "zero_optimization": {"contiguous_gradients": True, "round_robin_gradients": False},
                                "amp": {"enabled": False}, "wall_clock_breakdown": False, "steps_per_print": 10})


@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": {"stage": "two"}}, r"`zero_optimization.stage` must be int, got 'two'"),
    ({"zero_optimization": {"stage": 4}}, "ZeRO stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"overlap_comm": 1}}, "`zero_optimization.overlap_comm` must be bool"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true; enable one"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16: `hysteresis` must be >= 1"),
    ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -2}}}, "last_batch_iteration"),
    ({"gradient_clipping": -1}, "`gradient_clipping` must be >= 0"),
    ({"gradient_accumulation_steps": 4}, "alone does not define a batch size"),
    ({"train_batch_size": 0}, "`train_batch_size` must be a positive integer"),
    ({"communication_data_type": "fp8"}, "must be one of fp32, fp16, bf16"),
    ({"optimizer": {"params": {"lr": 1}}}, r"`optimizer.type` is required"),
    ({"optimizer": {"type": "ZeroOneAdam"}}, "DeepSpeed-only optimizer"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "momentum": 0.9}}}, r"\['momentum'\] not accepted"),
    ({"scheduler": {"type": "CosineAnnealing"}}, "not a DeepSpeed scheduler"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}}, r"unknown key\(s\) \['warmup_steps'\]"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}}, r"missing \['cycle_max_lr'\]"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
     "offload_param.device='cpu' needs ZeRO stage 3 .*, got zero_optimization.stage=2"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "optimizer must be offloaded too. Fix: also set zero_optimization.offload_optimizer.device='cpu'"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "needs ZeRO stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "keeps its swap files under zero_optimization.offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}}, "must be none, cpu or nvme"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "offload_param": {"device": "cpu", "pin_memory": False}}}, "one pin_memory for both"),
])
def test_invalid_values_are_refused_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_deepspeed_config(config)


@pytest.mark.parametrize(("config", "key"), [
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "`compression_training`="),
    ({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}}, "`data_efficiency`="),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "`zero_optimization.zero_quantized_weights`"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
     "`zero_optimization.zero_quantized_gradients`"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
     "`zero_optimization.zero_hpz_partition_size`=8"),
    ({"amp": {"enabled": True}}, "`amp.enabled`=true"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "`elasticity`="),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
     "`zero_optimization.stage3_gather_16bit_weights_on_model_save`=true"),
])
def test_features_that_change_what_is_computed_are_refused_in_one_line(config: dict, key: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_deepspeed_config(config)
    message = str(info.value)
    assert key in message and "not built" in message and "\n" not in message, message
    with pytest.raises(ValueError, match="not built"):  # the strategy refuses it too, before any process
        DeepSpeedZeroStrategy.from_deepspeed_config(config)


def test_switched_off_features_and_deepspeed_defaults_are_accepted_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = parse_deepspeed_config({
            "data_efficiency": {"enabled": False}, "elasticity": {"enabled": False},
            # every technique switched off (the section has no switch of its own)
            "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}},
                                     "sparse_pruning": {"shared_parameters": {"enabled": False}}},
            "sequence_parallel_size": 1,
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
                                  "offload_optimizer": {"device": "cpu", "buffer_count": 4},
                                  "offload_param": {"device": "cpu", "buffer_count": 5, "max_in_cpu": 1e9}}})
    assert ds.offload == OffloadConfig(optimizer_device="cpu", param_device="cpu")


@pytest.mark.parametrize(("key", "value"), [("buffer_count", 2), ("buffer_size", 5e7), ("max_in_cpu", 2e9)])
def test_parameter_offload_io_knobs_that_are_not_built_are_refused(key: str, value: float) -> None:
    """``offload_param``'s ``buffer_count`` / ``buffer_size`` / ``max_in_cpu`` would be read by nothing."""
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}}}
    config["zero_optimization"]["offload_param"][key] = value
    refusal = rf"`zero_optimization.offload_param.{key}`={int(value)} is not built.*Fix: remove"
    with pytest.raises(ValueError, match=refusal):
        parse_deepspeed_config(config)
    if key == "max_in_cpu":
        with pytest.raises(ValueError, match=rf"offload `{key}`=.* is not built"):
            OffloadConfig(optimizer_device="cpu", **{key: int(value)})
        hydra = compose_config(["zero=stage3", "offload=param_cpu", f"offload.{key}={int(value)}"])
        problems = invalid_combinations(to_train_config(hydra))
        assert any(p.startswith(f"offload: offload `{key}`={int(value)} is not built") for p in problems), problems


def test_the_optimizers_swap_buffers_and_pipeline_mean_what_deepspeed_says(tmp_path: Path) -> None:
    """``offload_optimizer.buffer_count`` / ``pipeline_read`` / ``pipeline_write`` (nvme) reach the step's swap
    buffers, with DeepSpeed's defaults when absent; too few buffers for the pipeline are refused with the count."""
    section = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": section, "offload_param": dict(section)}}
    ds = parse_deepspeed_config(config)
    assert (ds.offload.buffer_count, ds.offload.pipeline_read, ds.offload.pipeline_write) == (4, False, False)
    section.update(buffer_count=12, pipeline_read=True, pipeline_write=True)
    ds = parse_deepspeed_config(config)
    assert (ds.offload.buffer_count, ds.offload.pipeline_read, ds.offload.pipeline_write) == (12, True, True)
    section["buffer_count"] = 8  # AdamW: 4 per sub-group, 3 sub-groups in flight
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"buffer_count=8 is too few swap buffers.*Fix: buffer_count>=12"):
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3), DataParallelComm(),
                   offload=parse_deepspeed_config(config).offload)
    hydra = compose_config(["zero=stage3", "offload=param_nvme", f"offload.nvme_path={tmp_path}",
                            "offload.buffer_count=8"])
    problems = invalid_combinations(to_train_config(hydra))
    assert any("offload.buffer_count=8 is too few swap buffers" in p and ">=12" in p for p in problems), problems


def test_files_bad_json_and_duplicate_keys(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_deepspeed_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_deepspeed_config(bad)
    bad.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match=r"duplicate key\(s\) \['train_batch_size'\]"):
        parse_deepspeed_config(bad)


# ---------------------------------------------------------------------------- the batch triple
@pytest.mark.parametrize(("given", "world", "expected"), [
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, 2, (64, 8, 4)),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
    ({"train_batch_size": 64}, 4, (64, 16, 1)),
    ({"train_micro_batch_size_per_gpu": 8}, 3, (24, 8, 1)),
])
def test_two_of_three_batch_keys_suffice(given: dict, world: int, expected: tuple[int, int, int]) -> None:
    batch = parse_deepspeed_config(given).batch.resolve(world)
    assert (batch.train_batch_size, batch.micro_batch_size, batch.accumulation_steps) == expected


@pytest.mark.parametrize(("given", "world", "message"), [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, 1,
     r"train_batch_size=64 does not equal .*8 x .*4 x data-parallel world size 1 = 32\. Fix: train_batch_size=32, "
     r"or drop one of the three keys.*or run on 2 data-parallel ranks"),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 3,
     r"not divisible by gradient_accumulation_steps=4 x data-parallel world size 3 = 12.*Fix: train_batch_size=60 "
     r"or 72 \(a multiple of 12\), or a data-parallel world size in \[1, 2, 4, 8, 16\]"),
    ({"train_batch_size": 10}, 4, r"not divisible by 1 accumulation step x data-parallel world size 4 = 4.*=8 or 12"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 6}, 2, "not divisible by train_micro_batch_size"),
])
def test_a_bad_batch_triple_names_the_fix(given: dict, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_deepspeed_config(given).batch.resolve(world)


# ---------------------------------------------------------------------------- offload vs Hydra, field by field
STAGE3_OFFLOAD = {"zero_optimization": {
    "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 2e7,
    "stage3_prefetch_bucket_size": 4e7, "stage3_max_live_parameters": 5e8, "stage3_param_persistence_threshold": 1e4,
    "stage3_max_reuse_distance": 2e6, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": 1e9}}, "bf16": {"enabled": True}}
STAGE3_HYDRA = ["zero=stage3", "offload=param_cpu", "precision=bf16", "zero.reduce_bucket_size=20000000",
                "zero.prefetch_bucket_size=40000000", "zero.max_live_parameters=500000000",
                "zero.param_persistence_threshold=10000", "zero.max_reuse_distance=2000000", "offload.pin_memory=true"]
NVME_OFFLOAD = {"zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4},
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5}},
    "fp16": {"enabled": True, "loss_scale_window": 200}}
NVME_HYDRA = ["zero=stage3", "offload=param_nvme", "precision=fp16", "precision.loss_scale_window=200",
              "trainer=gpu", "offload.buffer_count=4", "offload.pipeline_read=false", "offload.pipeline_write=false"]


@pytest.mark.parametrize(("config", "overrides"), [(STAGE3_OFFLOAD, STAGE3_HYDRA), (NVME_OFFLOAD, NVME_HYDRA)],
                         ids=["param_cpu", "param_nvme"])
def test_stage3_offload_config_equals_the_hydra_options_field_by_field(config: dict, overrides: list[str],
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # trainer=gpu composes as on a machine with a GPU (this one's are checked apart: test_cli_refusals.py)
    monkeypatch.setattr("lightning_zero.config.validate.node_device_problems", lambda accelerator, devices: [])
    if "offload=param_nvme" in overrides:  # validation checks that nvme_path exists: one that does
        config = json.loads(json.dumps(config).replace("/local_nvme", str(tmp_path)))
        overrides = [*overrides, f"offload.nvme_path={tmp_path}"]
    ds = parse_deepspeed_config(config)
    hydra = validate_config(compose_config(overrides))
    from_hydra = settings_of(hydra)
    for part, from_json in (("zero", ds.zero), ("offload", ds.offload)):
        for f in dataclasses.fields(from_json):
            a, b = getattr(from_json, f.name), getattr(getattr(from_hydra, part), f.name)
            assert a == b, f"{part}.{f.name}: JSON gives {a!r}, Hydra {b!r}"
    json_precision = ds.precision_settings()
    assert json_precision is not None and from_hydra.precision is not None
    assert json_precision.mode == from_hydra.precision.mode
    default = LossScalerConfig()
    assert (json_precision.loss_scaler or default) == (from_hydra.precision.loss_scaler or default)
    # the strategy arguments the Hydra path builds carry the same ZeroConfig
    assert hydra_strategy_arguments(hydra)["settings"].zero == ds.zero
    # and the JSON merged over the default composition amounts to the same groups as the Hydra options
    merged = validate_config(apply_deepspeed_config(
        compose_config([f"deepspeed_config={_write(tmp_path, config)}", *[o for o in overrides if "trainer" in o]])))
    for group in ("zero", "offload", "precision"):
        assert getattr(merged, group) == getattr(hydra, group), group
    # and the strategy takes it as it is (parameter offload is built)
    assert DeepSpeedZeroStrategy.from_deepspeed_config(config).offload == ds.offload


# ---------------------------------------------------------------------------- from_deepspeed_config arguments
def test_keyword_arguments_fill_in_or_must_agree() -> None:
    config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}
    strategy = DeepSpeedZeroStrategy.from_deepspeed_config(config, overlap_comm=False, check_step_errors=False,
                                                  process_group_backend="gloo")
    z = strategy.zero_config
    assert (z.stage, z.reduce_bucket_size, z.overlap_comm) == (1, 1000, False)  # JSON, JSON, keyword
    assert strategy.check_step_errors is False and strategy.process_group_backend == "gloo"
    assert DeepSpeedZeroStrategy.from_deepspeed_config(config, stage=1, reduce_bucket_size=1000).zero_config.stage == 1
    with pytest.raises(ValueError) as info:
        DeepSpeedZeroStrategy.from_deepspeed_config(config, stage=2, reduce_bucket_size=5)
    text = str(info.value)
    assert "zero_optimization.stage=1, but stage=2" in text
    assert "zero_optimization.reduce_bucket_size=1000, but reduce_bucket_size=5" in text
    with pytest.raises(ValueError, match=r"zero_optimization.stage=1, but stage=2"):
        DeepSpeedZeroStrategy.from_deepspeed_config(config, config=ZeroConfig(stage=2, reduce_bucket_size=1000))
    with pytest.raises(ValueError, match=r"sets bf16.enabled=true \(precision='bf16-mixed'\), but precision='32-true'"):
        DeepSpeedZeroStrategy.from_deepspeed_config(SEED_BF16, precision="32-true")
    with pytest.raises(ValueError, match="optimizer_source"):
        DeepSpeedZeroStrategy.from_deepspeed_config({}, optimizer_source="module")
    parsed = parse_deepspeed_config(config)
    assert DeepSpeedZeroStrategy.from_deepspeed_config(parsed).deepspeed_config is parsed


# ---------------------------------------------------------------------------- fp16 validation as DeepSpeed's
# Each row: the fp16 section, and None (accepted) or the error expected. Checked against DeepSpeed
# 0.19's DeepSpeedFP16Config (deepspeed/runtime/precision_config.py): loss_scale must be a finite
# number >= 0; loss_scale_window / min_loss_scale must be finite integers, and > 0 only when the
# scale is dynamic and fp16 on; a null is refused like any wrong type ("auto" counts as absent).
INF, NAN = float("inf"), float("nan")
FP16_VALIDATION = [
    ({"loss_scale": INF}, "`loss_scale` must be a finite number"),
    ({"loss_scale": NAN}, "`loss_scale` must be a finite number"),
    ({"loss_scale": -INF}, "`loss_scale` must be a finite number"),
    ({"loss_scale": INF, "enabled": False}, "`loss_scale` must be a finite number"),  # checked even when off
    ({"loss_scale": -1}, "`loss_scale` must be a finite number"),
    ({"min_loss_scale": INF}, "`fp16.min_loss_scale` must be int"),
    ({"min_loss_scale": INF, "loss_scale": 128}, "`fp16.min_loss_scale` must be int"),
    ({"min_loss_scale": 0.5}, "`fp16.min_loss_scale` must be int"),  # DeepSpeed types it int
    ({"loss_scale": 128, "loss_scale_window": 0}, None),  # static: dynamic-only knobs accepted, ignored
    ({"loss_scale": 128, "loss_scale_window": -1}, None),
    ({"loss_scale": 128, "min_loss_scale": 0}, None),
    ({"loss_scale": 128, "min_loss_scale": -1}, None),
    ({"loss_scale": 0, "loss_scale_window": 0}, "`loss_scale_window` must be >= 1"),
    ({"loss_scale": 0, "loss_scale_window": -1}, "`loss_scale_window` must be >= 1"),
    ({"loss_scale": 0, "min_loss_scale": 0}, "`min_loss_scale` must be positive"),
    ({"loss_scale": 0, "min_loss_scale": -1}, "`min_loss_scale` must be positive"),
    ({"enabled": False, "loss_scale_window": 0, "min_loss_scale": 0}, None),  # off: not in use, accepted
    ({"loss_scale": None}, r"`fp16.loss_scale` is null"),
    ({"loss_scale_window": None}, r"`fp16.loss_scale_window` is null"),
    ({"min_loss_scale": None}, r"`fp16.min_loss_scale` is null"),
    ({"hysteresis": None}, r"`fp16.hysteresis` is null"),
    ({"enabled": None}, r"`fp16.enabled` is null"),
    ({"loss_scale": "auto", "loss_scale_window": "auto"}, None),  # DeepSpeed drops "auto" values
    ({"loss_scale": True}, "`fp16.loss_scale` must be float"),
    ({"loss_scale_window": True}, "`fp16.loss_scale_window` must be int"),
]


@pytest.mark.parametrize(("section", "error"), FP16_VALIDATION, ids=[str(i) for i in range(len(FP16_VALIDATION))])
def test_fp16_values_are_accepted_and_refused_as_deepspeed_does(section: dict, error: str | None) -> None:
    config = {"fp16": {"enabled": True, **section}}
    if error is None:
        ds = parse_deepspeed_config(config)
        if ds.loss_scaler is not None and not ds.loss_scaler.dynamic:
            scaler = ZeroPrecision("16-mixed", loss_scaler=ds.loss_scaler).scaler
            assert scaler is not None
            scaler.update(True)
            scaler.update(False)
            assert scaler.scale == section["loss_scale"]  # the ignored knobs change nothing
    else:
        with pytest.raises(ValueError, match=error):
            parse_deepspeed_config(config)


def test_null_sections_are_refused() -> None:
    for name in ("fp16", "bf16"):
        with pytest.raises(ValueError, match=f"`{name}` is null"):
            parse_deepspeed_config({name: None})
    with pytest.raises(ValueError, match=r"`bf16.enabled` is null"):
        parse_deepspeed_config({"bf16": {"enabled": None}})


def test_the_old_zerostrategy_from_deepspeed_config_name_warns_and_works() -> None:
    """docs/offload.md showed ``ZeroStrategy.from_deepspeed_config``, which had vanished (AttributeError)."""
    from lightning_zero import ZeroStrategy

    with pytest.warns(DeprecationWarning, match="DeepSpeedZeroStrategy.from_deepspeed_config"):
        strategy = ZeroStrategy.from_deepspeed_config({"zero_optimization": {"stage": 1}})
    assert isinstance(strategy, DeepSpeedZeroStrategy) and strategy.zero_config.stage == 1


def test_autotp_size_drives_tensor_parallel_and_the_other_tp_keys_are_refused_by_name() -> None:
    """``tensor_parallel.autotp_size`` was refused; it now sets ``ZeroStrategy(tensor_parallel=N)`` (and the CLI's
    ``tensor_parallel.size``); DeepSpeed's other keys of the section are refused naming the key and why."""
    from lightning_zero import TensorParallelConfig

    ds = parse_deepspeed_config({"tensor_parallel": {"autotp_size": 2, "tensor_parallel": {"tp_size": 2}}})
    assert ds.tensor_parallel == 2 and ds.given["tensor_parallel.size"] == "tensor_parallel.autotp_size"
    assert parse_deepspeed_config({"tensor_parallel": {"autotp_size": 1}}).tensor_parallel == 1  # off
    assert "tensor_parallel.size" not in parse_deepspeed_config({"tensor_parallel": {"autotp_size": 0}}).given
    strategy = DeepSpeedZeroStrategy.from_deepspeed_config({"zero_optimization": {"stage": 2},
                                                            "tensor_parallel": {"autotp_size": 2}})
    assert strategy.tensor_parallel == TensorParallelConfig(2)
    plan = TensorParallelConfig(2, plan="auto")  # the user's plan is kept when its size agrees
    assert DeepSpeedZeroStrategy.from_deepspeed_config({"tensor_parallel": {"autotp_size": 2}},
                                                       tensor_parallel=plan).tensor_parallel == plan
    with pytest.raises(ValueError, match=r"sets tensor_parallel.autotp_size=2, but tensor_parallel=4"):
        DeepSpeedZeroStrategy.from_deepspeed_config({"tensor_parallel": {"autotp_size": 2}}, tensor_parallel=4)
    for key, value in [("tp_overlap_comm", True), ("keep_module_on_host", True), ("replace_with_kernel_inject", True),
                       ("injection_policy_tuple", ["a", "b"]), ("dtype", "bf16")]:
        with pytest.raises(ValueError, match=rf"`tensor_parallel.{key}`=.* is not built"):
            parse_deepspeed_config({"tensor_parallel": {"autotp_size": 2, key: value}})
    with pytest.raises(ValueError, match=r"`tensor_parallel.tensor_parallel.tp_grain_size`=64 is not built"):
        parse_deepspeed_config({"tensor_parallel": {"autotp_size": 2, "tensor_parallel": {"tp_grain_size": 64}}})
    with pytest.raises(ValueError, match=r"`tensor_parallel.autotp_size` must be an integer >= 0"):
        parse_deepspeed_config({"tensor_parallel": {"autotp_size": -2}})
    with pytest.raises(ValueError, match=r"does not support these keys.*tensor_parallel.partition_config"):
        parse_deepspeed_config({"tensor_parallel": {"autotp_size": 2, "partition_config": {}}}, strict=True)
