"""What memory a rank can still allocate (lightning_zero/core/stage3/memory_room.py, Note [memory pools]): the
memory cgroups above the process read from ``/proc/self/cgroup`` and the hierarchy's mount, in cgroup v1 and v2
(a fake hierarchy in a temporary directory: this machine has one of the two), and the needs of the ranks that
share a pool summed. The real cgroup case: tests/e2e/test_large_models.py (a run in a memory cgroup)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero.core.stage3.memory_room import MemoryPool, cgroup_pools, memory_pools, pooled_needs

GIB = 2**30


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)


def test_cgroup_v1_the_jobs_limit_and_its_parents_less_what_each_uses_but_its_inactive_file_cache(
        tmp_path: Path) -> None:
    """SLURM's layout: a job cgroup with a limit inside a user cgroup with a larger one, the root unlimited; the
    process's own cgroup (a step) has none. v1 writes "no limit" as about 2**63."""
    mount = tmp_path / "memory"
    unlimited = str(2**63 - 4096)
    _write(mount, memory__limit_in_bytes=unlimited, memory__usage_in_bytes=str(50 * GIB),
           memory__stat="total_inactive_file 0\n")
    _write(mount / "user", memory__limit_in_bytes=str(64 * GIB), memory__usage_in_bytes=str(30 * GIB),
           memory__stat=f"total_inactive_file {2 * GIB}\n")
    _write(mount / "user" / "job", memory__limit_in_bytes=str(20 * GIB), memory__usage_in_bytes=str(9 * GIB),
           memory__stat=f"inactive_file {GIB}\ntotal_inactive_file {3 * GIB}\n")
    _write(mount / "user" / "job" / "step", memory__limit_in_bytes=unlimited, memory__usage_in_bytes=str(8 * GIB),
           memory__stat="total_inactive_file 0\n")
    proc = "5:cpu:/user/job/step\n4:memory:/user/job/step\n0::/user.slice\n"
    mountinfo = (f"31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
                 f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n"
                 f"41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    pools = cgroup_pools(proc, mountinfo)
    assert [p.room for p in pools] == [20 * GIB - 6 * GIB, 64 * GIB - 28 * GIB]  # the job's, then the user's
    assert f"memory cgroup {mount / 'user' / 'job'} (v1: limit 20.00 GiB, 6.00 GiB in use)" == pools[0].what
    assert len({p.key for p in pools}) == 2


def test_cgroup_v2_memory_max_and_current_and_a_mount_of_the_jobs_own_subtree(tmp_path: Path) -> None:
    """v2 (Docker, Kubernetes): ``memory.max`` / ``memory.current``, "max" meaning none; a container sees its own
    cgroup mounted as the root, and /proc/self/cgroup says ``0::/``."""
    mount = tmp_path / "cgroup"
    _write(mount, memory__max=str(8 * GIB), memory__current=str(5 * GIB), memory__stat=f"inactive_file {GIB}\n")
    _write(mount / "app", memory__max="max", memory__current=str(4 * GIB), memory__stat="inactive_file 0\n")
    pools = cgroup_pools("0::/app\n", f"30 20 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")
    assert [(p.room, "v2: limit 8.00 GiB, 4.00 GiB in use" in p.what) for p in pools] == [(4 * GIB, True)]
    inside = cgroup_pools("0::/\n", f"30 20 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")
    assert [p.room for p in inside] == [4 * GIB]
    assert cgroup_pools("0::/\n", "") == [] and cgroup_pools("", "") == []  # no cgroup mounted: no such pool


def test_the_process_pools_are_the_hosts_memory_its_cgroups_and_its_rlimits() -> None:
    pools = memory_pools(torch.device("cpu"))
    assert pools[0].what == "the host's available memory (MemAvailable)" and pools[0].room > 0
    assert all(p.key.startswith(("host:", "cgroup:", "process:")) for p in pools)


def test_ranks_sharing_a_pool_sum_their_needs_on_one_rank() -> None:
    """Without a process group (one rank) the table is this rank's own needs; two pools of one rank count its need
    once each. (Summed over ranks: the cgroup run of tests/e2e/test_large_models.py.)"""
    pools = [MemoryPool("host:a", 10, "host"), MemoryPool("cgroup:a:1:2", 5, "job")]
    assert pooled_needs(pools, [7, 3], [None]) == [[7, 7], [3, 3]]


@pytest.mark.parametrize("value", ["max\n", f"{2**63 - 4096}\n"])
def test_a_cgroup_without_a_limit_is_no_pool(tmp_path: Path, value: str) -> None:
    mount = tmp_path / "m"
    _write(mount, memory__max=value, memory__current="100", memory__stat="inactive_file 0\n")
    assert cgroup_pools("0::/\n", f"30 20 0:26 / {mount} rw - cgroup2 cgroup2 rw\n") == []
