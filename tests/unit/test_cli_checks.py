"""What a newcomer's mistakes and outputs look like without a launch: every checkable config value is
rejected before anything starts (exit 2, one line per problem, the root problem only), and every file
written for a user holds each tensor's own bytes (sizes against the parameter bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint.tensor_file import own_bytes
from lightning_zero.cli import main
from lightning_zero.config.describe import count_model_parameters
from lightning_zero.config.run.build import fit
from lightning_zero.config.run.launch import compose_config
from lightning_zero.config.validate import validate_config


@pytest.mark.parametrize(("args", "lines"), [
    (["model.lr=-0.01"], ["model.lr=-0.01 must be > 0. Fix: a positive learning rate, e.g. model.lr=3e-4."]),
    (["model.betas=[0.9,1.5]", "model.weight_decay=-1", "model.warmup_steps=-5"],
     ["model.weight_decay=-1 must be >= 0.", "model.betas[1]=1.5 must be in [0, 1).",
      "model.warmup_steps=-5 must be >= 0."]),
    (["data.micro_batch_size=0", "model.dropout=1.5", "data.seq_len=512"],
     ["model.dropout=1.5 must be in [0, 1).", "data.micro_batch_size=0 must be >= 1.",
      "data.seq_len=512 exceeds the model's context 256 (gpt_small). Fix: data.seq_len=256 or less, "
      "or model.seq_len=512."]),
    (["trainer.max_steps=0", "trainer.accumulate_grad_batches=0", "trainer.max_time=5min",
      "trainer.log_every_n_steps=0"],
     ["trainer.max_steps=0 must be >= 1, or -1 (no step limit).", "trainer.accumulate_grad_batches=0 must be >= 1.",
      "trainer.log_every_n_steps=0 must be >= 1.",
      "trainer.max_time=5min must be DD:HH:MM:SS, e.g. trainer.max_time=00:01:30:00."]),
    (["model.min_lr_ratio=2", "trainer.gradient_clip_val=-1", "trainer.val_check_interval=0"],
     ["model.min_lr_ratio=2 must be in [0, 1].", "trainer.val_check_interval=0 must be a whole number (a count: "
      "trainer.val_check_interval=1 is one) or a fraction in (0, 1] (a share: 1.0 is all).",
      "trainer.gradient_clip_val=-1 must be >= 0."]),
    # the root problem only: no offload / pipeline advice that follows from an impossible stage
    (["zero.stage=7"],
     ["zero.stage=7: ZeRO stage must be 0, 1, 2 or 3, got 7. Fix: zero=stage0, stage1, stage2 or stage3."]),
])
def test_bad_values_stop_before_launch_one_line_each(args: list[str], lines: list[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "lightning-zero train: error: invalid configuration:"
    assert sorted(err[1:]) == sorted(f"  - {line}" for line in lines)
    assert not list(tmp_path.iterdir())  # no output directory, no process


def test_own_bytes_copies_views_only_and_keeps_ties() -> None:
    flat = torch.arange(100.0)
    a, b, whole = flat[:10].view(2, 5), flat[10:30], torch.ones(3)
    out = own_bytes({"a": a, "tied": [a, a], "b": (b,), "whole": whole, "n": 3})
    assert out["a"].untyped_storage().nbytes() == 40 and torch.equal(out["a"], a)
    assert out["tied"][0] is out["a"] and out["tied"][1] is out["a"]  # one copy for one region: ties survive
    assert out["b"][0].untyped_storage().nbytes() == 80 and out["whole"] is whole and out["n"] == 3


TINY_ONE_RANK = ["experiment=gpt_tiny", "trainer.devices=1", "trainer.max_steps=2", "trainer.validate_at_start=false",
                 "trainer.validate_at_end=false", "trainer.val_check_interval=null", "logger=none",
                 "trainer.enable_model_summary=false", "trainer.enable_progress_bar=false", "data.max_bytes=50000"]


@pytest.mark.slow
def test_every_file_written_for_a_user_holds_the_parameter_bytes_only(tmp_path: Path) -> None:
    cfg = validate_config(compose_config([*TINY_ONE_RANK, "zero=stage2"]))
    params = count_model_parameters(cfg) * 4  # fp32
    fit(cfg, tmp_path / "s2")
    sharded = tmp_path / "s2" / "checkpoints" / "last.ckpt"
    assert sharded.resolve().is_dir()  # stage >= 1: last.ckpt is a symlink to a versioned directory
    limits = {"model.pt": params, "model.safetensors": params, "model.ckpt": 3 * params}  # + AdamW's two moments
    for name, limit in limits.items():
        out = tmp_path / name
        assert main(["convert", str(sharded), str(out), *(["--lightning"] if name.endswith(".ckpt") else [])]) == 0
        assert limit <= out.stat().st_size <= limit * 1.05 + 64_000, (name, out.stat().st_size, limit)
    # stage 0 writes Lightning's single file (the consolidated format) through trainer.save_checkpoint
    cfg = validate_config(compose_config([*TINY_ONE_RANK, "zero=stage0"]))
    fit(cfg, tmp_path / "s0")
    single = tmp_path / "s0" / "checkpoints" / "last.ckpt"
    assert single.is_file() and 3 * params <= single.stat().st_size <= 3 * params * 1.05 + 64_000


@pytest.mark.slow
def test_progress_is_on_by_default_lines_off_a_terminal_and_off_by_option(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_zero.config.run.build import trainer_kwargs
    from lightning_zero.observability.progress import LineProgress

    def progress(overrides: list[str], tty: bool) -> tuple[bool, list[type]]:
        monkeypatch.setattr("sys.stdout.isatty", lambda: tty)
        kwargs = trainer_kwargs(validate_config(compose_config(["experiment=gpt_tiny", *overrides])), tmp_path)
        return kwargs["enable_progress_bar"], [type(c) for c in kwargs["callbacks"] if isinstance(c, LineProgress)]

    assert progress([], tty=False) == (True, [LineProgress])  # a pipe or a log: a line per log_every_n_steps
    assert progress([], tty=True) == (True, [])  # a terminal: Lightning's bar
    assert progress(["trainer.enable_progress_bar=false"], tty=False) == (False, [])


@pytest.mark.slow
def test_a_whole_limit_val_batches_counts_the_batches_of_all_data_replicas_together(
        caplog: pytest.LogCaptureFixture) -> None:
    """Note [global validation batches]: gpt_tiny's ``limit_val_batches: 2`` is 2 batches on 1 rank, on TP 2 or a
    pipeline of 2 (one data replica), and 1 per replica on pipeline 2 x TP 2 x data 2 (an int: 1.0 would be
    every batch), so all validate on the same 16 samples; 4 data replicas each take 1 (2 / 4 rounded up, logged);
    a fraction is Lightning's."""
    import logging

    from lightning_zero.config.run.build import val_batches_per_rank

    def per_rank(*overrides: str) -> float | int | None:
        return val_batches_per_rank(validate_config(compose_config(["experiment=gpt_tiny", *overrides])))

    assert per_rank("trainer.devices=1") == 2 and per_rank("tensor_parallel=tp2") == 2
    assert per_rank("pipeline=pp2_gpipe") == 2
    piped = per_rank("tensor_parallel=tp2", "pipeline=pp2_1f1b", "zero=stage3", "trainer.devices=8")
    assert piped == 1 and type(piped) is int
    assert per_rank("trainer.limit_val_batches=6", "trainer.devices=2") == 3
    with caplog.at_level(logging.INFO):
        assert per_rank("trainer.devices=4") == 1
    assert "limit_val_batches=2 counts validation batches over all 4 data-parallel replicas" in caplog.text
    assert per_rank("trainer.limit_val_batches=0.5") == 0.5 and per_rank("trainer.limit_val_batches=1.0") == 1.0


