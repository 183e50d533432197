"""What memory a rank can still allocate: the pools it draws from (the kernel's available memory, each memory
cgroup above it that has a limit, its own RLIMITs, a CUDA device), each with its room, and the need of every rank
that draws from the same pool summed over the run (Note [memory pools]).

Note [memory pools]
    An allocation succeeds only if every pool it is charged to has room: the host's RAM (``MemAvailable``), every
    memory cgroup from the process's own up to the root that has a limit (what SLURM, Docker and Kubernetes limit a
    job with: cgroup v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``, v2 ``memory.max`` /
    ``memory.current``; the process's cgroup is read from ``/proc/self/cgroup``, the hierarchy's mount from
    ``/proc/self/mountinfo``), the process's ``RLIMIT_DATA`` / ``RLIMIT_AS``, or, for a CUDA allocation, the
    device. A cgroup's room is its limit less what it uses, its inactive file cache excepted (the kernel reclaims
    that before it kills: the working set, as ``docker stats`` and the kubelet count it).

    Ranks of one host share its RAM, and ranks of one job usually share a cgroup: two ranks that each see 14 GiB of
    room cannot each take 12 GiB. So every rank adds its need to its pools' entries of one table, summed over the
    run's ranks (one all-reduce per process group; a pool is named alike on every rank that draws from it, and
    its entry is a hash bucket: a collision only adds another pool's need, the safe side), and a pool fits when the
    sum of its ranks' needs is within its room.
"""

from __future__ import annotations

import hashlib
import os
import resource
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_zero.core.comm.data_parallel import DataParallelComm

BUCKETS = 256  # table entries per need: 2 KiB per need summed, collisions rare for the few pools of a run
_UNLIMITED = 2**62  # cgroup v1 writes "no limit" as PAGE_COUNTER_MAX (about 2**63), v2 as "max"
_PROCESS = uuid.uuid4().hex  # this process's own pools (its RLIMITs) are shared with nobody


@dataclass(frozen=True)
class MemoryPool:
    """Memory a rank draws from: ``key`` names it alike on every rank that shares it, ``room`` the bytes it can
    still give, ``what`` says what it is (for messages)."""

    key: str
    room: int
    what: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _proc_kib(path: str, key: str) -> int | None:
    text = _read(Path(path)) or ""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def _kernel() -> str:
    """This kernel's boot: what ranks on one host (containers too) share."""
    return (_read(Path("/proc/sys/kernel/random/boot_id")) or os.uname().nodename).strip()


def _cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[Path, int]]:
    """The memory cgroup directories of this process, its own first, up to the hierarchy's root, with the
    cgroup version (1 or 2): v1 where a hierarchy has the ``memory`` controller, else v2's unified one."""
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            paths[1] = parts[2]
        elif len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
    for version in (1, 2):
        if version not in paths:
            continue
        for line in mountinfo.splitlines():
            fields = line.split()
            if " - " not in line:
                continue
            fstype, options = line.split(" - ", 1)[1].split()[0], line.split(" - ", 1)[1].split()[-1]
            wanted = fstype == "cgroup" and "memory" in options.split(",") if version == 1 else fstype == "cgroup2"
            if not wanted:
                continue
            root, mount = fields[3], Path(fields[4])
            rel = os.path.relpath(paths[version], root) if paths[version].startswith(root) else "."
            here = (mount / rel).resolve() if rel != "." else mount
            dirs = []
            while True:
                dirs.append(here)
                if here == mount or here.parent == here:
                    break
                here = here.parent
            limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
            found = [(d, version) for d in dirs if (d / limit_file).exists()]
            if found:
                return found
    return []


def cgroup_pools(proc_cgroup: str | None = None, mountinfo: str | None = None) -> list[MemoryPool]:
    """One pool per memory cgroup above this process that has a limit (Note [memory pools])."""
    proc_cgroup = _read(Path("/proc/self/cgroup")) if proc_cgroup is None else proc_cgroup
    mountinfo = _read(Path("/proc/self/mountinfo")) if mountinfo is None else mountinfo
    pools = []
    for directory, version in _cgroup_dirs(proc_cgroup or "", mountinfo or ""):
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") if version == 1 else (
            "memory.max", "memory.current", "inactive_file")
        limit_text, usage_text = _read(directory / names[0]), _read(directory / names[1])
        if limit_text is None or usage_text is None or limit_text.strip() == "max":
            continue
        limit, usage = int(limit_text), int(usage_text)
        if limit >= _UNLIMITED:
            continue
        stat = dict(line.split() for line in (_read(directory / "memory.stat") or "").splitlines()
                    if len(line.split()) == 2)
        inactive = int(stat.get(names[2], stat.get("inactive_file", 0)))
        in_use = max(0, usage - inactive)
        stat_id = directory.stat()
        pools.append(MemoryPool(
            f"cgroup:{_kernel()}:{stat_id.st_dev}:{stat_id.st_ino}", limit - in_use,
            f"memory cgroup {directory} (v{version}: limit {limit / 2**30:.2f} GiB, {in_use / 2**30:.2f} GiB in use)"))
    return pools


def memory_pools(device: torch.device) -> list[MemoryPool]:
    """The pools an allocation of this process on ``device`` draws from, with their rooms (Note [memory pools])."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        room = int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        props = torch.cuda.get_device_properties(device)
        name = str(getattr(props, "uuid", device.index))
        return [MemoryPool(f"cuda:{_kernel()}:{name}", room, f"CUDA device {device}")]
    pools = []
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        pools.append(MemoryPool(f"host:{_kernel()}", available, "the host's available memory (MemAvailable)"))
    pools += cgroup_pools()
    for limit, used, name in ((resource.RLIMIT_DATA, "VmData", "RLIMIT_DATA"), (resource.RLIMIT_AS, "VmSize",
                                                                                 "RLIMIT_AS")):
        soft, _ = resource.getrlimit(limit)
        current = _proc_kib("/proc/self/status", used)
        if soft != resource.RLIM_INFINITY and current is not None:
            pools.append(MemoryPool(f"process:{_PROCESS}:{name}", soft - current, f"this process's {name}"))
    return pools


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % BUCKETS


def pooled_needs(pools: Sequence[MemoryPool], needs: Sequence[int],
                 comms: Sequence[DataParallelComm | None]) -> list[list[int]]:
    """Per need and pool of this rank: the need of every rank of the run drawing from that pool, summed (Note
    [memory pools]). ``comms``: process groups whose product is the run's ranks (each summed over in turn); a
    collective on each of them."""
    device = next((c.device for c in comms if c is not None), torch.device("cpu"))
    table = torch.zeros(len(needs), BUCKETS, dtype=torch.float64, device=device)
    buckets = sorted({_bucket(p.key) for p in pools})
    for i, need in enumerate(needs):
        table[i, buckets] += float(need)
    for comm in comms:
        if comm is not None:
            comm.all_reduce_sum(table)
    summed = table.cpu()
    return [[int(summed[i, _bucket(p.key)]) for p in pools] for i in range(len(needs))]
