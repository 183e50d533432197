"""Memory sizes and parameter counts as text: parsing (``"80GiB"``, ``"7.5B"``) and formatting."""

from __future__ import annotations

import math
import re

from lightning_zero.core.common.memory import format_bytes as format_bytes  # re-exported: it lives in core

_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_DECIMAL = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
            "tb": 1e12, "p": 1e15, "pb": 1e15}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_COUNT = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _parse(text: float | str, table: dict[str, float], what: str, example: str, positive: bool,
           unit_required: bool = False) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in table:
            raise ValueError(f"Cannot read {what} {text!r}; write it like {example}.")
        value = float(m.group(1)) * table[unit]
        if unit_required and not m.group(2) and value:
            raise ValueError(f"{what} {text!r} has no unit (it would be {text} bytes); write it like {example}.")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"The {what} must be a {sign} finite number, got {text!r}; write it like {example}.")
    return value


def parse_size(text: float | str, unit_required: bool = False) -> float:
    """Bytes from ``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512G"`` (= GB), ``"2TB"``, ``"1.5e9"``.

    Args:
        text: a number of bytes or a string with a decimal (k/M/G/T/P, optional B) or binary
            (KiB/MiB/GiB/TiB/PiB) unit; case-insensitive.
        unit_required: refuse a string without a unit (other than 0): on a command line, ``80`` is more likely
            80 GB than 80 bytes.
    """
    if unit_required:
        return _parse(text, {**_DECIMAL, **_BINARY}, "memory size", _UNITS, False, unit_required)
    return _parse(text, {**_DECIMAL, **_BINARY}, "memory size", "80GB, 80GiB, 512G, 2TB or 1.5e9 (bytes)", False)


_UNITS = "80GB (10^9 bytes) or 80GiB (2^30); units: B, kB, MB, GB, TB, PB (powers of 1000), KiB, MiB, GiB, TiB, PiB"


def parse_count(text: float | str) -> float:
    """A parameter count from ``7.5e9``, ``"7.5B"``, ``"350M"``, ``"1.2T"`` or ``"124k"``.

    Args:
        text: a number, or a string with an optional k / M / B (or G) / T suffix.
    """
    return _parse(text, _COUNT, "parameter count", "7.5e9, 7.5B or 350M", True)


def format_count(n: float) -> str:
    """A parameter count, e.g. ``7.5B``, ``124M`` (B = 10^9)."""
    if math.isinf(n):
        return "unlimited"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.3g}"
