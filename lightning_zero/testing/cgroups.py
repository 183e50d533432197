"""Memory limits the kernel enforces, per rank: a cgroup v1 memory group for each rank of a launch (as root), the
ranks placing themselves in theirs at start, and what each used at its peak. For the tests and benchmarks that claim
a run fits a memory limit (the house rule: memory is what the kernel enforces, never ``RLIMIT`` alone)."""

from __future__ import annotations

import json
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_zero.testing.memory import proc_status_bytes

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
RANK_GROUP_ENV = "LIGHTNING_ZERO_TEST_RANK_CGROUP"  # the groups' path prefix; each rank joins <prefix>_rank<RANK>
PEAK_DIR_ENV = "LIGHTNING_ZERO_TEST_PEAK_DIR"  # each rank writes its VmHWM to <dir>/vmhwm_rank<RANK> at exit

# a sitecustomize.py on the ranks' PYTHONPATH: a rank (RANK set) joins its group before anything is imported
SITE = """
import atexit, os
_rank, _prefix, _peaks = os.environ.get("RANK"), os.environ.get("GROUP_ENV"), os.environ.get("PEAK_ENV")
if _rank is not None and _prefix:
    with open(f"{_prefix}_rank{_rank}/cgroup.procs", "w") as _f:
        _f.write(str(os.getpid()))
if _rank is not None and _peaks:
    def _write_peak(_path=f"{_peaks}/vmhwm_rank{_rank}"):
        with open("/proc/self/status") as _s:
            _hwm = next(line.split()[1] for line in _s if line.startswith("VmHWM:"))
        with open(_path, "w") as _f:
            _f.write(str(int(_hwm) * 1024))

    atexit.register(_write_peak)
""".replace("GROUP_ENV", RANK_GROUP_ENV).replace("PEAK_ENV", PEAK_DIR_ENV)


def cgroups_available() -> bool:
    """Whether this process can make cgroup v1 memory groups (root, the v1 hierarchy mounted)."""
    return (MEMORY_ROOT / "memory.limit_in_bytes").is_file() and os.access(MEMORY_ROOT, os.W_OK)


@dataclass(frozen=True)
class MemoryGroup:
    """One cgroup v1 memory group (made by :func:`make_group`)."""

    path: Path

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    @property
    def limit(self) -> int:
        return self._read("memory.limit_in_bytes")

    @property
    def peak(self) -> int:
        """The most memory the group was charged at once (its processes' memory and the page cache they read)."""
        return self._read("memory.max_usage_in_bytes")

    @property
    def oom_kills(self) -> int:
        """Processes the kernel killed for the group's limit."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def stat(self, key: str) -> int:
        """A ``memory.stat`` entry (e.g. ``total_rss``)."""
        for line in (self.path / "memory.stat").read_text().splitlines():
            name, value = line.split()
            if name == key:
                return int(value)
        raise KeyError(key)

    def remove(self) -> None:
        """Remove the group (its processes have ended)."""
        self.path.rmdir()


def make_group(name: str, limit_bytes: int | None) -> MemoryGroup:
    """A fresh memory group ``name`` limited to ``limit_bytes`` (``None``: no limit yet, :class:`MemoryBudget` sets
    it; without swap on the machine the limit is the memory the kernel lets the group have)."""
    path = MEMORY_ROOT / name
    if path.exists():
        path.rmdir()
    path.mkdir()
    if limit_bytes is not None:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return MemoryGroup(path)


def rank_groups(prefix: str, ranks: int, limit_bytes: int | None, site_dir: Path, peak_dir: Path) -> tuple[
        list[MemoryGroup], dict[str, str]]:
    """One group per rank (``<prefix>_rank<r>``, each limited to ``limit_bytes``) and the environment that puts each
    rank of a launch in its own at start: a ``sitecustomize.py`` written to ``site_dir`` (on ``PYTHONPATH``), and each
    rank's peak resident set (``VmHWM``) written to ``peak_dir`` at exit."""
    groups = [make_group(f"{prefix}_rank{r}", limit_bytes) for r in range(ranks)]
    return groups, {**rank_peaks(site_dir, peak_dir), RANK_GROUP_ENV: str(MEMORY_ROOT / prefix)}


def rank_peaks(site_dir: Path, peak_dir: Path) -> dict[str, str]:
    """The environment that makes each rank of a launch write its peak resident set (``VmHWM``) to
    ``peak_dir/vmhwm_rank<r>`` at exit (a ``sitecustomize.py`` in ``site_dir``, on ``PYTHONPATH``)."""
    site_dir.mkdir(parents=True, exist_ok=True)
    peak_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(SITE)
    path = os.pathsep.join(filter(None, [str(site_dir), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, PEAK_DIR_ENV: str(peak_dir)}


def own_group() -> MemoryGroup | None:
    """This process's cgroup v1 memory group (``None`` outside one, or at the root)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and path != "/":
            return MemoryGroup(MEMORY_ROOT / path.lstrip("/"))
    return None


class MemoryBudget(Callback):
    """A Lightning callback (give it by ``_target_``: ``callbacks.budget._target_=lightning_zero.testing.cgroups.
    MemoryBudget``) that, when the fit is set up and before the model is built, limits the rank to what it uses now
    plus ``budget_bytes``: its own memory group's limit (the kernel's), or without one its ``RLIMIT_DATA`` over its
    data segment. It writes what it started from to ``<default_root_dir>/budget_rank<r>.json``.

    Args:
        budget_bytes: the memory the rank may add from the model's construction on.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        group = own_group()
        if group is not None:
            start, how = group._read("memory.usage_in_bytes"), "cgroup"
            (group.path / "memory.limit_in_bytes").write_text(str(start + self.budget_bytes))
        else:
            start, how = proc_status_bytes("VmData"), "rlimit"
            resource.setrlimit(resource.RLIMIT_DATA, (start + self.budget_bytes, resource.RLIM_INFINITY))
        out = Path(trainer.default_root_dir) / f"budget_rank{trainer.global_rank}.json"
        out.write_text(json.dumps({"start": start, "limit": start + self.budget_bytes, "how": how}))
