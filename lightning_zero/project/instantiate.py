"""The user's ``_target_`` nodes made into objects on each rank, after the seed is set (Note [user targets]):
located in the project directory, their keys checked against the signature, then ``hydra.utils.instantiate``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from lightning_zero.project.locate import check_arguments, locate
from lightning_zero.project.targets import TargetNode


def _takes(obj: Any, name: str) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def instantiate_target(node: TargetNode, defaults: Mapping[str, Any] | None = None) -> Any:
    """The object ``node`` describes, built with ``hydra.utils.instantiate`` (nested ``_target_`` nodes first).

    Args:
        node: the config node.
        defaults: arguments given when the node does not set them and the target takes them (a logger's
            ``save_dir``: the run directory).

    Raises:
        TargetError: the target is not found, or the keys do not fit its parameters (before it is called).
    """
    from hydra.utils import instantiate

    obj = locate(node)
    extra = {k: v for k, v in (defaults or {}).items() if k not in node.node and _takes(obj, k)}
    full = TargetNode(node.key, {**node.node, **extra})
    check_arguments(full, obj)
    return instantiate(full.to_data())


def instantiate_entries(entries: Mapping[str, TargetNode], defaults: Mapping[str, Any] | None = None) -> list[Any]:
    """Each entry of a mapping of ``_target_`` nodes (``callbacks``, loggers), in the config's order."""
    return [instantiate_target(entry, defaults) for entry in entries.values()]
