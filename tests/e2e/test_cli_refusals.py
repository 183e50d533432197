"""What a newcomer's mistakes meet before anything starts (issue 45): a bad checkpoint to resume from, a GPU on a
machine without one, a text file too small for the run's validation interval, every problem of a DeepSpeed JSON at
once, a number where a config group takes an option's name, a memory size without its unit.

Each is refused before launch: exit code 2, at most 5 lines, no rank started, no output directory. One real CLI
process per kind of refusal (:func:`_refused_by_the_cli`, on the background lane); the variants of a kind call the
CLI's entry point in this process (:func:`_refused_in_process`, with the launch replaced by a failure: nothing may
reach it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.cli import main
from tests.lane import Run

ROOT = Path(__file__).resolve().parents[2]
FORMAT1 = ROOT / "tests" / "data" / "checkpoint_format1_stage2"  # a real 2-rank stage-2 checkpoint
LAUNCHED = ("launching", "Initializing distributed", "GPU available", "run directory")


def _check_refusal(code: int, text: str, before: set[str], after: set[str]) -> list[str]:
    lines = text.strip().splitlines()
    assert code == 2, text[-3000:]
    assert 1 <= len(lines) <= 5, lines
    assert not any(marker in text for marker in LAUNCHED), text  # no rank, no run started
    assert after == before  # no output directory
    return lines


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _refused_by_the_cli(prepare: Callable[[Path], tuple[list[str], Path]]) -> Run:
    """A run for the background lane (Note [background lane] in tests/lane.py): ``prepare(directory)`` writes what
    the command reads and gives ``(ARGS, cwd)``; then ``python -m lightning_zero ARGS`` in ``cwd``. Its result:
    the exit code, the output, the arguments and ``cwd``'s names before and after (:func:`_refused`)."""

    def run(directory: Path) -> dict[str, Any]:
        args, cwd = prepare(directory)
        before = _names(cwd)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        done = subprocess.run([sys.executable, "-m", "lightning_zero", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        return {"code": done.returncode, "text": done.stdout + done.stderr, "args": args, "before": before,
                "after": _names(cwd)}

    return run


def _refused(result: dict[str, Any]) -> str:
    """The output of a run of :func:`_refused_by_the_cli`, refused as the module docstring says."""
    _check_refusal(result["code"], result["text"], result["before"], result["after"])
    return result["text"]


def _refused_in_process(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> str:
    """``lightning_zero.cli.main(ARGS)`` in ``cwd``, its launch made to fail: refused as the module docstring says."""
    import lightning_zero.config.run.launch as launch

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run was launched")

    monkeypatch.setattr(launch, "run_job", launched)
    monkeypatch.chdir(cwd)
    before = _names(cwd)
    code = main(args)
    out = capsys.readouterr()
    text = out.out + out.err
    _check_refusal(code, text, before, _names(cwd))
    return text


# ---------------------------------------------------------------------------------------- 1. bad checkpoints
def _checkpoints(directory: Path) -> Path:
    """A run's ``checkpoints/`` folder in ``directory``: ``last.ckpt -> last.ckpt.v1``, a copy of the 2-rank stage-2
    checkpoint."""
    folder = directory / "run" / "checkpoints"
    shutil.copytree(FORMAT1, folder / "last.ckpt.v1")
    (folder / "last.ckpt").symlink_to("last.ckpt.v1")
    return folder


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    return _checkpoints(tmp_path)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _truncated_rank_file(directory: Path) -> tuple[list[str], Path]:
    checkpoints = _checkpoints(directory)
    _truncate(checkpoints / "last.ckpt.v1" / "rank-00001.safetensors")
    cwd = directory / "cwd"
    cwd.mkdir()
    return ["train", "experiment=gpt_tiny", f"trainer.resume_from={checkpoints / 'last.ckpt'}"], cwd


@pytest.mark.lane(run=_refused_by_the_cli(_truncated_rank_file))  # a process of its own: tests/lane.py
def test_a_truncated_rank_file_is_refused_before_launch(lane_result: dict[str, Any]) -> None:
    text = _refused(lane_result)
    assert "rank-00001.safetensors is not a valid safetensors file" in text and "truncated" in text, text


def test_a_truncated_metadata_file_is_refused_before_launch(checkpoints: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _truncate(checkpoints / "last.ckpt.v1" / "metadata.json")
    text = _refused_in_process(["train", "experiment=gpt_tiny", f"trainer.resume_from={checkpoints}"], tmp_path,
                               monkeypatch, capsys)
    assert "metadata.json is not JSON; refused" in text, text  # the folder resolved to its last.ckpt


def test_another_model_s_checkpoint_names_the_shapes_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A gpt_small checkpoint (written by one rank, whole) resumed into gpt_tiny, given as the run's checkpoints/."""
    from lightning_zero.checkpoint.publish import save_sharded
    from lightning_zero.models.gpt_model import state_shapes

    state = {key: torch.zeros(shape) for key, shape in state_shapes("gpt_small").items()}
    folder = tmp_path / "run" / "checkpoints"
    save_sharded(folder / "last.ckpt", {"state_dict": state, "optimizer_states": [], "global_step": 3,
                                        "hyper_parameters": {"model": "gpt_small"}}, None, 0, 1,
                 broadcast=lambda name: name, failed_ranks=lambda failed: [0] if failed else [])
    text = _refused_in_process(["train", "experiment=gpt_tiny", f"trainer.resume_from={folder}"], tmp_path,
                               monkeypatch, capsys)
    assert "holds another model than model=gpt_tiny: model.tok_emb.weight is [256, 256] in the checkpoint, " \
           "[256, 64] in the model" in text, text
    assert "Fix: resume with the model that wrote it (model=gpt_small)" in text


def test_a_folder_of_checkpoints_resumes_from_its_last_ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's ``checkpoints/`` folder given for ``last.ckpt``: what the fit (and the ranks' config.yaml) get."""
    from lightning_zero.checkpoint.publish import save_sharded
    from lightning_zero.config.model_zoo import gpt_config
    from lightning_zero.config.paths import FitResult
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.schema import to_train_config
    from lightning_zero.models.gpt_model import state_shapes

    model = to_train_config(compose_config(["experiment=gpt_tiny"])).model
    folder = tmp_path / "run" / "checkpoints"
    state = {key: torch.zeros(shape) for key, shape in state_shapes(gpt_config(model)).items()}
    save_sharded(folder / "last.ckpt", {"state_dict": state, "optimizer_states": [], "global_step": 3}, None, 0, 1,
                 broadcast=lambda name: name, failed_ranks=lambda failed: [0] if failed else [])
    resumed: list[str | None] = []

    def fit(cfg, run_dir):  # the in-process fit, recorded
        resumed.append(cfg.trainer.resume_from)
        return FitResult(3, 0.0, None, None, [], resumed_at=3)

    monkeypatch.setattr("lightning_zero.config.run.build.fit", fit)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "experiment=gpt_tiny", "trainer=cpu1", f"trainer.resume_from={folder}",
                 "hydra.run.dir=out"]) == 0
    assert resumed == [str(folder / "last.ckpt")]
    assert f"resume_from: {folder / 'last.ckpt'}" in (tmp_path / "out" / "config.yaml").read_text()


def test_what_is_checked_of_a_checkpoint_before_launch(checkpoints: Path, tmp_path: Path) -> None:
    """A folder of checkpoints resolves to its last.ckpt (else its checkpoints are named); a whole checkpoint opens;
    a cut single file (stage 0: torch.save's zip) is refused; all without reading a tensor."""
    from lightning_zero.checkpoint import CheckpointError
    from lightning_zero.checkpoint.reader import open_to_resume, resume_path

    assert resume_path(checkpoints) == checkpoints / "last.ckpt"
    assert open_to_resume(resume_path(checkpoints)).world_size == 2
    (checkpoints / "last.ckpt").unlink()
    (checkpoints / "epoch=0-step=3.ckpt").symlink_to("last.ckpt.v1")
    with pytest.raises(CheckpointError, match=r"without a last.ckpt: name one of them, e.g. .*epoch=0-step=3.ckpt"):
        resume_path(checkpoints)
    single = tmp_path / "stage0.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, single)
    assert open_to_resume(single) is None
    _truncate(single)
    with pytest.raises(CheckpointError, match="is truncated or damaged"):
        open_to_resume(single)


# ---------------------------------------------------------------------------------------- 2. a GPU without one
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPU the command asks for")
@pytest.mark.slow
@pytest.mark.lane(run=_refused_by_the_cli(lambda directory: (["train", "experiment=gpt_125m_gpu"], directory)))
def test_a_gpu_experiment_on_a_machine_without_one_names_the_cpu_trainers(lane_result: dict[str, Any]) -> None:
    text = _refused(lane_result)
    assert "this machine has no GPU that torch can use" in text
    assert "Fix: trainer=cpu2 trainer.devices=2 (2 CPU processes) or trainer=cpu1 trainer.devices=1." in text


def test_trainer_gpu_without_a_gpu_is_one_line_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = _refused_in_process(["train", "trainer=gpu"], tmp_path, monkeypatch, capsys)
    assert "Fix: trainer=cpu2 (2 CPU processes) or trainer=cpu1." in text and "Traceback" not in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU, asked for two
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    text = _refused_in_process(["train", "trainer=gpu", "trainer.devices=2"], tmp_path, monkeypatch, capsys)
    assert "trainer.devices=2 GPU ranks, but this machine has 1 GPU(s). Fix: trainer.devices=1." in text


# ---------------------------------------------------------------------------------------- 3. a small text file
def _small_text_file(directory: Path) -> tuple[list[str], Path]:
    corpus = directory / "notes.txt"
    corpus.write_text("some words of my own\n" * 524)  # 11,004 bytes, about the README's size
    cwd = directory / "cwd"
    cwd.mkdir()
    return ["train", "experiment=gpt_text_file", f"data.path={corpus}"], cwd


@pytest.mark.slow
@pytest.mark.lane(run=_refused_by_the_cli(_small_text_file))  # a process of its own: tests/lane.py
def test_a_text_file_smaller_than_the_validation_interval_says_its_size_and_what_to_set(
        lane_result: dict[str, Any]) -> None:
    text = _refused(lane_result)
    corpus = lane_result["args"][-1].removeprefix("data.path=")
    # 10,454 training bytes: 81 samples of 128; 41 on each of 2 ranks (padded): 5 batches of 8
    assert f"trainer.val_check_interval=100 steps is more than one epoch: data.path={corpus} holds 11,005 bytes: " \
           "81 training samples of data.seq_len=128" in text, text
    assert "5 batch(es) of data.micro_batch_size=8 per epoch on each of 2 data-parallel rank(s). Fix: " \
           "trainer.val_check_interval=5 or less, trainer.check_val_every_n_epoch=null" in text


def test_a_text_file_smaller_than_one_batch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("x" * 1000)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    text = _refused_in_process(["train", "experiment=gpt_text_file", f"data.path={corpus}"], cwd, monkeypatch, capsys)
    assert "0 batch(es) of data.micro_batch_size=8 per epoch on each of 2 data-parallel rank(s): no training " \
           "batch. Fix: more data" in text, text


def test_the_counted_batches_are_lightning_s(tmp_path: Path) -> None:
    """The count before launch is the one the data module and Lightning's sampler make (padded or dropped)."""
    from lightning_zero.config.model_checks import epoch_problems
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.schema import to_train_config
    from lightning_zero.models.data import TextDataModule

    corpus = tmp_path / "notes.txt"
    corpus.write_text("some words of my own\n" * 524)
    for order in (False, True):
        data = TextDataModule(seq_len=128, micro_batch_size=8, path=str(corpus), deterministic_order=order)
        data.setup()
        samples = len(data.train_dataset)
        per_rank = samples // 2 if order else -(-samples // 2)
        cfg = to_train_config(compose_config(["experiment=gpt_text_file", f"data.path={corpus}",
                                              f"data.deterministic_order={order}"]))
        assert f"{samples} training samples" in epoch_problems(cfg)[0]  # 2 ranks: trainer=cpu2
        assert f"{per_rank // 8} batch(es)" in epoch_problems(cfg)[0]


# ---------------------------------------------------------------------------------------- 4. one error at a time
def _broken_json(directory: Path) -> tuple[list[str], Path]:
    (directory / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 8, "gradient_clipping": -1,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    return ["train", "experiment=gpt_tiny", "deepspeed_config=ds.json"], directory


@pytest.mark.lane(run=_refused_by_the_cli(_broken_json))  # a process of its own: tests/lane.py
def test_every_problem_of_a_deepspeed_json_at_once(lane_result: dict[str, Any]) -> None:
    """It asked for offload_optimizer first, and for the nvme_path only once that was fixed."""
    text = _refused(lane_result)
    assert text.strip().splitlines() == [
        "lightning-zero train: error: DeepSpeed config: ds.json: 3 problems:",
        "  - `gradient_clipping` must be >= 0, got -1.0.",
        "  - zero_optimization.offload_param.device='nvme' moves the optimizer state with the parameters, so the "
        "optimizer must be offloaded too. Fix: also set zero_optimization.offload_optimizer.device='nvme'.",
        "  - zero_optimization.offload_param.device='nvme' keeps its swap files under "
        "zero_optimization.offload_optimizer.nvme_path: an existing, writable directory on a local disk. Fix: "
        "zero_optimization.offload_optimizer.nvme_path=<a writable directory on a local disk>."]


@pytest.mark.parametrize(("args", "line"), [
    (["zero=3"], "zero=3: a config group takes an option's name, not a number. Did you mean zero=stage3? "
                 "Options: stage0, stage1, stage2, stage3."),
    (["-m", "tensor_parallel=none,2"], "tensor_parallel=2: a config group takes an option's name, not a number. "
                                       "Did you mean tensor_parallel=tp2?"),
])
def test_a_number_for_a_config_group_names_the_option(args: list[str], line: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Hydra said "Config group override must be a string or a list. Got int", naming no group."""
    text = _refused_in_process(["train", *args], tmp_path, monkeypatch, capsys)
    assert line in text and "Got int" not in text, text


@pytest.mark.lane(run=_refused_by_the_cli(lambda directory: (
    ["advise", "--params", "7.5e9", "--device-memory", "80", "--world-size", "8"], directory)))
def test_a_memory_size_without_its_unit_is_refused_with_the_units(lane_result: dict[str, Any]) -> None:
    """``--device-memory 80`` was 80 bytes: "Nothing fits"."""
    text = _refused(lane_result)
    assert text.strip().splitlines() == [
        "lightning-zero advise: error: argument --device-memory: memory size '80' has no unit (it would be 80 "
        "bytes); write it like 80GB (10^9 bytes) or 80GiB (2^30); units: B, kB, MB, GB, TB, PB (powers of 1000), "
        "KiB, MiB, GiB, TiB, PiB.",
        "(`lightning-zero advise --help` lists the options)"]