@pytest.mark.slow
def test_a_whole_number_of_batches_on_the_command_line_counts_batches_and_a_fraction_is_a_share(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """``trainer.limit_val_batches=1`` became 1.0 through the schema's float type: Lightning read it as every
    validation batch (issue 41, 9; ``limit_train_batches`` alike). Now ``1`` counts one batch, ``1.0`` is all of
    them, a fraction is a share, the log says which, and a value that is neither is refused before launch."""
    import logging

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_zero.config.run.build import val_batches_per_rank

    class Counts(pl.Callback):
        def __init__(self) -> None:
            self.train = self.val = 0

        def on_train_batch_end(self, *args: object) -> None:
            self.train += 1

        def on_validation_batch_end(self, *args: object) -> None:
            self.val += 1

    def batches(*overrides: str) -> tuple[int, int]:
        # no validation interval: limit_train_batches=1 leaves one batch per epoch, fewer than gpt_tiny's 5 steps
        cfg = validate_config(compose_config(["experiment=gpt_tiny", "trainer.devices=1",
                                              "trainer.val_check_interval=null", *overrides]))
        seen = Counts()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, num_sanity_val_steps=0, logger=False,
                             limit_train_batches=cfg.trainer.limit_train_batches,
                             limit_val_batches=val_batches_per_rank(cfg), enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[seen])
        trainer.fit(BoringModel())  # 64 training and 64 validation batches
        return seen.train, seen.val

    assert batches("trainer.limit_val_batches=1", "trainer.limit_train_batches=1") == (1, 1)
    assert batches("trainer.limit_val_batches=1.0", "trainer.limit_train_batches=0.25") == (16, 64)
    assert batches("trainer.limit_val_batches=0.5", "trainer.limit_train_batches=2") == (2, 32)
    from lightning_zero.config.run.build import count_or_share_lines, trainer_kwargs

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "logger=none", "trainer.limit_val_batches=1",
                                          "trainer.limit_train_batches=0.5", "trainer.val_check_interval=1"]))
    lines = count_or_share_lines(cfg)
    assert "trainer.limit_val_batches=1 is a count: validation batches of all data-parallel replicas" in lines[1]
    assert "trainer.limit_train_batches=0.5 is a share: 50% of the training batches" in lines[0]
    assert "trainer.val_check_interval=1 is a count: optimizer steps between validations" in lines[2]
    with caplog.at_level(logging.INFO):
        trainer_kwargs(cfg, tmp_path)
    assert lines[1] in caplog.text
    for bad in ("1.5", "abc", "-1", "true"):
        with pytest.raises(ValueError, match=r"trainer\.limit_val_batches=.* must be a whole number .* or a fraction"):
            validate_config(compose_config(["experiment=gpt_tiny", f"trainer.limit_val_batches={bad}"]))


