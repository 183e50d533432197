"""The process's own memory as Linux reports it (``/proc/self``), for tests and benchmarks that measure peaks."""

from __future__ import annotations

from pathlib import Path


def proc_status_bytes(key: str) -> int:
    """A size field of ``/proc/self/status`` in bytes, e.g. ``"VmRSS"``, ``"VmHWM"`` (peak RSS), ``"VmData"``.

    Raises:
        OSError: there is no ``/proc`` (not Linux).
        KeyError: the field does not exist.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current resident set (writing 5 to ``/proc/self/clear_refs``).

    Raises:
        OSError: not allowed here (or not Linux).
    """
    Path("/proc/self/clear_refs").write_text("5")
