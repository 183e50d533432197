"""DeepSpeed JSON's ``pipeline`` section and its batch keys under a pipeline (Note [DeepSpeed pipeline keys]
and Note [DeepSpeed pipeline batches] in lightning_zero/deepspeed/pipeline.py): parsed, merged into the
Hydra config by ``lightning-zero train``, refused before launch when bad, and trained from Python
(against the unsplit model) and from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from lightning_zero import PipelineConfig
from lightning_zero.cli import main
from lightning_zero.config.run.launch import CONFIG_FILE
from lightning_zero.config.validate import validate_config
from lightning_zero.deepspeed.config import parse_deepspeed_config
from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy
from tests.e2e.test_deepspeed_cli import _json, _merged
from tests.in_pool import run_in_process
from tests.pool import GlooPool

PIPE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "pipeline": {"stages": 2, "partition": "uniform", "activation_checkpoint_interval": 1,
                     "pipe_partitioned": True, "grad_partitioned": False, "seed_layers": False}}


def test_pipeline_keys_map_are_accepted_ignored_or_refused() -> None:
    ds = parse_deepspeed_config({"pipeline": {"stages": 2, "partition_method": "type:Block", "seed_layers": True,
                                              "use_reentrant": True, "pipe_partitioned": False, "micro": 3}},
                                warn=False)
    assert ds.pipeline is not None and (ds.pipeline.stages, ds.pipeline.partition_method) == (2, "type:Block")
    assert ds.given["pipeline.partition_method"] == "pipeline.partition_method"
    assert ds.unsupported == ("pipeline.seed_layers=true", "pipeline.use_reentrant=true", "pipeline.micro")
    defaults = parse_deepspeed_config({"pipeline": {"stages": "auto", "partition": "best"}})  # DeepSpeed's defaults
    assert defaults.pipeline is not None and defaults.pipeline.stages is None and not defaults.given
    for bad, message in [({"stages": 0}, "must be >= 1"), ({"partition": "profile"}, "not implemented"),
                         ({"partition": "weird"}, "partition_method must be"),
                         ({"partition": "uniform", "partition_method": "parameters"}, "differ"),
                         ({"pipe_partitioned": 1}, "must be bool"),
                         ({"activation_checkpoint_interval": -1}, "must be >= 0")]:
        with pytest.raises(ValueError, match=message):
            parse_deepspeed_config({"pipeline": bad})


def test_gradient_accumulation_steps_are_the_pipeline_micro_batches() -> None:
    """As DeepSpeed's PipelineEngine: GAS micro-batches of the micro-batch size per step and data-parallel rank."""
    strategy = DeepSpeedZeroStrategy.from_deepspeed_config({**PIPE, "gradient_accumulation_steps": 4})
    assert strategy.pipeline_config == PipelineConfig(stages=2, micro_batches=4, schedule="1f1b",
                                                      partition_method="uniform", activation_checkpoint_interval=1)
    two = DeepSpeedZeroStrategy.from_deepspeed_config({"train_micro_batch_size_per_gpu": 2,
                                                       "gradient_accumulation_steps": 2, "pipeline": {"stages": 4}})
    assert two.pipeline_config is not None and two.pipeline_config.schedule == "gpipe"  # 1F1B needs m >= stages
    with pytest.raises(ValueError, match="gives gradient_accumulation_steps=4, which a pipeline runs as 4 micro"):
        DeepSpeedZeroStrategy.from_deepspeed_config({**PIPE, "gradient_accumulation_steps": 4},
                                                    pipeline=PipelineConfig(stages=2, micro_batches=2))
    with pytest.raises(ValueError, match=r"sets pipeline\.stages=2, but pipeline=PipelineConfig"):
        DeepSpeedZeroStrategy.from_deepspeed_config(PIPE, pipeline=PipelineConfig(stages=4, micro_batches=4))


