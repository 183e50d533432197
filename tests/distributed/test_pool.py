"""Tests of the session-long gloo worker pool (tests/pool.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.pool import GlooPool, GlooPoolError

pytestmark = pytest.mark.distributed
HERE = "tests.distributed.test_pool"


# ------------------------------------------------------------------ bodies (run inside the workers)
def _whoami(tag: str) -> dict[str, Any]:
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "local_rank": os.environ["LOCAL_RANK"],
            "tag": tag, "cwd": os.getcwd(), "pid": os.getpid()}  # fmt: skip


def _all_reduce() -> float:
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return value.item()


def _destroy_group_and_env() -> None:
    del os.environ["WORLD_SIZE"]  # like LightningEnvironment.teardown()
    os.environ["POOL_TEST_LEAK"] = "1"
    dist.destroy_process_group()


def _check_restored() -> bool:
    assert os.environ["WORLD_SIZE"] == "2" and "POOL_TEST_LEAK" not in os.environ
    return dist.is_initialized()


def _gloo_threads() -> int:
    return sum(1 for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() in ("gloo_tcp_loop", "pt_gloo_runloop"))


def _leave_groups(count: int) -> int:
    """Create ``count`` groups: ``count - 1`` that only torch's registry refers to once the task returns, and a
    mesh registered as a strategy registers its own; the gloo threads now."""
    from lightning_zero.core.comm import process_groups
    from lightning_zero.core.mesh import ParallelDims, ProcessMesh
    from lightning_zero.core.mesh.dims import Axis

    kept = [dist.new_group([0, 1]) for _ in range(count - 1)]
    kept.append(process_groups.own(ProcessMesh(ParallelDims(2), dist.get_rank(), [(Axis.DATA,)])))
    return _gloo_threads()


def _fail_on_rank1() -> int:
    if dist.get_rank() == 1:
        answer = 42
        assert answer == 41, "rank 1 disagrees"
    return dist.get_rank()


def _hang(rank1_action: str) -> None:
    """Rank 0 waits in a collective for rank 1, which sleeps, raises or dies instead."""
    if dist.get_rank() == 1:
        print("rank 1 is about to misbehave", flush=True)
        if rank1_action == "sleep":
            time.sleep(120)
        elif rank1_action == "raise":
            raise ValueError("rank 1 gave up")
        else:
            os._exit(3)
    dist.barrier()


def _ddp_fit(steps: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    assert os.environ["WORLD_SIZE"] == "2" and dist.is_initialized()

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(dist.get_rank())  # different init per rank: DDP must broadcast rank 0's weights
    model = Tiny()
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_steps=steps,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(model, loader)
    weights = model.layer.weight.detach().clone()
    gathered = [torch.zeros_like(weights) for _ in range(2)]
    dist.all_gather(gathered, weights)
    assert torch.equal(gathered[0], gathered[1]), "ranks diverged"
    return {"global_step": trainer.global_step, "global_rank": trainer.global_rank,
            "world_size": trainer.world_size, "children": len(getattr(trainer.strategy.launcher, "procs", [])),
            "group_alive": dist.is_initialized()}  # fmt: skip


# ------------------------------------------------------------------ tests (run in the pytest process)
def test_results_per_rank(gloo_pool: GlooPool) -> None:
    first = gloo_pool.run(f"{HERE}:_whoami", tag="a")
    second = gloo_pool.run(f"{HERE}:_whoami", tag="b")
    summary = [(r["rank"], r["world_size"], r["local_rank"], r["tag"]) for r in first]
    assert summary == [(0, 2, "0", "a"), (1, 2, "1", "a")]
    assert first[0]["cwd"] == first[1]["cwd"] != second[0]["cwd"]  # one fresh directory per task, shared
    assert first[0]["pid"] != os.getpid()


def test_all_reduce(gloo_pool: GlooPool) -> None:
    assert gloo_pool.run(f"{HERE}:_all_reduce") == [3.0, 3.0]


def test_worker_state_is_restored_between_tasks(gloo_pool: GlooPool) -> None:
    gloo_pool.run(f"{HERE}:_destroy_group_and_env")
    assert gloo_pool.run(f"{HERE}:_check_restored") == [True, True]
    assert gloo_pool.run(f"{HERE}:_all_reduce") == [3.0, 3.0]


def test_the_groups_a_task_leaves_are_destroyed_with_their_threads_before_the_next_task(gloo_pool: GlooPool) -> None:
    """Note [groups left by tasks] in lightning_zero/testing/pool.py: 288 groups left by a third of the suite kept
    864 idle gloo threads per worker, 1.2 cores each."""
    before = gloo_pool.run(f"{HERE}:_gloo_threads")
    during = gloo_pool.run(f"{HERE}:_leave_groups", count=4)
    after = gloo_pool.run(f"{HERE}:_gloo_threads")
    assert all(d >= b + 4 for b, d in zip(before, during, strict=True)), (before, during)
    assert after == before, (before, during, after)
    assert gloo_pool.run(f"{HERE}:_all_reduce") == [3.0, 3.0]  # the default group still works


def test_remote_traceback(gloo_pool: GlooPool) -> None:
    pids = [r["pid"] for r in gloo_pool.run(f"{HERE}:_whoami", tag="")]
    with pytest.raises(GlooPoolError) as info:
        gloo_pool.run(f"{HERE}:_fail_on_rank1")
    message = str(info.value)
    assert "failed on rank(s) [1]" in message and "rank 0 traceback" not in message
    assert "in _fail_on_rank1" in message and "rank 1 disagrees" in message and "assert 42 == 41" in message
    assert [r["pid"] for r in gloo_pool.run(f"{HERE}:_whoami", tag="")] == pids  # all ranks answered: kept


@pytest.fixture(scope="module")
def cold_pool() -> Iterator[GlooPool]:
    """A pool of 2 ranks without the warm imports (torch only): each restart below costs ~1 s of CPU per rank,
    not the ~6 s of the session's pool, whose warm workers the later tests keep."""
    pool = GlooPool(world_size=2, warm=False)
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("action", ["sleep", "raise", "exit"])
@pytest.mark.slow
def test_poisoned_task_restarts_pool(cold_pool: GlooPool, monkeypatch: pytest.MonkeyPatch, action: str) -> None:
    gloo_pool = cold_pool
    monkeypatch.setattr(gloo_pool, "grace_s", 1.0)
    with pytest.raises(GlooPoolError) as info:
        gloo_pool.run(f"{HERE}:_hang", _timeout_s=2, rank1_action=action)
    message = str(info.value)
    assert "tests.distributed.test_pool:_hang" in message and "restarts on the next run" in message
    expected = {"sleep": "rank(s) [0, 1] did not answer within 2 s",
                "raise": "rank(s) [1] raised and rank(s) [0] did not answer",
                "exit": "rank 1: exit code 3"}[action]  # fmt: skip
    assert expected in message
    assert action == "raise" or "rank 1 is about to misbehave" in message  # worker output is included
    assert gloo_pool.run(f"{HERE}:_all_reduce") == [3.0, 3.0]  # recovered


