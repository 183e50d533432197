"""ZeRO-Infinity on a CPU host inside a memory cgroup (root only): a model whose state is 8x the memory the kernel
lets the job use trains with every part on disk; the same model without offload is killed (docs/offload.md; the
full-size version, GPT-1B through the command line in 8 GiB, is benchmarks/bench_infinity.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.testing.cgroups import cgroups_available, make_group

REPO = Path(__file__).resolve().parents[2]
LIMIT = 448 << 20  # the process with torch and an AdamW alone is ~300 MB of it (anonymous and mapped)


def _run_in_cgroup(tmp_path: Path, mode: str) -> tuple[int, dict | None, int, int]:
    """The script's exit code, its result, and the group's peak usage and OOM kills."""
    if not cgroups_available():
        pytest.skip("making a cgroup v1 memory group needs root and /sys/fs/cgroup/memory")
    group = make_group(f"lz_infinity_{mode}_{os.getpid()}", LIMIT)
    join = f'echo $$ > "{group.path}/cgroup.procs" && exec "$0" "$@"'
    out = tmp_path / f"{mode}.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    try:
        proc = subprocess.run(["sh", "-c", join, sys.executable, str(REPO / "tests" / "infinity_cgroup_script.py"),
                               str(out), str(nvme), mode], env=env, capture_output=True, text=True, timeout=600)
        result = json.loads(out.read_text()) if out.exists() else None
        return proc.returncode, result, group.peak, group.oom_kills
    finally:
        group.remove()


def _run_with_and_without_offload(root: Path) -> dict[str, tuple[int, dict | None, int, int]]:
    """Both runs: every part on disk, then the control without offload."""
    return {mode: _run_in_cgroup(root, mode) for mode in ("disk", "none")}


@pytest.mark.slow
@pytest.mark.lane(run=_run_with_and_without_offload)  # processes of their own (Note [background lane], tests/lane.py)
def test_a_model_8x_its_memory_cgroup_trains_with_every_part_on_disk_and_without_offload_is_killed(
        lane_result: dict[str, tuple[int, dict | None, int, int]]) -> None:
    code, result, peak, kills = lane_result["disk"]
    assert code == 0 and result is not None and kills == 0, f"exit code {code} (-9: killed by the cgroup's OOM killer)"
    assert result["state_bytes"] >= 8 * LIMIT  # parameters, gradients, fp32 masters and AdamW moments on disk
    assert len(result["losses"]) == 2 and all(loss == loss for loss in result["losses"])
    assert result["peak_rss"] < LIMIT and peak <= LIMIT  # the kernel held the whole job under the limit
    # the control: the same model and steps without offload, in the same limit, is killed
    code, result, _, kills = lane_result["none"]
    assert code == -9 and result is None and kills >= 1, f"exit code {code}: the model state fit without offload"
