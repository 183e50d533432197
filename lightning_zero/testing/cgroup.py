"""A memory cgroup for a test or a benchmark to run a job in: made fresh, limited, read, removed (root only).

The kernel enforces memory in a cgroup (v1 under ``/sys/fs/cgroup/memory``, v2 under ``/sys/fs/cgroup``): a job
whose processes need more than its limit, less what the kernel can take back (clean page cache), is killed by the
cgroup's OOM killer. Tests and benchmarks of memory claims run their processes in one (docs/offload.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

V1, V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup: its directory and the cgroup version (1 or 2)."""

    path: Path
    version: int

    @classmethod
    def make(cls, name: str, limit_bytes: int | None = None) -> MemoryCgroup | str:
        """A fresh cgroup ``name`` (with ``limit_bytes`` set), or why none can be made here (not root, no memory
        controller mounted, ...)."""
        if os.geteuid() != 0:
            return "making a memory cgroup needs root"
        if (V1 / "memory.limit_in_bytes").exists():
            parent, version = V1, 1
        elif "memory" in ((V2 / "cgroup.subtree_control").read_text().split()
                          if (V2 / "cgroup.subtree_control").exists() else []):
            parent, version = V2, 2
        else:
            return "no memory cgroup hierarchy (v1 /sys/fs/cgroup/memory, or v2 with the memory controller) is mounted"
        try:
            (parent / name).mkdir()
        except OSError as err:
            return f"cannot make a memory cgroup under {parent}: {err}"
        made = cls(parent / name, version)
        if limit_bytes is not None:
            made.set_limit(limit_bytes)
        return made

    def set_limit(self, limit_bytes: int) -> None:
        """The most the cgroup's processes may use, page cache included (v1 also with swap: no swapping out)."""
        if self.version == 1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
        else:
            (self.path / "memory.max").write_text(str(limit_bytes))
            (self.path / "memory.swap.max").write_text("0")

    def join_command(self) -> str:
        """A ``sh -c`` prefix that moves the shell into the cgroup, then runs ``"$0" "$@"`` there."""
        return f'echo $$ > "{self.path}/cgroup.procs" && exec "$0" "$@"'

    def peak_bytes(self) -> int:
        """The most the cgroup held at once (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes the cgroup's OOM killer killed."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        fields = dict(line.split() for line in (self.path / name).read_text().splitlines() if " " in line)
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        """Remove the (empty) cgroup."""
        self.path.rmdir()