def test_lightning_ddp_fit_twice(gloo_pool: GlooPool) -> None:
    for _ in range(2):
        results = gloo_pool.run(f"{HERE}:_ddp_fit", steps=3)
        assert [(r["global_rank"], r["world_size"], r["global_step"]) for r in results] == [(0, 2, 3), (1, 2, 3)]
        assert [(r["children"], r["group_alive"]) for r in results] == [(0, True), (0, True)]  # no spawn
    assert gloo_pool.run(f"{HERE}:_all_reduce") == [3.0, 3.0]


def _interpreter() -> dict[str, Any]:
    import sys

    return {"executable": sys.executable, "env": os.environ.get("POOL_TEST_ENV"), "path": sys.path[:3],
            "meanwhile": os.environ.get("POOL_TEST_MEANWHILE"), "home": os.environ.get("HOME")}


@pytest.mark.slow
def test_a_pool_runs_its_workers_under_another_interpreter_with_extra_environment(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GlooPool(python=..., env=..., environ=...)``: the workers run that interpreter (here a link to this one, as a
    venv's ``bin/python`` would be), see the extra variables over the environment the pool was given (not a
    variable this process had meanwhile), and the pool leaves multiprocessing's default alone."""
    import multiprocessing.spawn
    import sys

    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    default = multiprocessing.spawn.get_executable()
    given = dict(os.environ)
    monkeypatch.setenv("POOL_TEST_MEANWHILE", "a test's own")  # as a unit test in the main thread may have
    pool = GlooPool(world_size=1, python=str(link), env={"POOL_TEST_ENV": "set"}, warm=False, environ=given)
    try:
        [result] = pool.run(f"{HERE}:_interpreter")
    finally:
        pool.close()
    assert result["executable"] == str(link) and result["env"] == "set"
    assert result["meanwhile"] is None and result["home"] == os.environ.get("HOME")
    assert multiprocessing.spawn.get_executable() == default
    with pytest.raises(GlooPoolError, match="cannot run the pool's interpreter"):
        GlooPool(world_size=1, python=str(tmp_path / "missing"))
