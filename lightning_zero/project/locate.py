"""Where a ``_target_`` is found: the project directory (the one the command runs in) first, as ``python -m``
would search it, then the installed packages; checked before launch without running the user's code, and
imported on each rank with errors that name the module, the ``_target_`` and the directory searched.

Note [project directory]
    The user's modules import from the directory ``lightning-zero`` runs in, with no ``PYTHONPATH``: the launcher
    records it in ``LIGHTNING_ZERO_PROJECT_DIR`` (once, before Hydra runs a job, so ``hydra.job.chdir`` cannot
    move it), every rank it starts inherits the variable, and :func:`use_project_dir` puts the directory first
    on ``sys.path`` before anything is imported from a ``_target_``. The console script's own ``sys.path[0]`` is
    its ``bin/`` directory, unlike ``python -m``'s: that is why it is put there explicitly.

Note [static target checks]
    Before any rank starts, a ``_target_`` is looked up without importing it (importing a LightningModule's
    module imports Lightning, seconds the launcher does not spend, Note [lazy package names]): the module is
    found by its spec (the package's ``__init__`` is not run), its source is parsed, and the name must be defined
    at its top level (a class, a function, an assignment or an import). When the name is a class defining its own
    ``__init__`` (or a function), the node's keys must be among its parameters and its parameters without a
    default among the keys. What cannot be decided from the source (no source, a module ``__getattr__``, a star
    import, an inherited or decorated ``__init__``, ``**kwargs``) is left to the ranks, which check the same
    with the imported object (:func:`locate`, :func:`check_arguments`) before anything is built.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_zero.core.common.errors import UsageError
from lightning_zero.project.targets import TargetNode

PROJECT_ENV = "LIGHTNING_ZERO_PROJECT_DIR"


class TargetError(UsageError):
    """A ``_target_`` that cannot be found or called with its config's keys (the message says how to fix it)."""


def project_dir() -> Path:
    """The user's project directory (Note [project directory]): ``$LIGHTNING_ZERO_PROJECT_DIR``, else the current
    directory."""
    return Path(os.environ.get(PROJECT_ENV) or os.getcwd()).resolve()


def record_project_dir() -> Path:
    """Set ``$LIGHTNING_ZERO_PROJECT_DIR`` to the current directory unless set (the launcher, before Hydra runs)."""
    os.environ.setdefault(PROJECT_ENV, os.getcwd())
    return project_dir()


def use_project_dir() -> Path:
    """Put the project directory first on ``sys.path`` (once) and return it."""
    path = project_dir()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


# ------------------------------------------------------------------------------ before launch, from the source
def _spec(name: str) -> ModuleSpec | None:
    """The spec of module ``name`` without running any module (a package's ``__init__`` included)."""
    parts = name.split(".")
    search = [str(project_dir()), *sys.path]
    spec = getattr(sys.modules.get(parts[0]), "__spec__", None)
    if spec is None:
        spec = importlib.machinery.PathFinder.find_spec(parts[0], search)
    if spec is None:
        try:  # the other finders (an editable install's): a top-level name imports nothing to be found
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            spec = None
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        full = ".".join(parts[: i + 1])
        loaded = getattr(sys.modules.get(full), "__spec__", None)
        spec = loaded or importlib.machinery.PathFinder.find_spec(full, list(spec.submodule_search_locations))
    return spec


@dataclass(frozen=True)
class _Source:
    """A module's top level as parsed: the names it defines, its classes / functions, and whether a name it does
    not define may still exist (a module ``__getattr__``, a star import)."""

    names: frozenset[str]
    definitions: dict[str, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]
    open_ended: bool