def test_the_cli_gathers_nothing_after_fit_and_validates_at_its_last_step_inside_the_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI needs nothing back from the module after fit, yet a stage-3 run gathered the whole model at its end
    (issue 41, 10: in a memory cgroup that killed a finished run). Now ``zero.gather_on_teardown`` is false by
    default (true on the command line gathers), and ``trainer.validate_at_end`` runs inside the fit at its last
    step through the sharded engine: the parameters stay released, the end's validation loss is measured, and
    no ``trainer.validate`` follows the fit."""
    import lightning.pytorch as pl

    from lightning_zero.config.run import build
    from lightning_zero.config.run.build import strategy_arguments
    from lightning_zero.core.stage3.sharded_unit import is_released

    modules: list[torch.nn.Module] = []
    made = build.build_module
    monkeypatch.setattr(build, "build_module", lambda cfg: modules.append(made(cfg)) or modules[-1])
    after: list[str] = []
    real_validate = pl.Trainer.validate
    monkeypatch.setattr(pl.Trainer, "validate", lambda self, *a, **k: after.append("validate") or
                        real_validate(self, *a, **k))
    overrides = [*TINY_ONE_RANK, "zero=stage3", "zero.param_persistence_threshold=0", "trainer.validate_at_end=true",
                 "trainer.checkpoint.enabled=false"]
    cfg = validate_config(compose_config(overrides))
    assert strategy_arguments(cfg)["gather_on_teardown"] is False
    result = fit(cfg, tmp_path)
    assert after == [] and result.val_loss_end is not None and result.global_step == 2
    assert all(is_released(p) for p in modules[-1].parameters())
    gathered = validate_config(compose_config([*overrides, "zero.gather_on_teardown=true"]))
    assert strategy_arguments(gathered)["gather_on_teardown"] is True
    again = fit(gathered, tmp_path)
    assert not any(is_released(p) for p in modules[-1].parameters())
    assert again.val_loss_end == result.val_loss_end  # the same run: the same end validation
