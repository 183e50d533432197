"""The memory a stage-3 teardown may still take counts the process's memory cgroup (Note [teardown gather]): a rank in a
memory group does not gather a model its group cannot hold (before, only ``MemAvailable`` and ``RLIMIT`` were read,
and a rank under a cgroup limit was killed by the kernel at the end of a fit that had succeeded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.core.stage3.teardown import cgroup_room
from lightning_zero.testing.cgroups import cgroups_available, make_group


def _group(root: Path, path: str, files: dict[str, str]) -> None:
    (root / path).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / path / name).write_text(text)


def test_the_least_room_of_the_group_and_those_above_it_in_v1(tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("9:cpu:/\n4:memory:/jobs/one\n0::/\n")
    _group(tmp_path, "memory", {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "9",
                                "memory.stat": "total_inactive_file 0\n"})
    _group(tmp_path, "memory/jobs", {"memory.limit_in_bytes": "800", "memory.usage_in_bytes": "700",
                                     "memory.stat": "total_inactive_file 0\n"})
    _group(tmp_path, "memory/jobs/one", {"memory.limit_in_bytes": "1000", "memory.usage_in_bytes": "600",
                                         "memory.stat": "cache 80\ntotal_inactive_file 50\n"})
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path)) == 100  # the parent's 800 - 700
    (tmp_path / "memory/jobs/memory.limit_in_bytes").write_text(str(2**63 - 4096))  # no limit above
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path)) == 1000 - 600 + 50  # inactive file pages count


def test_v2_and_no_limit(tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("0::/svc\n")
    _group(tmp_path, "svc", {"memory.max": "max", "memory.current": "5", "memory.stat": "inactive_file 1\n"})
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path)) is None
    (tmp_path / "svc" / "memory.max").write_text("500\n")
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path)) == 500 - 5 + 1
    assert cgroup_room(str(tmp_path / "missing"), str(tmp_path)) is None


@pytest.mark.skipif(not cgroups_available(), reason="needs root and the cgroup v1 memory hierarchy")
def test_a_process_in_a_real_memory_group_sees_its_limit() -> None:
    group = make_group(f"lz_test_room_{os.getpid()}", 300 * 2**20)
    probe = ("import os, sys, torch\n"
             f"open('{group.path}/cgroup.procs', 'w').write(str(os.getpid()))\n"
             "from lightning_zero.core.stage3.teardown import available_bytes\n"
             "print(available_bytes(torch.device('cpu')))\n")
    try:
        room = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                  timeout=120).stdout)
    finally:
        group.remove()
    assert 0 < room < 300 * 2**20
