"""Reading a DeepSpeed JSON: the file (duplicate keys refused), and each object as a :class:`JsonSection` that
remembers which keys were read, so that every key nobody read is reported as unsupported (``config.py``).

Note [auto]
    DeepSpeed's ``"auto"`` (a value the HF Trainer integration fills in) counts as not set: :meth:`JsonSection.get`
    returns the default for it, and :meth:`JsonSection.noop` accepts it for any key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

AUTO = "auto"
T = TypeVar("T")
_PREFIX = "DeepSpeed config: "


class Problems:
    """Every problem of one JSON, each part's own message, raised together (a part that fails gives its
    fallback, so the parts after it are read and checked too)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def attempt(self, part: Callable[[], T], fallback: T) -> T:
        """``part()``, or ``fallback`` with its ``ValueError``'s message kept."""
        try:
            return part()
        except ValueError as err:
            self.messages.extend(str(err).split("\n" + _LIST))
            return fallback

    def add(self, messages: list[str]) -> None:
        """Problems found otherwise (the settings tree's rules), one message each."""
        self.messages.extend(messages)

    def raise_any(self, origin: str) -> None:
        """Raise the one problem as it was, or all of them in one ``ValueError``, one line each."""
        if len(self.messages) == 1:
            raise ValueError(self.messages[0])
        if self.messages:
            lines = [m.removeprefix(_PREFIX) for m in self.messages]
            raise ValueError(f"{_PREFIX}{origin}: {len(lines)} problems:\n{_LIST}" + f"\n{_LIST}".join(lines))


_LIST = "  - "


class JsonSection:
    """A dict being read: remembers which keys were used, so the rest can be reported."""

    def __init__(self, data: Any, path: str, unsupported: list[str]) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"DeepSpeed config: `{path or 'the config'}` must be a JSON object, got {data!r}.")
        self.data, self.path, self.used, self.unsupported = dict(data), path, set(), unsupported

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type, default: Any = None) -> Any:
        """The value of ``name`` checked against ``kind`` (``None`` when absent or ``"auto"``)."""
        self.used.add(name)
        value = self.data.get(name)
        if value is None or value == AUTO:
            return default
        return typed(value, kind, self.key(name))

    def section(self, name: str) -> JsonSection | None:
        self.used.add(name)
        value = self.data.get(name)
        return None if value is None else JsonSection(value, self.key(name), self.unsupported)

    def noop(self, table: dict[str, tuple[Any, ...]]) -> None:
        for name, ok in table.items():
            if name in self.data:
                self.used.add(name)
                value = self.data[name]
                if value != AUTO and not any(value == v and type(value) is type(v) for v in ok):
                    self.unsupported.append(f"{self.key(name)}={json.dumps(value)}")

    def finish(self) -> None:
        self.unsupported.extend(self.key(k) for k in self.data if k not in self.used)


def typed(value: Any, kind: type, key: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 5e8 in JSON is a float
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, kind):
        return value
    raise ValueError(f"DeepSpeed config: `{key}` must be {kind.__name__}, got {value!r}.")


def load_json(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(source, Mapping):
        return dict(source), "<dict>"
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist (relative to {Path.cwd()}).")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"DeepSpeed config {path}: duplicate key(s) {dup}.")
        return dict(pairs)

    try:
        return json.loads(path.read_text(), object_pairs_hook=no_duplicates), str(path)
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}") from err


def refuse_nulls(section: JsonSection | None) -> None:
    """DeepSpeed refuses ``null`` in its fp16 / bf16 sections (it is not "absent"): so do we."""
    nulls = [section.key(k) for k, v in (section.data.items() if section is not None else ()) if v is None]
    if nulls:
        raise ValueError(f"DeepSpeed config: {', '.join(f'`{k}`' for k in nulls)} is null. Give a value, or leave "
                         "the key out to get the default.")
