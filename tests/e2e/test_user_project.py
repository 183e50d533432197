"""A project written for plain Lightning, outside the package (``tests/data/user_project``: its own ``conf/``, a
LightningModule and a DataModule that know nothing of lightning_zero, a callback, its own ``train_plain.py``), trained
by ``lightning-zero train --config-dir conf`` from its own directory at ZeRO stages 0-3 (stage 3 a real launch with no
``PYTHONPATH``; stages 0-2 one multirun with the ranks in the test session's pool). Each stage's per-step losses, on
each rank, equal those of the project's own plain Lightning DDP script with the same seed (its ``train_plain.py``, run
in the warm gloo pool); the module's own record shows its yaml arguments (and the optimizer and scheduler the yaml
gives it) arrived; the callbacks and the CSV logger chosen by ``_target_`` ran."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.lane import Lane
from tests.launches import SharedLaunches

PROJECT = Path(__file__).resolve().parents[1] / "data" / "user_project"
STEPS, SEED = 3, 7
CLI = str(Path(sys.executable).parent / "lightning-zero")  # the console script, as a user runs it
RUN = ["--config-dir", "conf", "model=wave_net", "data=wave_data", "callbacks=default", "logger=csv_file",
       f"trainer.max_steps={STEPS}", f"seed={SEED}", "trainer.val_check_interval=null",
       "trainer.log_every_n_steps=1"]


def copy_project(root: Path) -> Path:
    """The project in a fresh directory (its runs write there, never into the repository)."""
    return Path(shutil.copytree(PROJECT, root / "project", ignore=shutil.ignore_patterns("__pycache__")))


def user_env() -> dict[str, str]:
    """A user's shell's environment: no PYTHONPATH (the project is found from the directory the command runs in)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTNING_ZERO_PROJECT_DIR")}


def lightning_zero(args: list[str], cwd: Path, timeout: int = 480) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


def _run_stage3(root: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The real launch of stage 3 from a copy of the project: its run directory and the command's run."""
    run = root / "stage3"
    return run, lightning_zero(["train", *RUN, "zero=stage3", f"hydra.run.dir={run}"], copy_project(root))


STAGE3 = "user project: stage 3"  # its key on the background lane, started when collection ends
pytestmark = pytest.mark.lane(run=_run_stage3, key=STAGE3)  # Note [background lane] in tests/lane.py


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory: pytest.TempPathFactory, launches: SharedLaunches, lane: Lane) -> dict[int, Path]:
    """The project at ZeRO stages 0, 1, 2 and 3, 2 ranks each: stage 3 a real launch of the console script (its
    ranks find the project through torchrun, with no PYTHONPATH; on the background lane), stages 0-2 one multirun
    with its ranks in the session's pool (Note [shared launches] in tests/launches.py: the same command, the same
    ranks' code)."""
    root = tmp_path_factory.mktemp("user_project")
    stage3, done = lane.result(STAGE3, _run_stage3)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    pooled = copy_project(root / "pooled")
    launches.pool_cli("train", "-m", *RUN, "zero=stage0,stage1,stage2", f"hydra.sweep.dir={root / 'sweep'}",
                      cwd=pooled).check()
    runs = {int(p.name[0]): p for p in (root / "sweep").iterdir() if p.is_dir() and p.name[0].isdigit()}
    return {**runs, 3: stage3}


def plain_ddp_body(project: str) -> dict[str, Any]:
    """The project's own ``train_plain.py`` (``L.seed_everything`` + ``Trainer(strategy="ddp")``) on this rank."""
    sys.path.insert(0, project)
    try:
        from train_plain import main
    finally:
        sys.path.remove(project)
    model = main(root_dir=os.getcwd(), max_steps=STEPS, seed=SEED)
    return json.loads((Path.cwd() / f"record_rank{model.global_rank}.json").read_text())


@pytest.fixture(scope="module")
def plain_ddp(gloo_pool) -> list[dict[str, Any]]:
    return gloo_pool.run("tests.e2e.test_user_project:plain_ddp_body", project=str(PROJECT))


def _record(run: Path, rank: int) -> dict[str, Any]:
    return json.loads((run / f"record_rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_every_stage_trains_the_losses_of_plain_lightning_ddp_with_the_same_seed(stage_runs, plain_ddp) -> None:
    assert sorted(stage_runs) == [0, 1, 2, 3]
    for stage, run in sorted(stage_runs.items()):
        for rank, plain in enumerate(plain_ddp):
            record = _record(run, rank)
            assert record["world_size"] == plain["world_size"] == 2
            assert len(record["losses"]) == STEPS
            assert record["losses"] == pytest.approx(plain["losses"], rel=1e-5), (stage, rank)
        assert _record(run, 0)["losses"] != _record(run, 1)["losses"]  # each rank its own batches
        assert json.loads((run / "result.json").read_text())["layout"]["world_size"] == 2


@pytest.mark.slow
def test_the_modules_own_record_shows_its_yaml_arguments_arrived(stage_runs) -> None:
    """tests/data/user_project/conf/model/wave_net.yaml: width 40, depth 2, dropout 0.1, an Adam partial at lr 0.01
    and a StepLR partial halving it every 2 steps (0.005 after 3 steps)."""
    for run in stage_runs.values():
        record = _record(run, 0)
        assert record["hparams"] == {"width": 40, "depth": 2, "dropout": 0.1, "record_name": "record"}
        assert record["optimizer"] == "Adam" and record["lr"] == pytest.approx(0.005)


@pytest.mark.slow
def test_callbacks_and_a_csv_logger_chosen_by_target_run(stage_runs) -> None:
    for run in stage_runs.values():
        assert (run / "steps.txt").read_text().split() == ["1", "2", "3"]  # wave.callbacks.StepTrace
        with open(run / "csv_file" / "version_0" / "metrics.csv") as f:  # CSVLogger, save_dir: the run directory
            rows = list(csv.DictReader(f))
        assert any(r.get("lr-Adam") for r in rows)  # LearningRateMonitor, from callbacks/default.yaml
        assert any(r.get("val_loss") for r in rows)
