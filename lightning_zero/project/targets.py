"""A user's own code in a config: the nodes that name it by ``_target_`` (``model``, ``data``, each entry of
``callbacks``, ``logger``), as lightning-hydra-template writes them.

Note [user targets]
    A config node with a ``_target_`` key names the user's class (or function) by its dotted path, and its other
    keys are the arguments, as ``hydra.utils.instantiate`` reads it (``_partial_``, ``_recursive_``, ``_convert_``
    and ``_args_`` keep Hydra's meaning; a nested node with its own ``_target_``, e.g. an optimizer with
    ``_partial_: true``, is instantiated first and handed over). The package's own options stay typed by their
    schemas (``conf/model/gpt_tiny.yaml`` starts with ``gpt_schema``): only a node with ``_target_`` is the user's,
    kept as plain data in :class:`TargetNode`. ``model`` and ``data`` hold one; ``logger`` one, or a mapping of
    names to them (several loggers); ``callbacks`` a mapping of names to them, a ``null`` entry being off (so
    ``callbacks.early_stopping=null`` turns one off on the command line). Each rank instantiates them after the
    seed is set: the model first, then the data, the callbacks, the logger (``lightning_zero/project/instantiate.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TARGET = "_target_"
HYDRA_KEYS = frozenset({TARGET, "_partial_", "_recursive_", "_convert_", "_args_"})
USER_KEYS = ("model", "data", "logger")  # the root keys a `_target_` node may replace a package option in


def is_target(node: Any) -> bool:
    """Whether ``node`` (plain data) names an object by ``_target_``."""
    return isinstance(node, Mapping) and TARGET in node


@dataclass(frozen=True)
class TargetNode:
    """One config node naming the user's object by ``_target_`` (Note [user targets]).

    Args:
        key: where it sits in the config, e.g. ``model`` or ``callbacks.early_stopping``.
        node: the node as plain data, ``_target_`` included.
    """

    key: str
    node: Mapping[str, Any]

    def __post_init__(self) -> None:
        target = self.node.get(TARGET)
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"{self.key}._target_ must be a dotted path such as 'mypackage.module.MyClass', "
                             f"got {target!r}.")

    @property
    def target(self) -> str:
        """The dotted path of the class or function."""
        return str(self.node[TARGET])

    @property
    def name(self) -> str:
        """The class or function's own name (the last part of the path)."""
        return self.target.rsplit(".", 1)[-1]

    @property
    def arguments(self) -> dict[str, Any]:
        """The keyword arguments the node passes (Hydra's own ``_..._`` keys left out)."""
        return {k: v for k, v in self.node.items() if k not in HYDRA_KEYS}

    @property
    def partial(self) -> bool:
        """``_partial_: true``: instantiation returns a ``functools.partial`` of the target."""
        return bool(self.node.get("_partial_", False))

    def to_data(self) -> dict[str, Any]:
        """The node as plain data, as the config holds it."""
        return dict(self.node)


def target_entries(key: str, node: Any) -> dict[str, TargetNode] | None:
    """A mapping of names to ``_target_`` nodes (``callbacks``, several loggers) read from plain data; ``null``
    entries are off and left out. ``None`` when ``node`` is not such a mapping (an empty one is one).

    Raises:
        ValueError: an entry is neither ``null`` nor a ``_target_`` node (named, with the fix).
    """
    if node is None:
        return {}
    if not isinstance(node, Mapping) or is_target(node):
        return None
    out: dict[str, TargetNode] = {}
    for name, entry in node.items():
        if entry is None:
            continue
        if not is_target(entry):
            raise ValueError(f"{key}.{name} must be a node with a `_target_` (the dotted path of the class) or "
                             f"null (off), got {entry!r}. Fix: `{key}.{name}._target_=package.module.Class`, or "
                             f"{key}.{name}=null.")
        out[str(name)] = TargetNode(f"{key}.{name}", entry)
    return out


def entries_data(entries: Mapping[str, TargetNode]) -> dict[str, Any]:
    """``target_entries`` written back as plain data."""
    return {name: entry.to_data() for name, entry in entries.items()}


def user_parts(data: Mapping[str, Any]) -> dict[str, Any]:
    """The root keys of plain config data that hold the user's ``_target_`` nodes, as typed objects: ``model`` /
    ``data`` / ``logger`` with a ``_target_`` (a logger also as a mapping of them) and ``callbacks`` (always).

    Raises:
        ValueError: ``callbacks`` is not a mapping of ``_target_`` nodes (named, with the fix).
    """
    callbacks = target_entries("callbacks", data.get("callbacks"))
    if callbacks is None:
        raise ValueError("callbacks must map names to `_target_` nodes (lightning-hydra-template's callbacks/), "
                         f"got {data['callbacks']!r}. Fix: `callbacks.<name>._target_=package.module.Callback`.")
    out: dict[str, Any] = {"callbacks": callbacks}
    for key in USER_KEYS:
        value = data.get(key)
        if is_target(value):
            out[key] = TargetNode(key, value)
        elif key == "logger" and isinstance(value, Mapping) and value and "kind" not in value:
            several = target_entries(key, value)  # None: not such a mapping (the logger schema says why)
            if several is not None:
                out[key] = several
    return out


def as_plain(value: Any) -> Any:
    """A :class:`TargetNode`, or a mapping of them, as the config's plain data; anything else as it is."""
    if isinstance(value, TargetNode):
        return value.to_data()
    if isinstance(value, dict) and all(isinstance(v, TargetNode) for v in value.values()):
        return entries_data(value)
    return value


def user_nodes(model: Any, data: Any, logger: Any, callbacks: Mapping[str, TargetNode]) -> list[TargetNode]:
    """Every ``_target_`` node of a typed config's ``model``, ``data``, ``logger`` (one or several) and
    ``callbacks``, in that order (the order each rank instantiates them)."""
    out = [v for v in (model, data, logger) if isinstance(v, TargetNode)]
    if isinstance(logger, Mapping):
        out += [v for v in logger.values() if isinstance(v, TargetNode)]
    return out + list(callbacks.values())
