"""``lightning-zero train`` end to end: 2 CPU ranks under torch.distributed.run, a Hydra multirun over
two ZeRO stages (one output directory per run, with its config, TensorBoard events and checkpoint),
rank failures reaching the exit code, and invalid configurations stopped before anything starts.

The two runs are the docs' commands (docs/configs.md), shared with tests/e2e/test_docs.py and
test_cli_runs.py (Note [shared launches] in tests/launches.py): the 2-rank run is a real launch, the
multirun's ranks run in the pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_zero.cli import main
from lightning_zero.config.run.launch import CONFIG_FILE, RankFailure, compose_config, launch_ranks
from lightning_zero.config.schema import to_yaml
from lightning_zero.config.validate import validate_config
from tests.launches import GPT_TINY, MULTIRUN, SharedLaunches, assert_clean_exit

TINY = ["experiment=gpt_tiny", "trainer.max_steps=3", "trainer.enable_model_summary=false"]


def _check_run_dir(run: Path, steps: int) -> dict:
    """One run's output directory: Hydra's composed config, ours, TensorBoard events, checkpoints, result."""
    assert (run / ".hydra" / "config.yaml").is_file() and (run / ".hydra" / "overrides.yaml").is_file()
    assert (run / CONFIG_FILE).is_file()
    assert list((run / "tb").glob("events.out.tfevents.*")), sorted(run.rglob("*"))
    assert (run / "checkpoints" / "last.ckpt").exists()  # a file (stage 0) or a sharded directory
    result = json.loads((run / "result.json").read_text())
    assert result["global_step"] == steps and result["val_loss_end"] < result["val_loss_start"]
    return result


@pytest.mark.slow
@pytest.mark.real_launch(("lightning-zero", *GPT_TINY))  # the session's (tests/launches.py)
def test_train_runs_two_cpu_ranks_in_one_output_directory(launches: SharedLaunches) -> None:
    done = launches.cli(*GPT_TINY).check()
    assert_clean_exit(done.output)  # the soak's check (tests/e2e/test_soak.py, a long check) on this launch
    assert "MEMBER: 2/2" in done.output and "--nproc_per_node=2" in done.output  # two ranks, launched by torchrun
    made = sorted(p.name for p in done.cwd.iterdir() if not p.is_symlink())  # the links: the repository's files
    assert made == ["outputs"]  # no lightning_logs, no stray Hydra dirs
    runs = [p for p in done.cwd.glob("outputs/*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    _check_run_dir(runs[0], steps=20)
    saved = OmegaConf.load(runs[0] / CONFIG_FILE)
    assert saved.trainer.devices == 2 and saved.zero.stage == 2 and saved.name == "gpt_tiny"


@pytest.mark.slow
def test_multirun_over_two_zero_stages_leaves_one_directory_per_run(launches: SharedLaunches) -> None:
    """docs/configs.md's multirun, its ranks in the session's pool (the real launch of a run, its console and its
    ranks' exits: test_train_runs_two_cpu_ranks_in_one_output_directory, test_cli_runs.py)."""
    done = launches.pool_cli(*MULTIRUN).check()
    tmp_path = done.cwd
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == ["multirun"]
    sweeps = list(tmp_path.glob("multirun/*/*"))
    assert len(sweeps) == 1, sweeps  # the ranks never re-entered Hydra: no second sweep
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0_gpt_tiny-zero1-fp32", "1_gpt_tiny-zero2-fp32"]  # named by their choices
    results = [_check_run_dir(job, steps=20) for job in jobs]
    assert [OmegaConf.load(job / CONFIG_FILE).zero.stage for job in jobs] == [1, 2]
    assert ["zero=stage1" in (job / ".hydra" / "overrides.yaml").read_text() for job in jobs] == [True, False]
    # ZeRO is exact: the same data and seed give the same losses at stage 1 and stage 2
    assert results[0]["val_loss_end"] == pytest.approx(results[1]["val_loss_end"], rel=1e-4)


@pytest.mark.slow
def test_a_failing_rank_fails_the_launch(tmp_path: Path) -> None:
    cfg = validate_config(compose_config(TINY))
    cfg.data.path = str(tmp_path / "vanished.txt")  # validated in the parent, gone when the ranks start
    (tmp_path / CONFIG_FILE).write_text(to_yaml(cfg))
    with pytest.raises(RankFailure, match="exit code"):
        launch_ranks(tmp_path / CONFIG_FILE, devices=2)


@pytest.mark.parametrize(("args", "message"), [
    (["-m", "zero=stage3,stage2", "offload=param_cpu"],
     "job [zero=stage2 offload=param_cpu]: invalid configuration:\n"
     "  - offload.param_device='cpu' needs ZeRO stage 3"),
    (["offload=param_cpu"], "offload.param_device='cpu' needs ZeRO stage 3"),
    (["precision=bf16", "precision.reduce_dtype=int8"], "`reduce_dtype` must be a floating dtype"),
    (["pipeline=pp2_1f1b", "data.micro_batch_size=6"], "does not split into pipeline.micro_batches=8"),
    (["zero.stagee=1"], "Could not override 'zero.stagee'. Did you mean zero.stage?"),
    (["+trainer.devicez=2"], "Key 'devicez' not in 'TrainerSchema'"),
])
def test_bad_configurations_stop_before_anything_starts(args: list[str], message: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no output directory, no process


@pytest.mark.parametrize(("args", "line"), [
    (["zero=stag2"], "zero=stag2: no such option in conf/zero/. Did you mean zero=stage2? "
                     "Options: stage0, stage1, stage2, stage3."),
    (["zero=zero_schema"], "zero=zero_schema: `zero_schema` is the typed schema behind conf/zero/, not an option. "
                           "Options: stage0, stage1, stage2, stage3."),
    (["-m", "offload=none,offload_schema"], "offload=offload_schema: `offload_schema` is the typed schema"),
])
def test_a_bad_group_choice_is_one_line_that_lists_only_real_options(args: list[str], line: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Hydra printed 12-15 lines (its search path) and listed the ``*_schema`` entries, which trained silently."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert "_schema" not in err[0].partition("Options:")[2]
    assert not list(tmp_path.iterdir())


def test_hydra_flags_pass_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "zero: stage0, stage1, stage2, stage3" in text and "experiment: " in text
    assert main(["train", "experiment=gpt_tiny", "zero=stage1", "--cfg", "job"]) == 0
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.zero.stage == 1 and shown.model.preset == "gpt_tiny"
    assert compose_config(["zero=stage0"]).zero.stage == 0  # Hydra's global state was released
    assert not list(tmp_path.iterdir())


def test_a_one_bit_adam_freeze_step_past_the_run_warns_once_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/onebit_adam.md's command had model.freeze_step=30 on gpt_tiny's 20 steps: it never compressed."""
    from types import SimpleNamespace

    import lightning_zero.config.run.launch as launch

    started: list[int] = []

    def fake_run_job(cfg, run_dir, overrides=()):  # the launch itself is not what this checks
        started.append(1)
        return SimpleNamespace(val_loss_end=1.0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "run_job", fake_run_job)
    onebit = ["experiment=gpt_tiny", "zero=stage0", "model.optimizer=onebit_adam"]
    assert main(["train", *onebit, "model.freeze_step=30"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: model.freeze_step=30 >= trainer.max_steps=20: 1-bit Adam stays in its AdamW "
                     "warm-up for the whole run and never compresses. Fix: model.freeze_step=10") == 1, err
    assert main(["train", *onebit, "model.freeze_step=10"]) == 0  # the documented command: no warning
    assert "freeze_step" not in capsys.readouterr().err
    assert len(started) == 2
