"""Package ``__init__`` files that name their public pieces without importing them (PEP 562).

Note [lazy package names]
    ``import lightning_zero`` runs every ``__init__`` on the way to what is imported. If they imported what they
    name, the launcher (``python -m lightning_zero train``, which only composes a config and starts ``torchrun``)
    and ``estimate`` / ``advise`` would import Lightning (and with it ``torch._dynamo``, ``torchmetrics``),
    although only the ranks need it: the launcher's imports took 7.7 s of CPU, 2.9 s without (most of it torch).
    A package's ``__init__`` instead writes

        __getattr__, __dir__, __all__ = lazy_exports(__name__, {"pkg.module": ("Name", ...), ...})

    and a name is imported from its module the first time it is looked up (``from pkg import Name``,
    ``pkg.Name``), then kept in the package's namespace, so later look-ups cost nothing. ``__all__`` lists every
    name, so ``from pkg import *`` and ``dir(pkg)`` see them; ``tests/unit/test_import_graph.py`` reads the
    table's module names as imports of the ``__init__`` (layers, cycles); ``tests/unit/test_lazy_imports.py``
    checks that the launcher's modules import no Lightning.

Note [after import]
    What must happen once another library is imported, whichever of the two is imported first (registering the
    strategy names with Lightning's ``StrategyRegistry``), goes through :func:`after_import`: it runs the action at
    once if that module is imported already, else a one-shot finder at the front of ``sys.meta_path`` finds the
    module's spec with the other finders and wraps that spec's ``exec_module``, so the action runs right after the
    module's body ran and before its importer continues. The action must import nothing of ``lightning_zero`` that
    imports the other library: it may run in the middle of such a module's import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType


def lazy_exports(
    package: str, table: Mapping[str, Sequence[str]], eager: Sequence[str] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` of the package named ``package`` (Note [lazy package names]).

    Args:
        package: the package's ``__name__``.
        table: module path -> the names the package takes from it, imported on first look-up.
        eager: names the package defines itself (listed in ``__all__`` as well).

    Raises:
        ValueError: a name appears twice (in two modules, or in ``eager`` and a module).
    """
    where: dict[str, str] = {}
    for module, names in table.items():
        for name in names:
            if name in where or name in eager:
                raise ValueError(f"{package}: {name!r} is named twice in its lazy table; keep one entry.")
            where[name] = module
    exported = sorted([*where, *eager])

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this hook
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exported})

    return __getattr__, __dir__, exported


class _AfterImport(importlib.abc.MetaPathFinder):
    """The one-shot finder of :func:`after_import` (Note [after import])."""

    def __init__(self, module: str, action: Callable[[], None]) -> None:
        self.module, self.action = module, action

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_body = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_body(module)
            self.action()

        loader.exec_module = exec_module  # type: ignore[method-assign] - this module's own loader object
        return spec


def after_import(module: str, action: Callable[[], None]) -> None:
    """Run ``action`` now if ``module`` is imported, else right after it is (once; Note [after import])."""
    if module in sys.modules:
        action()
        return
    if not any(isinstance(f, _AfterImport) and f.module == module and f.action == action for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, action))
