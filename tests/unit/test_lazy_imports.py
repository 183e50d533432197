"""The launcher imports no Lightning, the packages name their pieces lazily, and the ``zero_stage_*`` names are
registered with Lightning whichever of the two is imported first (Note [lazy package names], Note [after import]
in ``lightning_zero/core/lazy.py``).

The import checks run in fresh interpreters: this test process has imported Lightning long before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from lightning_zero.core.lazy import after_import, lazy_exports

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "torch._dynamo")


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter at the repository root; its stdout (the test fails on its error)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _run_launcher_then_lightning(_: Path) -> str:
    """The launcher's imports, then Lightning's, in one fresh interpreter: what it printed."""
    return _run(f"""
        import contextlib, io, sys
        import lightning_zero, lightning_zero.__main__
        from lightning_zero.cli import main
        from lightning_zero.config.run.launch import check_jobs, launch_ranks, run_job
        from lightning_zero.config.paths import FitResult, register_run_name
        from lightning_zero.config.describe import describe
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["--help"]) == 0
            assert main(["estimate", "--params", "1e9", "--world-size", "8"]) == 0
            main(["advise", "--params", "1e9", "--world-size", "8", "--device-memory", "80GB"])
        for job in ([], ["model=mlp", "data=teacher", "zero=stage3"], ["offload=optimizer_cpu", "zero=stage2"]):
            for cfg in check_jobs([job]):
                describe(cfg)
        register_run_name()
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r} or m.startswith("torch._dynamo"))
        print("heavy:", heavy)

        from lightning_zero.observability.callbacks import ZeroStatsMonitor
        from lightning.pytorch.strategies import StrategyRegistry
        from lightning_zero import ZeroStrategy
        built = StrategyRegistry.get("zero_stage_3_offload")
        spawn = "zero_stage_2_spawn" in StrategyRegistry
        print("registered:", type(built) is ZeroStrategy, built.zero_config.stage, spawn)
    """)


@pytest.mark.lane(run=_run_launcher_then_lightning)  # a process of its own (Note [background lane], tests/lane.py)
def test_the_launcher_imports_no_lightning_and_the_names_register_when_lightning_comes_second(lane_result: str) -> None:
    """In one fresh interpreter (one start of torch, not two):

    1. what ``python -m lightning_zero train`` runs before ``torchrun`` starts the ranks (compose, validate,
       describe each job; the run directory's name and result), and ``estimate`` / ``advise`` / ``--help``, import
       no Lightning, torchmetrics or ``torch._dynamo``;
    2. then a module of lightning_zero that imports Lightning itself: the ``zero_stage_*`` names are registered in
       the middle of that import (which must import nothing that module is part of) and build a ``ZeroStrategy``.
    """
    out = lane_result
    assert "heavy: []" in out, out
    assert "registered: True 3 True" in out, out


def test_names_registered_when_lightning_comes_first() -> None:
    import lightning.pytorch  # noqa: F401 - whichever came first in this process, both are imported now
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero import ZeroStrategy

    built = StrategyRegistry.get("zero_stage_2")
    assert type(built) is ZeroStrategy and built.zero_config.stage == 2
    assert {f"zero_stage_{s}{t}" for s in range(4) for t in ("", "_spawn")} <= set(StrategyRegistry)


def test_after_import_runs_once_after_the_body_in_either_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lz_probe_later.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[object] = []
    after_import("lz_probe_later", lambda: seen.append(sys.modules["lz_probe_later"].VALUE))
    assert seen == []
    import lz_probe_later  # noqa: F401 - the import under test

    assert seen == [1]
    after_import("lz_probe_later", lambda: seen.append("now"))  # imported already: at once
    assert seen == [1, "now"]
    monkeypatch.delitem(sys.modules, "lz_probe_later")


def test_lazy_exports_imports_on_first_use_and_refuses_a_name_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("lz_probe_package")
    monkeypatch.setitem(sys.modules, "lz_probe_package", package)
    getattr_, dir_, all_ = lazy_exports(
        "lz_probe_package", {"textwrap": ("dedent",), "json": ("dumps", "loads")}, eager=("VERSION",)
    )
    package.__getattr__, package.__dir__ = getattr_, dir_  # type: ignore[attr-defined]
    assert all_ == ["VERSION", "dedent", "dumps", "loads"]
    assert "dumps" not in vars(package)
    assert package.dumps is __import__("json").dumps and "dumps" in vars(package)  # kept after the first look-up
    assert {"dedent", "loads"} <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018 - the look-up under test
    with pytest.raises(ValueError, match="named twice"):
        lazy_exports("lz_probe_package", {"json": ("dumps",), "pickle": ("dumps",)})
