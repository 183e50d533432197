"""``lightning-zero train deepspeed_config=ds.json``: the JSON over the composed Hydra config (values from
YAML defaults and experiments yield to it, explicit command-line values must agree), the batch triple
checked against ``trainer.devices`` before anything starts, and 2-rank runs driven by a JSON (the command in
this process, its ranks in the pool: Note [shared launches] in tests/launches.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from lightning_zero.cli import main
from lightning_zero.config.run.deepspeed import apply_deepspeed_config, explicit_keys
from lightning_zero.config.run.launch import CONFIG_FILE, compose_config
from lightning_zero.config.schema import to_train_config
from lightning_zero.config.validate import validate_config
from tests.in_pool import run_in_process
from tests.launches import Launch
from tests.unit.test_deepspeed_config import SEED_BF16, SEED_FP16

DS = {"train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
      "zero_optimization": {"stage": 1, "reduce_bucket_size": 100000, "overlap_comm": False},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 2}},
      "steps_per_print": 1}


def _json(tmp_path: Path, config: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def _merged(overrides: list[str]):
    return to_train_config(apply_deepspeed_config(compose_config(overrides), overrides))


def test_explicit_keys_of_a_command_line() -> None:
    assert explicit_keys(["zero=stage1", "offload=param_cpu", "precision=bf16", "data.micro_batch_size=4",
                          "+trainer.max_time=null", "experiment=gpt_tiny"]) == {
        "zero.stage", "offload.optimizer_device", "offload.param_device", "precision.name", "data.micro_batch_size",
        "trainer.max_time", "experiment"}


def test_the_json_replaces_yaml_and_experiment_values(tmp_path: Path) -> None:
    path = _json(tmp_path, DS)
    cfg = _merged(["experiment=gpt_tiny", f"deepspeed_config={path}"])
    # experiment=gpt_tiny sets data.micro_batch_size=8 (the JSON agrees: 32 / (2 x 2 devices)); zero/stage2
    # is the default group option, replaced
    assert (cfg.zero.stage, cfg.zero.reduce_bucket_size, cfg.zero.overlap_comm) == (1, 100000, False)
    assert cfg.data.micro_batch_size == 8 and cfg.trainer.accumulate_grad_batches == 2
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.precision.name.value == "fp32"
    assert validate_config(cfg) == cfg
    one_rank = _merged(["trainer.devices=1", f"deepspeed_config={path}"])  # the default experiment's 8 yields
    assert one_rank.data.micro_batch_size == 16
    # explicit values that agree with the JSON are fine
    assert _merged([f"deepspeed_config={path}", "zero=stage1", "data.micro_batch_size=8"]).zero.stage == 1


@pytest.mark.parametrize(("config", "precision", "knobs"), [
    (SEED_FP16, "fp16", {"loss_scale": 0.0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1.0}),
    (SEED_BF16, "bf16", {}),
])
def test_the_seed_configs_merge_into_the_groups(config: dict, precision: str, knobs: dict, tmp_path: Path) -> None:
    cfg = _merged(["experiment=gpt_tiny", f"deepspeed_config={_json(tmp_path, config)}"])
    assert cfg.precision.name.value == precision
    assert {k: getattr(cfg.precision, k) for k in knobs} == knobs
    assert (cfg.data.micro_batch_size, cfg.trainer.accumulate_grad_batches) == (8, 4)  # 64 / (4 x 2)
    assert cfg.zero.stage == 2  # no zero section: lightning_zero's default stays


@pytest.mark.parametrize(("overrides", "messages"), [
    (["zero.stage=2"], ["zero.stage=2 on the command line, but the DeepSpeed config", "zero_optimization.stage=1"]),
    (["zero=stage3"], ["zero.stage=3 on the command line", "zero_optimization.stage=1"]),
    (["data.micro_batch_size=2", "trainer.accumulate_grad_batches=4"],
     ["data.micro_batch_size=2 on the command line", "train_micro_batch_size_per_gpu=8 (train_batch_size=32 over 2",
      "trainer.accumulate_grad_batches=4 on the command line", "gradient_accumulation_steps=2"]),
    (["trainer.gradient_clip_val=0.5"], ["gradient_clipping=1.0"]),
    (["model.lr=0.1", "model.warmup_steps=3"], ["model.lr on the command line", "`optimizer` section",
                                                "model.warmup_steps on the command line", "`scheduler` section"]),
])
def test_explicit_command_line_values_must_agree_with_the_json(overrides: list[str], messages: list[str],
                                                               tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        _merged(["experiment=gpt_tiny", f"deepspeed_config={_json(tmp_path, DS)}", *overrides])
    for message in messages:
        assert message in str(info.value), str(info.value)


def test_bad_batch_triple_or_json_stops_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    seed = _json(tmp_path, SEED_BF16, "seed.json")
    ds, strict = _json(tmp_path, DS), _json(tmp_path, {**DS, "tensorboard": {"enabled": True}}, "extra.json")
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    assert main(["train", f"deepspeed_config={seed}", "trainer.devices=3"]) == 2
    err = capsys.readouterr().err
    assert "with trainer.devices=3: train_batch_size=64 is not divisible by gradient_accumulation_steps=4" in err
    assert "Fix: train_batch_size=60 or 72" in err
    assert main(["train", f"deepspeed_config={ds}", "zero=stage2"]) == 2
    assert "zero.stage=2 on the command line" in capsys.readouterr().err
    assert main(["train", f"deepspeed_config={strict}", "deepspeed_strict=true"]) == 2
    assert "does not support these keys and ignores them: tensorboard" in capsys.readouterr().err
    refused = _json(tmp_path, {**DS, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zpp.json")
    assert main(["train", f"deepspeed_config={refused}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`zero_optimization.zero_quantized_weights`=true" in err[0] and "not built" in err[0]
    assert main(["train", f"deepspeed_config={tmp_path / 'missing.json'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not list(run.iterdir())  # no output directory, no process


@pytest.mark.slow
def test_train_runs_two_ranks_from_a_deepspeed_json(tmp_path: Path, gloo_pool) -> None:
    (tmp_path / "conf").mkdir()
    path = _json(tmp_path / "conf", {**DS, "aio": {"block_size": 1048576}})  # a performance hint: warned once
    done = _train(tmp_path, "experiment=gpt_tiny", "deepspeed_config=conf/ds.json", "trainer.max_steps=3",
                  "trainer.enable_model_summary=false", pool=gloo_pool)
    out = done.output
    assert done.returncode == 0, out[-4000:]
    runs = [p for p in tmp_path.glob("outputs/*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    saved = OmegaConf.load(runs[0] / CONFIG_FILE)
    assert saved.deepspeed_config == path  # made absolute for the ranks
    assert (saved.zero.stage, saved.data.micro_batch_size, saved.trainer.accumulate_grad_batches) == (1, 8, 2)
    assert saved.trainer.gradient_clip_val == 1.0
    assert json.loads((runs[0] / "result.json").read_text())["global_step"] == 3
    # steps_per_print=1: DeepSpeed-style progress lines with the JSON's WarmupLR (log warmup over 2 steps)
    assert "[lightning-zero] step=1 lr=[0.0]" in out and "[lightning-zero] step=3 lr=[0.003]" in out, out[-3000:]
    assert out.count("does not support these keys and ignores them: aio.") == 1, out[-4000:]  # not per rank / check


# ---------------------------------------------------------------------------- defaults are not settings
def _train(tmp_path: Path, *args: str, pool: Any) -> Launch:
    """``lightning-zero train <args>`` in ``tmp_path``, its ranks in the pool (Note [shared launches] in
    tests/launches.py); one device trains in this process, as the command does."""
    return run_in_process(["train", *args], tmp_path, pool)


def test_group_defaults_yield_but_written_values_conflict_before_any_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The precision group's default (fp32) is no setting; precision=bf16 on the command line and
    micro_batch_size in experiment/gpt_tiny.yaml are: exit 2, one message naming both places, no run.
    (The command runs through ``cli.main`` in this process: it starts nothing, so a fresh interpreter
    would add only its start-up.)"""
    seed = _json(tmp_path, SEED_FP16, "fp16.json")
    cfg = _merged(["experiment=gpt_tiny", f"deepspeed_config={seed}"])
    assert cfg.precision.name.value == "fp16"  # the default fp32 yielded
    monkeypatch.chdir(tmp_path)
    code = main(["train", "experiment=gpt_tiny", "deepspeed_config=fp16.json", "precision=bf16"])
    out = capsys.readouterr()
    assert code == 2, out.err[-3000:]
    assert "precision.name='bf16' on the command line, but the DeepSpeed config" in out.err
    assert "gives fp16.enabled=true (precision fp16)" in out.err
    assert " object at 0x" not in out.err + out.out
    assert "Traceback" not in out.err and "launching" not in out.err + out.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16.json"]  # no output directory: nothing started
    batch = _json(tmp_path, {"train_batch_size": 32, "gradient_accumulation_steps": 4}, "batch.json")
    with pytest.raises(ValueError, match=r"data.micro_batch_size=8 in experiment/gpt_tiny.yaml, but the DeepSpeed "
                                         r"config .*batch.json gives train_micro_batch_size_per_gpu=4"):
        _merged(["experiment=gpt_tiny", f"deepspeed_config={batch}"])
    assert _merged([f"deepspeed_config={batch}"]).data.micro_batch_size == 4  # the default experiment yields