def _parse(origin: str) -> _Source | None:
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names: set[str] = set()
    definitions: dict[str, Any] = {}
    open_ended = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal open_ended
        for stmt in body:
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(stmt.name)
                definitions[stmt.name] = stmt
                open_ended = open_ended or stmt.name == "__getattr__"
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    open_ended = open_ended or alias.name == "*"
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
                visit([*stmt.body, *getattr(stmt, "orelse", []), *getattr(stmt, "finalbody", [])])
                for handler in getattr(stmt, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return _Source(frozenset(names), definitions, open_ended)


def _parameters(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], list[str]] | None:
    """(keyword parameters, those without a default) of a function, or of a class's own ``__init__``; ``None`` when
    the source cannot say (``**kwargs``, a decorated class, an inherited ``__init__``)."""
    function = node
    if isinstance(node, ast.ClassDef):
        if node.decorator_list:
            return None
        init = [s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"]
        if not init:
            return None
        function = init[0]
    args = function.args  # type: ignore[union-attr]
    if args.kwarg is not None:
        return None
    positional = [*args.posonlyargs, *args.args]
    if isinstance(node, ast.ClassDef) or (positional and positional[0].arg in ("self", "cls")):
        positional = positional[1:]
    keyword = [a.arg for a in positional if a not in args.posonlyargs] + [a.arg for a in args.kwonlyargs]
    with_default = len(args.defaults)
    required = [a.arg for a in positional[: len(positional) - with_default]]
    required += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    return keyword, required


def _argument_problems(node: TargetNode, what: str, keyword: list[str], required: list[str]) -> list[str]:
    given = node.arguments
    out = []
    for key in given:
        if key not in keyword:
            close = difflib.get_close_matches(key, keyword, n=1)
            fix = f"{node.key}.{close[0]}=<value>" if close else f"drop it (~{node.key}.{key})"
            out.append(f"{node.key}.{key}: {what} takes no argument {key!r} (it takes {', '.join(keyword) or 'none'})."
                       f" Fix: {fix}.")
    if not node.partial and "_args_" not in node.node:
        for name in required:
            if name not in given:
                out.append(f"{node.key}: {what} needs the argument {name!r} (no default). Fix: "
                           f"+{node.key}.{name}=<value> on the command line, or `{name}:` in the option's yaml.")
    return out


def static_problems(node: TargetNode) -> list[str]:
    """What is wrong with ``node``'s ``_target_`` and keys as far as the source tells, without importing it
    (Note [static target checks]); empty when nothing is wrong or nothing can be decided."""
    parts = node.target.split(".")
    where = project_dir()
    for cut in range(len(parts), 0, -1):
        spec = _spec(".".join(parts[:cut]))
        if spec is not None:
            break
    else:
        return [f"{node.key}._target_={node.target}: no module {parts[0]!r} in the project directory {where} nor "
                f"among the installed packages. Fix: run from the directory holding {parts[0]}/ (or {parts[0]}.py), "
                f"or install it."]
    module, rest = ".".join(parts[:cut]), parts[cut:]
    if not rest:
        return [f"{node.key}._target_={node.target} is a module, not a class or function in it. Fix: "
                f"{node.key}._target_={node.target}.ClassName."]
    source = _parse(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    if source is None:
        return []
    name = rest[0]
    if name not in source.names:
        if source.open_ended:
            return []
        package = spec.submodule_search_locations is not None
        close = difflib.get_close_matches(name, sorted(source.names), n=1)
        missing = (f"no module {module}.{name} in {next(iter(spec.submodule_search_locations or []))} and "
                   f"{module}/__init__.py defines no {name!r}" if package
                   else f"module {module} ({spec.origin}) defines no {name!r}")
        return [f"{node.key}._target_={node.target}: {missing}."
                + (f" Did you mean {'.'.join([*parts[:cut], close[0]])}?" if close else "")
                + f" (searched from the project directory {where})"]
    definition = source.definitions.get(name)
    if len(rest) != 1 or definition is None:
        return []
    params = _parameters(definition)
    return [] if params is None else _argument_problems(node, node.target, *params)


# ------------------------------------------------------------------------------ on a rank, importing
def locate(node: TargetNode) -> Any:
    """The object ``node``'s ``_target_`` names, imported from the project directory or the installed packages
    (each dotted part an attribute of the one before, or a submodule of it, as Hydra locates a ``_target_``).

    Raises:
        TargetError: the module is not found, importing it failed on another missing module, or it has no such
            name; the message names the module, the ``_target_`` and the directory searched.
    """
    where = use_project_dir()
    parts = node.target.split(".")

    def imported(name: str) -> ModuleType | None:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                return None
            raise TargetError(f"{node.key}._target_={node.target}: importing module {name} failed: {err} (a module "
                              f"it imports is missing; searched from the project directory {where}).") from err

    obj: Any = imported(parts[0])
    if obj is None:
        raise TargetError(f"{node.key}._target_={node.target}: no module {parts[0]!r} in the project directory "
                          f"{where} nor among the installed packages. Fix: run from the directory holding "
                          f"{parts[0]}/ (or {parts[0]}.py), or install it.")
    for i, attr in enumerate(parts[1:], start=1):
        found = getattr(obj, attr, None)
        if found is None and isinstance(obj, ModuleType):
            found = imported(".".join(parts[: i + 1]))
        if found is None:
            owner = ".".join(parts[:i])
            close = difflib.get_close_matches(attr, [n for n in dir(obj) if not n.startswith("_")], n=1)
            raise TargetError(f"{node.key}._target_={node.target}: {owner} has no {attr!r}."
                              + (f" Did you mean {owner}.{close[0]}?" if close else "")
                              + f" ({owner} is {getattr(obj, '__file__', None) or owner}; searched from the "
                              f"project directory {where})")
        obj = found
    if not callable(obj):
        raise TargetError(f"{node.key}._target_={node.target} is not a class or function ({type(obj).__name__}).")
    return obj


def check_arguments(node: TargetNode, obj: Any) -> None:
    """Refuse keys ``obj`` does not take and parameters without a default the node does not give.

    Raises:
        TargetError: naming each key, the class and its parameters.
    """
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: instantiation says what is wrong
        return
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        keyword = [*node.arguments]
    else:
        keyword = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = _argument_problems(node, node.target, keyword, required)
    if problems:
        raise TargetError("\n".join(problems))