def test_the_cli_merges_the_pipeline_section(tmp_path: Path) -> None:
    path = _json(tmp_path, PIPE)
    cfg = _merged(["experiment=gpt_tiny", f"deepspeed_config={path}", "trainer.devices=2"])
    p = cfg.pipeline  # 8 = 2 x GAS x 1 data-parallel rank: GAS 4 -> 4 micro-batches of 2, batch 8 per rank
    assert (p.stages, p.micro_batches, p.schedule.value, p.partition_method, p.activation_checkpoint_interval) == (
        2, 4, "one_f_one_b", "uniform", 1)
    assert (cfg.data.micro_batch_size, cfg.trainer.accumulate_grad_batches) == (8, 1)
    assert validate_config(cfg) == cfg
    assert _merged(["experiment=gpt_tiny", f"deepspeed_config={path}", "trainer.devices=2",
                    "pipeline=pp2_gpipe"]).pipeline.schedule.value == "gpipe"  # a chosen schedule stays
    for extra, message in [("pipeline.stages=4", "pipeline.stages=4 on the command line, but"),
                           ("data.micro_batch_size=2", "x gradient_accumulation_steps=4 = 8 samples per data-parallel"),
                           ("trainer.accumulate_grad_batches=4", "as pipeline micro-batches, so Lightning")]:
        with pytest.raises(ValueError, match=message):
            _merged(["experiment=gpt_tiny", f"deepspeed_config={path}", "trainer.devices=2", extra])


def test_bad_pipeline_keys_stop_the_cli_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    bad = _json(tmp_path, {**PIPE, "pipeline": {"stages": 2, "partition": "profile"}})
    assert main(["train", "experiment=gpt_tiny", f"deepspeed_config={bad}", "trainer.devices=2"]) == 2
    assert '`pipeline.partition`="profile" is not implemented' in capsys.readouterr().err
    extra = _json(tmp_path, {**PIPE, "pipeline": {"stages": 2, "seed_layers": True}}, "extra.json")
    assert main(["train", "experiment=gpt_tiny", f"deepspeed_config={extra}", "trainer.devices=2",
                 "deepspeed_strict=true"]) == 2
    assert "ignores them: pipeline.seed_layers=true" in capsys.readouterr().err
    assert main(["train", "experiment=gpt_tiny", f"deepspeed_config={_json(tmp_path, PIPE, 'ok.json')}",
                 "trainer.devices=3"]) == 2  # not a multiple of the JSON's 2 stages
    assert "the world size 3 is not a multiple of pipeline x sequence x tensor = 2 x 1 x 1" in capsys.readouterr().err
    assert not list(run.iterdir())  # no output directory, no process


def deepspeed_fit_body(tbs_only: bool) -> dict[str, float]:
    """2 ranks, 2 stages from the JSON alone; GAS given, or derived from train_batch_size at setup."""
    import torch.distributed as dist

    from tests.e2e.test_pipeline import STEPS
    from tests.models import make_trainer
    from tests.pipeline_models import PipeLM, loader, reference

    config: dict[str, Any] = dict(PIPE)
    if not tbs_only:
        config["gradient_accumulation_steps"] = 4
    strategy = DeepSpeedZeroStrategy.from_deepspeed_config(config)
    model = PipeLM("sgd")
    make_trainer(strategy, devices=dist.get_world_size(), max_steps=STEPS).fit(model, loader(8))
    ref = reference("sgd", 8, 1, STEPS)
    assert strategy.pipeline_config is not None
    return {"micro_batches": strategy.pipeline_config.micro_batches,
            "param_abs": max(float((p - ref["params"][n]).abs().max()) for n, p in model.named_parameters())}


@pytest.mark.slow
def test_a_deepspeed_json_trains_a_pipeline_from_python(gloo_pool: GlooPool) -> None:
    for tbs_only in (False, True):
        for result in gloo_pool.run("tests.e2e.test_pipeline_deepspeed:deepspeed_fit_body", tbs_only=tbs_only):
            assert result["micro_batches"] == 4 and result["param_abs"] < 1e-6, result


@pytest.mark.slow
def test_a_deepspeed_json_trains_a_pipeline_from_the_cli(tmp_path: Path, gloo_pool: GlooPool) -> None:
    """The command in this process, its ranks in the session's pool (Note [shared launches] in tests/launches.py)."""
    path = _json(tmp_path, PIPE)
    args = ["train", "experiment=gpt_tiny", f"deepspeed_config={path}", "trainer.devices=2", "trainer.max_steps=3",
            "trainer.val_check_interval=null", "trainer.limit_val_batches=1", "data.max_bytes=100000",
            "trainer.enable_model_summary=false"]
    done = run_in_process(args, tmp_path, gloo_pool)
    assert done.returncode == 0, done.output[-4000:]
    runs = [p for p in tmp_path.glob("outputs/*/*") if p.is_dir()]
    saved = OmegaConf.load(runs[0] / CONFIG_FILE)
    assert (saved.pipeline.stages, saved.pipeline.micro_batches, saved.data.micro_batch_size) == (2, 4, 8)
    assert json.loads((runs[0] / "result.json").read_text())["global_step"] == 3
