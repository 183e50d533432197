"""How the former paths of :mod:`~lightning_zero.compat.former` are served: one finder, installed by the package.

Note [former paths]
    ``import lightning_zero`` installs :class:`FormerPathFinder` at the front of ``sys.meta_path`` before it imports
    anything else, so every former path works from then on, without a file at the old place:

    - a former module (its file is gone) is answered by the finder: with one new module, the old name is that module
      object itself (``sys.modules`` holds it under both names, so a name looked up or patched through either is
      the same); with several, a module whose names are looked up in the new ones in order. Each import warns;
    - a former name of a module that still exists is served by a ``__getattr__`` added to that module right after
      its body ran (``after_import``, Note [after import] in ``core/lazy.py``); it chains to the module's own
      ``__getattr__`` (a package's lazy names) and warns on each look-up;
    - a former method is set on its class once the class's module ran; it warns when called.

    The finder answers only the names in the table (a dictionary look-up per import): any other import goes to the
    next finder untouched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from lightning_zero.compat.former import FORMER_METHODS, FORMER_MODULES, FORMER_NAMES, FormerModule, FormerName
from lightning_zero.core.lazy import after_import


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        value = getattr(value, part)
    return value


def _warn_moved(old: str, new: str, removed_in: str, note: str = "") -> None:
    text = note or f"{old} moved to {new}; import from there"
    warnings.warn(f"{text} (this path goes away in {removed_in})", DeprecationWarning, stacklevel=3)


class _FormerModuleLoader(importlib.abc.Loader):
    """Loads a former module: the new module itself, or a module that looks its names up in the new ones."""

    def __init__(self, former: FormerModule) -> None:
        self.former = former

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        sources = [importlib.import_module(m) for m in self.former.new]
        if len(sources) == 1:
            return sources[0]
        merged = ModuleType(spec.name, f"Former path of {', '.join(self.former.new)} (lightning_zero/compat).")

        def __getattr__(name: str) -> object:
            for source in sources:
                if not name.startswith("__") and hasattr(source, name):
                    return getattr(source, name)
            raise AttributeError(f"module {spec.name!r} has no attribute {name!r}")

        merged.__getattr__ = __getattr__  # type: ignore[method-assign]
        merged.__all__ = sorted({n for s in sources for n in getattr(s, "__all__", [k for k in vars(s)
                                                                                     if not k.startswith("_")])})
        return merged

    def exec_module(self, module: ModuleType) -> None:
        _warn_moved(self.former.old, " / ".join(self.former.new), self.former.removed_in)


class FormerPathFinder(importlib.abc.MetaPathFinder):
    """The one finder of every former module path (Note [former paths])."""

    def __init__(self, modules: Sequence[FormerModule]) -> None:
        self.modules = {m.old: m for m in modules}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        former = self.modules.get(fullname)
        if former is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _FormerModuleLoader(former))


def _serve_names(module_name: str, names: dict[str, FormerName]) -> Callable[[], None]:
    """The action that adds, to the module named ``module_name``, a ``__getattr__`` serving ``names``."""

    def action() -> None:
        module = sys.modules[module_name]
        own = module.__dict__.get("__getattr__")

        def __getattr__(name: str) -> object:
            former = names.get(name)
            if former is None:
                if own is not None:
                    return own(name)
                raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
            new = former.target.replace(":", ".")
            _warn_moved(f"{module_name}.{name}", new, former.removed_in, former.note)
            return _resolve(former.target)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]

    return action


def _former_method(target: str, note: str, method: str) -> Callable[[], None]:
    """The action that sets, on the class a former method belonged to, a method that warns and calls the new one."""

    def action(owner_module: str, owner: str) -> None:
        def moved(cls: type, *args: Any, **kwargs: Any) -> Any:
            warnings.warn(note, DeprecationWarning, stacklevel=2)
            return getattr(_resolve(target), method)(*args, **kwargs)

        setattr(getattr(sys.modules[owner_module], owner), method, classmethod(moved))

    return action  # type: ignore[return-value]


def install() -> None:
    """Serve every former path from now on (once per process; Note [former paths])."""
    if any(isinstance(f, FormerPathFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, FormerPathFinder(FORMER_MODULES))
    by_module: dict[str, dict[str, FormerName]] = {}
    for former in FORMER_NAMES:
        by_module.setdefault(former.module, {})[former.name] = former
    for module_name, names in by_module.items():
        after_import(module_name, _serve_names(module_name, names))
    for (module_name, owner, method), (target, note) in FORMER_METHODS.items():
        set_method = _former_method(target, note, method)
        after_import(module_name, lambda m=module_name, o=owner, s=set_method: s(m, o))