@pytest.mark.slow
@pytest.mark.parametrize("config", [SEED_FP16, SEED_BF16], ids=["fp16", "bf16"])
def test_the_seed_jsons_train_from_the_command_line(config: dict, tmp_path: Path, gloo_pool) -> None:
    _json(tmp_path, config, "seed.json")
    done = _train(tmp_path, "experiment=gpt_tiny", "deepspeed_config=seed.json", "trainer.max_steps=2",
                  "trainer.limit_val_batches=1", "trainer.enable_model_summary=false", pool=gloo_pool)
    out = done.output
    assert done.returncode == 0, out[-4000:]
    assert " object at 0x" not in out
    runs = [p for p in tmp_path.glob("outputs/*/*") if p.is_dir()]
    assert len(runs) == 1 and json.loads((runs[0] / "result.json").read_text())["global_step"] == 2
    saved = OmegaConf.load(runs[0] / CONFIG_FILE)
    assert saved.precision.name == ("fp16" if "fp16" in config else "bf16")


@pytest.mark.slow
def test_autotp_from_a_deepspeed_json_trains_two_ranks_and_its_checkpoint_resumes_without_tp(tmp_path: Path,
                                                                                              gloo_pool) -> None:
    """``tensor_parallel.autotp_size=2`` from the command line's JSON: the run is TP 2 on 2 ranks (its saved
    config says so), its step-3 checkpoint (sharded, ZeRO 2, the TP slices recorded) resumes on 1 rank without TP
    and logs the uninterrupted run's losses at steps 4-6."""
    import csv

    from lightning_zero.checkpoint import ShardedCheckpoint

    _json(tmp_path, {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}, "tp.json")
    _json(tmp_path, {"zero_optimization": {"stage": 2}}, "plain.json")
    run = ["experiment=gpt_tiny", "trainer.max_steps=6", "trainer.val_check_interval=null", "logger=csv",
           "trainer.log_every_n_steps=1", "data.max_bytes=200000", "trainer.checkpoint.every_n_train_steps=3",
           "trainer.checkpoint.save_top_k=-1", "trainer.enable_model_summary=false", "trainer.validate_at_start=false",
           "trainer.validate_at_end=false"]
    _train(tmp_path, *run, "deepspeed_config=tp.json", "trainer.devices=2", "hydra.run.dir=tp", pool=gloo_pool).check()
    saved = OmegaConf.load(tmp_path / "tp" / CONFIG_FILE)
    assert saved.tensor_parallel.size == 2 and saved.zero.stage == 2
    checkpoint = tmp_path / "tp" / "checkpoints" / "epoch=0-step=3.ckpt"
    assert ShardedCheckpoint(checkpoint).tensor_parallel.size == 2
    _train(tmp_path, *run, "deepspeed_config=plain.json", "trainer.devices=1", f"trainer.resume_from='{checkpoint}'",
           "hydra.run.dir=resumed", pool=gloo_pool).check()

    def losses(where: str) -> dict[int, float]:
        with open(tmp_path / where / "csv" / "metrics.csv") as f:
            return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}

    full, resumed = losses("tp"), losses("resumed")
    assert sorted(resumed) == [4, 5, 6], resumed
    assert max(abs(resumed[s] - full[s]) for s in resumed) < 1e-5, (full, resumed)


def test_autotp_size_sets_the_tensor_parallel_group_and_a_written_other_size_conflicts(tmp_path: Path) -> None:
    """The JSON's ``autotp_size`` fills ``tensor_parallel.size`` (and the batch triple counts data ranks only:
    32 samples over 4 ranks at TP 2 are 2 data ranks x 8 x accumulation 2); ``tensor_parallel=tp4`` written on
    the command line contradicts it before anything starts."""
    path = _json(tmp_path, {"train_batch_size": 32, "gradient_accumulation_steps": 2,
                            "tensor_parallel": {"autotp_size": 2}})
    cfg = _merged(["experiment=gpt_tiny", f"deepspeed_config={path}", "trainer.devices=4"])
    assert cfg.tensor_parallel.size == 2
    assert (cfg.data.micro_batch_size, cfg.trainer.accumulate_grad_batches) == (8, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel.size=4 on the command line, but the DeepSpeed config"):
        _merged(["experiment=gpt_tiny", f"deepspeed_config={path}", "trainer.devices=4", "tensor_parallel=tp4"])
