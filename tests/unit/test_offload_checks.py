"""Offload outside the step: ``nvme_path`` refused on the command line before any rank starts, the advisor's
NVMe suggestion runs, and the user's ``fused`` / ``foreach`` flags come back after fit and in checkpoints."""

from __future__ import annotations

import os
import tempfile
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroConfig, ZeroEngine, ZeroStrategy
from lightning_zero.checkpoint.reader import ShardedCheckpoint
from lightning_zero.cli import main
from lightning_zero.config.run.launch import check_jobs
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.zero.optimizer_state import full_optimizer_state, load_full_optimizer_state
from tests.models import TinyTransformer, make_trainer, token_loader

NVME_RUN = ["model=gpt_tiny", "zero=stage3", "offload=param_nvme", "precision=bf16"]


def _refusal(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one problem line of a ``train`` refused before launch (exit 2, nothing written)."""
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "lightning-zero train: error: invalid configuration:" and len(err) == 2, err
    assert not [p for p in Path.cwd().iterdir()]  # no output directory: no process started
    return err[1]


def test_the_cli_refuses_an_unusable_nvme_path_in_one_line_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    line = _refusal(NVME_RUN, capsys)  # conf/offload/param_nvme.yaml's /local_nvme does not exist here
    assert "'/local_nvme' does not exist" in line and "Fix: offload.nvme_path=<a writable directory" in line
    line = _refusal([*NVME_RUN, "offload.nvme_path=/proc"], capsys)
    assert "'/proc' is not on a disk" in line and "free" not in line.split("Fix:")[0]
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert "is not a directory" in _refusal([*NVME_RUN, f"offload.nvme_path={not_a_dir}"], capsys)
    # a disk without room for the estimator's figure of the node's offloaded state (2 ranks)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("lightning_zero.core.settings.offload.shutil.disk_usage", lambda path: usage(10**9, 0, 1000))
    line = _refusal([*NVME_RUN, f"offload.nvme_path={tmp_path}"], capsys)
    assert f"'{tmp_path}' has 1 kB free but the offloaded state needs 2.24 MB." in line
    assert line.endswith("Fix: offload.nvme_path=<a writable directory on a local disk with 2.24 MB free>.")


@pytest.mark.slow
def test_the_advisors_nvme_suggestion_passes_the_checks_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    advise = ["advise", "--model", "gpt_tiny", "--device-memory", "100kB", "--cpu-memory", "1MB", "--nvme", "10GB",
              "--world-size", "2"]
    for path in ([], ["--nvme-path", str(tmp_path)]):  # the temporary directory by default, or the one given
        assert main([*advise, *path]) == 0
        out = capsys.readouterr().out
        overrides = next(line for line in out.splitlines() if line.startswith("Hydra overrides: "))
        overrides = overrides.removeprefix("Hydra overrides: ").split()
        assert "offload=param_nvme" in overrides
        where = path[1] if path else tempfile.gettempdir()
        assert f"offload.nvme_path={where}" in overrides
        (cfg,) = check_jobs([["model=gpt_tiny", *overrides]])  # what `lightning-zero train` validates first
        assert cfg.offload.nvme_path == where
    # a directory that cannot hold the state: the advice says so and fails
    assert main([*advise, "--nvme-path", "/proc"]) == 1
    err = capsys.readouterr().err
    assert "'/proc' is not on a disk" in err and "Fix: --nvme-path=<a writable directory" in err


def test_the_registered_nvme_strategy_trains_by_name_in_the_temporary_directory() -> None:
    """``strategy="zero_stage_3_offload_nvme"`` once pointed at a hard-coded ``/local_nvme`` (refused)."""
    model = TinyTransformer()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer("zero_stage_3_offload_nvme", devices=1, max_steps=2)
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy) and strategy.offload.name == "param_nvme"
    assert strategy.offload.nvme_path == tempfile.gettempdir()
    trainer.fit(model, token_loader(n=16))
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------------------------------------- kernel flags
class FlagProbe(TinyTransformer):
    """The user's AdamW (torch's default: neither fused nor foreach set); records the flags at each step."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.flags_in_fit: list[list[Any]] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.flags_in_fit.append([g.get("fused") for g in self.trainer.optimizers[0].param_groups])


def test_the_users_kernel_flags_come_back_after_fit_and_in_checkpoints(tmp_path: Path) -> None:
    model = FlagProbe()
    before = [(g.get("fused"), g.get("foreach")) for g in model.configure_optimizers().param_groups]
    assert all(not fused for fused, _ in before)  # not fused: what offload switches
    save = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(ZeroStrategy(stage=2, offload_optimizer="cpu"), devices=1, max_steps=2,
                           enable_checkpointing=True, callbacks=[save])
    trainer.fit(model, token_loader(n=16))
    assert model.flags_in_fit and all(all(f) for f in model.flags_in_fit)  # stepped with the fused CPU kernel
    after = [(g.get("fused"), g.get("foreach")) for g in trainer.optimizers[0].param_groups]
    assert after == before
    saved = ShardedCheckpoint(os.path.join(str(tmp_path / "ckpt"), "epoch=0-step=2.ckpt")).optimizer_states()[0]
    assert [(g.get("fused"), g.get("foreach")) for g in saved["param_groups"]] == before


def test_a_resume_with_offload_steps_fused_and_hands_back_the_users_flags() -> None:
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=1), DataParallelComm(),
                        offload=OffloadConfig(optimizer_device="cpu"))

    state = full_optimizer_state(engine.sharded, engine.comm)
    assert [(g["fused"], g["foreach"]) for g in state["param_groups"]] == [(None, True)]  # the user's flags
    load_full_optimizer_state(engine.sharded, state)  # as a resume does: still stepped fused
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(True, False)]
    engine.detach()
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(None, True)]


# ---------------------------------------------------------------------------------------------- killed runs
def test_a_start_removes_only_the_empty_run_directories_of_this_users_dead_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from lightning_zero.core.offload.store import open_shard_store

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer exists
    stale = tmp_path / f"lightning_zero-{dead.pid}-r0-abc_12"
    kept = {
        "live": tmp_path / f"lightning_zero-{os.getpid()}-r1-xyz",  # this process: a run in progress
        "not_empty": tmp_path / f"lightning_zero-{dead.pid}-r1-def",  # holds something: never rmdir'd
        "other_name": tmp_path / f"lightning_zero_{dead.pid}-r0-abc",  # not the pattern
    }
    for d in (stale, *kept.values()):
        d.mkdir()
    (kept["not_empty"] / "keep").write_text("x")
    if os.getuid() == 0:  # another user's directory (only root can make one)
        kept["other_user"] = tmp_path / f"lightning_zero-{dead.pid}-r2-ghi"
        kept["other_user"].mkdir()
        os.chown(kept["other_user"], 12345, 12345)
    store = open_shard_store(OffloadConfig(optimizer_device="nvme", nvme_path=str(tmp_path)))
    try:
        assert not stale.exists()
        assert all(d.exists() for d in kept.values())
        assert os.path.isdir(store.directory.name)  # this run's own directory
    finally:
        store.close()
