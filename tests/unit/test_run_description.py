"""What a run says it is, and what a newcomer reads on the way (issue 45): ``--help`` lists the options only, a TP /
SP / pipeline / sparse / offload / precision run names itself so in its header line, run directory and HParams, its
model summary says "per rank", a sparse layout that is dense at the run's length is warned about, a run in one
process prints each line once, and memory tags carry their unit."""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_zero.cli import main
from lightning_zero.config.describe import describe
from lightning_zero.config.run.launch import compose_config
from lightning_zero.config.validate import config_warnings, validate_config


def _config(*overrides: str):  # a TrainConfig
    return validate_config(compose_config(["experiment=gpt_tiny", *overrides]))


# ---------------------------------------------------------------------------------------- 5. --help
@pytest.mark.slow
def test_help_lists_the_options_of_each_group_and_no_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Hydra listed the ConfigStore's schemas (``zero_schema``, ``gpt_schema``, ...) as options, refused when chosen."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    groups = text.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "zero: stage0, stage1, stage2, stage3\n" in groups and "model: gpt_125m, " in groups
    assert "trainer: cpu1, cpu2, debug, gpu\n" in groups
    assert "_schema" not in groups, groups
    assert "stage: 2" in text.split("== Config ==")[1]  # the composed config still follows
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------- 6. what a run is
@pytest.mark.parametrize(("overrides", "header", "directory", "hparams"), [
    ([], "ZeRO stage 2, fp32, offload=none, 2 x cpu", "gpt_tiny-zero2-fp32",
     {"tensor_parallel": 1, "sequence_parallel": 1, "expert_parallel": 1, "attention": "dense", "pipeline": "none"}),
    (["tensor_parallel=tp2"], "ZeRO stage 2, fp32, offload=none, tensor parallel 2, 2 x cpu", "gpt_tiny-zero2-fp32-tp2",
     {"tensor_parallel": 2}),
    (["sequence_parallel=sp2"], "offload=none, sequence parallel 2, 2 x cpu", "gpt_tiny-zero2-fp32-sp2",
     {"sequence_parallel": 2}),
    (["pipeline=pp2_1f1b", "zero=stage1"], "ZeRO stage 1, fp32, offload=none, pipeline 2 stages, one_f_one_b, 2 x cpu",
     "gpt_tiny-zero1-fp32-pp2_1f1b", {"pipeline": "2 stages, one_f_one_b"}),
    (["expert_parallel=ep2", "model.moe.num_experts=4"], "offload=none, expert parallel 2, 2 x cpu",
     "gpt_tiny-zero2-fp32-ep2", {"expert_parallel": 2}),
    (["model.attention=sparse_bigbird"], "offload=none, attention sparse_bigbird, 2 x cpu",
     "gpt_tiny-zero2-fp32-sparse_bigbird", {"attention": "sparse_bigbird"}),
    (["zero=stage3", "offload=param_cpu", "precision=bf16"], "ZeRO stage 3, bf16, offload=param_cpu, 2 x cpu",
     "gpt_tiny-zero3-bf16-param_cpu", {"offload": "param_cpu", "precision": "bf16"}),
])
def test_header_run_directory_and_hparams_name_every_dimension_that_is_not_the_default(
        overrides: list[str], header: str, directory: str, hparams: dict, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP, SP or sparse run read ``ZeRO stage 2, fp32, offload=none, 2 x cpu`` / ``gpt_tiny-zero2-fp32`` like a plain
    one, and its hparams had no tensor, sequence or attention key."""
    from hydra import compose, initialize_config_dir

    from lightning_zero.config.paths import conf_dir, register_configs, register_run_name
    from lightning_zero.config.run.build import run_hparams

    cfg = _config(*overrides)
    assert describe(cfg).endswith(header), describe(cfg)
    assert {k: run_hparams(cfg)[k] for k in hparams} == hparams
    register_configs()
    register_run_name()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):  # the directory Hydra names the run with
        composed = compose("config", overrides=["experiment=gpt_tiny", *overrides], return_hydra_config=True)
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(composed)
        assert composed.hydra.run.dir.endswith(f"_{directory}"), composed.hydra.run.dir


def test_the_model_summary_says_per_rank_under_tensor_parallel_and_pipelines(caplog: pytest.LogCaptureFixture) -> None:
    """Under TP it showed one rank's slice (66.9 K) as the model's size."""
    from lightning.pytorch.utilities.model_summary import summarize

    from lightning_zero.observability.model_summary import ZeroModelSummary, per_rank_note
    from tests.models import TinyTransformer

    module = TinyTransformer()
    whole = SimpleNamespace(strategy=SimpleNamespace(pipelined=False))
    assert per_rank_note(whole, module) is None
    module.head.weight.tp_split_dim = 0  # what a tensor-parallel layer's parameters carry (Note [split tags])
    staged = SimpleNamespace(strategy=SimpleNamespace(pipelined=True))
    note = per_rank_note(staged, module)
    assert note == ("Per rank: the layers tensor parallelism splits hold only this rank's slices; only this rank's "
                    "pipeline stage is built.")
    summary = summarize(module)
    with caplog.at_level(logging.INFO):
        ZeroModelSummary.summarize(summary._get_summary_data(), summary.total_parameters,
                                   summary.trainable_parameters, summary.model_size, summary.total_training_modes,
                                   0, per_rank=note)
    lines = caplog.text.splitlines()
    assert any(line.endswith("Trainable params per rank") for line in lines), caplog.text
    assert any(line.endswith("Total params per rank") for line in lines) and lines[-1] == note


# ---------------------------------------------------------------------------------------- 7. dense sparse layouts
@pytest.mark.slow
def test_a_sparse_layout_that_is_dense_at_the_run_s_length_is_warned_about_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """gpt_tiny's 64 tokens are 4 blocks of 16, and sparse_fixed's windows are 4 blocks: its losses equalled dense's
    exactly, at 3x the time."""
    import lightning_zero.config.run.launch as launch

    dense = config_warnings(_config("model.attention=sparse_fixed"))
    assert dense == ["model.attention=sparse_fixed is dense at data.seq_len=64 (4 blocks of 16): its layout keeps "
                     "every block a causal query sees, so it computes dense attention's result, slower. It is sparse "
                     "from 80 tokens: data.seq_len=80 or more (and model.seq_len, the model's context, at least that). "
                     "Or model.attention=dense."]
    assert config_warnings(_config("model.attention=sparse_fixed", "model.seq_len=256", "data.seq_len=256")) == []
    assert config_warnings(_config("model.attention=sparse_dense")) == []  # dense on purpose (a comparison)
    assert config_warnings(_config("model.attention=sparse_bigbird")) == []  # sparse at 64 tokens already
    monkeypatch.setattr(launch, "run_job", lambda cfg, run_dir, overrides=(): SimpleNamespace(val_loss_end=1.0))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "experiment=gpt_tiny", "model.attention=sparse_fixed", "hydra.run.dir=run"]) == 0
    assert "lightning-zero train: warning: model.attention=sparse_fixed is dense at data.seq_len=64" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="num_sliding_window_blocks \\(3\\) exceeds the 1 blocks of a row"):
        _config("model.attention=sparse_bigbird", "data.seq_len=16")  # the first forward's error, before launch


# ---------------------------------------------------------------------------------------- 9. a run in one process
def test_a_run_in_this_process_prints_each_line_once_without_the_noise(tmp_path: Path) -> None:
    """Hydra's root handlers (console and train.log) and Lightning's own ``INFO:`` handler printed each Lightning
    line twice, the model summary too, and the litlogger tip and LeafSpec deprecation the 2-rank console drops."""
    from lightning_zero.config.run.console import in_process_console

    console = io.StringIO()
    root, lightning = logging.getLogger(), logging.getLogger("lightning")
    level = root.level
    root.setLevel(logging.INFO)  # Hydra's
    hydra_console = logging.StreamHandler(console)  # Hydra's: the timestamped format
    hydra_console.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    log_file = logging.FileHandler(tmp_path / "train.log")
    kept = list(root.handlers)  # only Hydra's two, as in `lightning-zero train` (not earlier tests' leftovers)
    root.handlers = [hydra_console, log_file]
    saved = list(lightning.handlers)
    own = logging.StreamHandler(console)
    own.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))  # Lightning's own
    lightning.handlers = [own]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("sys.stderr", console)
            stack = in_process_console()
            stack.__enter__()
            info = logging.getLogger("lightning.pytorch.utilities.rank_zero").info
            info("GPU available: False, used: False")
            info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
            logging.getLogger("tests.app").info("run directory: outputs/x")  # any other logger: Hydra's console
            stack.__exit__(None, None, None)
        assert lightning.handlers == [own]  # Lightning's handler is back
    finally:
        root.setLevel(level)
        root.handlers = kept
        log_file.close()
        lightning.handlers = saved
    printed = console.getvalue().splitlines()
    assert printed == ["GPU available: False, used: False", "[tests.app][INFO] - run directory: outputs/x"]
    logged = (tmp_path / "train.log").read_text()
    assert "GPU available" in logged and "Tip: For seamless" in logged and "LeafSpec" in logged  # all of it


def test_lightning_adds_no_model_summary_of_its_own_and_says_nothing_about_ours(tmp_path: Path) -> None:
    """Every run printed "Trainer already configured with model summary callbacks: [...]"."""
    from lightning_zero.config.run.build import trainer_kwargs
    from lightning_zero.observability.model_summary import ZeroModelSummary

    kwargs = trainer_kwargs(_config(), tmp_path)
    assert kwargs["enable_model_summary"] is False
    assert [type(c) for c in kwargs["callbacks"] if isinstance(c, ZeroModelSummary)] == [ZeroModelSummary]
    off = trainer_kwargs(_config("trainer.enable_model_summary=false"), tmp_path)
    assert not [c for c in off["callbacks"] if isinstance(c, ZeroModelSummary)]


# ---------------------------------------------------------------------------------------- 10. memory in MiB
def test_memory_tags_carry_their_unit() -> None:
    """``memory/params_rank0`` and the rest are MiB, which only monitoring.md said."""
    from lightning_zero.observability.dashboard import comparable_metrics, tensorboard_scalar
    from lightning_zero.observability.monitoring import dashboard_layout

    assert tensorboard_scalar("memory/rank1/params", 3 * 2**20) == ("memory_MiB/params_rank1", 3.0)
    assert tensorboard_scalar("time/rank0/step", 0.5) == ("time/step_rank0", 0.5)
    assert comparable_metrics(2)[-2:] == ["memory_MiB/peak_rank0", "memory_MiB/peak_rank1"]
    layout = dashboard_layout(["memory_MiB/peak_rank0", "memory_MiB/params_rank0"])
    assert list(layout["memory per rank (MiB)"]) == ["params memory (MiB)", "peak memory (MiB)"]
