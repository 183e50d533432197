"""The import graph of ``lightning_zero/``: no cycles, and every import points down a layer.

Built from the source with ``ast``: every ``import`` / ``from ... import`` counts, including those
inside functions, the modules of a package's ``lazy_exports`` table (core/lazy.py), and those under
``if TYPE_CHECKING:`` (they never run, but a type named across a cycle is
still a cycle: move the shared type down, e.g. a small ``Protocol`` in the lower module).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_zero"

# The layers, lowest first. A module may import its own layer or a lower one; the first prefix
# that matches a module's dotted name decides its layer (so list the more specific prefixes first).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("lightning_zero.core", "lightning_zero.sparse_attention")),
    ("glue", (
        "lightning_zero.lightning", "lightning_zero.observability", "lightning_zero.reliability",
        "lightning_zero.checkpoint", "lightning_zero.deepspeed", "lightning_zero.models", "lightning_zero.pipeline",
        "lightning_zero.tensor_parallel",
        "lightning_zero.sequence_parallel", "lightning_zero.parallel", "lightning_zero.moe", "lightning_zero.hf",
    )),
    ("tools", (
        "lightning_zero.config", "lightning_zero.cli", "lightning_zero.estimator",
        "lightning_zero.testing", "lightning_zero.__main__", "lightning_zero.project",
        "lightning_zero.compat",  # the former paths' table and finder: imports only core/lazy.py, by name the rest
    )),
)
TOP = "lightning_zero"  # the package's __init__: imports from every layer (only the module itself, not a prefix)
# what core/ may import besides itself
CORE_ALLOWED = {"torch"} | set(sys.stdlib_module_names)
CORE_KNOWN_EXCEPTIONS: dict[str, set[str]] = {}  # file -> allowed non-torch imports (none: keep it so)


def _layer(module: str) -> int:
    if module == TOP:
        return len(LAYERS) - 1
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer of tests/unit/test_import_graph.py: add it to LAYERS")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str | None = None) -> set[str]:
    """Absolute names of every module ``path`` imports (``from a import b`` counts ``a`` and ``a.b``)."""
    name, is_package = name or _module_name(path), path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            # a package's lazy names (core/lazy.py): each module of its table is an import of the package
            for table in node.args[1:2]:
                keys = table.keys if isinstance(table, ast.Dict) else []
                found.update(k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the ``lightning_zero`` modules it imports (names that are not modules dropped)."""
    files = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_helpers_see_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lightning\n"
                   "    from lightning_zero.core.zero.engine import ZeroEngine\n"
                   "def f():\n    from lightning_zero.lightning.strategy import ZeroStrategy\n"
                   "    from . import units\n"
                   "__getattr__, __dir__, __all__ = lazy_exports(__name__, {'lightning_zero.models.gpt': ('GPT',)})\n")
    found = _imports(src, "lightning_zero.core.probe")
    assert {"lightning_zero.lightning.strategy", "lightning_zero.core.units", "lightning",
            "lightning_zero.core.zero.engine", "lightning_zero.models.gpt"} <= found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def _with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` plus an edge ``m -> P`` wherever ``m``, outside package ``P``, imports a module below ``P``: Python
    runs ``P/__init__.py`` before it, so ``m`` imports whatever that ``__init__`` names (the top package, which
    imports everything and is always imported first, left out)."""
    out = {m: set(deps) for m, deps in graph.items()}
    for m, deps in graph.items():
        for d in deps:
            parts = d.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in graph and not (m == package or m.startswith(package + ".")):
                    out[m].add(package)
    return out


def test_package_init_edges_catch_a_cycle_through_an_init() -> None:
    # b's __init__ names b.x, which imports a, which imports b.y: importing a first runs b/__init__ mid-a
    graph = {"lightning_zero.a": {"lightning_zero.b.y"}, "lightning_zero.b": {"lightning_zero.b.x"},
             "lightning_zero.b.x": {"lightning_zero.a"}, "lightning_zero.b.y": set()}
    assert _cycles(graph) == []
    assert _cycles(_with_package_inits(graph)) == [["lightning_zero.a", "lightning_zero.b", "lightning_zero.b.x"]]


def test_no_import_cycle_through_a_package_init() -> None:
    """What a sub-package's ``__init__`` names must not import back a module that imports below the package (say
    so in its docstring instead): whichever is imported first would be half-initialised when the other needs it."""
    assert _cycles(_with_package_inits(_graph())) == []


def test_imports_point_down_the_layers() -> None:
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {i} ({LAYERS[_layer(i)][0]})"
              for m, deps in _graph().items() for i in sorted(deps) if _layer(i) > _layer(m)]
    assert upward == []


# core/'s folders, lowest first (docs/design.md, "One order inside core"): a module of one may import its own folder
# and the folders before it, never one after it. ``common`` is the leaf everything shares; ``zero`` (the engine)
# composes the rest and is imported back by nothing in core/.
CORE_ORDER = ("common", "settings", "mesh", "reliability", "comm", "experts", "precision", "stage3", "offload", "zero")


def _folder(module: str) -> str:
    """The folder a module sits in: a package stands for its own folder, a module for its parent's (the root's
    modules, ``cli`` or ``__main__``, are the root's folder, ``lightning_zero``)."""
    path = PACKAGE.parent.joinpath(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Folder -> the folders its modules import -> the module imports that make the arrow."""
    out: dict[str, dict[str, list[str]]] = {}
    for m, deps in graph.items():
        arrows = out.setdefault(_folder(m), {})
        for d in deps:
            if _folder(d) != _folder(m):
                arrows.setdefault(_folder(d), []).append(f"{m} -> {d}")
    return out


def test_folder_helpers_see_packages_and_modules() -> None:
    assert _folder("lightning_zero.core.zero.engine") == "lightning_zero.core.zero"
    assert _folder("lightning_zero.core.zero") == "lightning_zero.core.zero"
    assert _folder("lightning_zero.cli") == "lightning_zero"
    graph = {"lightning_zero.cli": {"lightning_zero.config.validate"},
             "lightning_zero.config.validate": {"lightning_zero"}, "lightning_zero": set()}
    folders = _folder_graph(graph)
    assert _cycles({f: set(a) for f, a in folders.items()}) == [["lightning_zero", "lightning_zero.config"]]


def test_core_folders_follow_one_order() -> None:
    """Every folder of core/ has its place in :data:`CORE_ORDER`, and no import runs back up it."""
    on_disk = {p.name for p in (PACKAGE / "core").iterdir() if (p / "__init__.py").exists()}
    assert sorted(on_disk) == sorted(CORE_ORDER), "give each folder of core/ its place in CORE_ORDER"
    rank = {f"lightning_zero.core.{name}": i for i, name in enumerate(CORE_ORDER)}
    back_up = [why for folder, arrows in _folder_graph(_graph()).items() if folder in rank
               for target, whys in sorted(arrows.items()) if rank.get(target, -1) > rank[folder] for why in whys]
    assert back_up == [], "imports running back up core/'s order"


def test_no_folder_cycles() -> None:
    """No two folders of the package import each other, directly or around a loop (the root's modules, ``cli``
    and ``__main__``, are one folder: ``lightning_zero``)."""
    folders = _folder_graph(_graph())
    cycles = _cycles({f: set(arrows) for f, arrows in folders.items()})
    shown = [f"{a} -> {b}: {folders[a][b][0]}" for c in cycles for a in c for b in c if b in folders[a]]
    assert cycles == [], shown


def test_nothing_in_lightning_zero_imports_experiments() -> None:
    bad = [f"{_module_name(p)} imports {i}" for p in sorted(PACKAGE.rglob("*.py")) for i in sorted(_imports(p))
           if i == "experiments" or i.startswith("experiments.")]
    assert bad == []


CORE_FOLDERS = ("core", "sparse_attention")  # packages at the core layer: torch + stdlib + each other


@pytest.mark.parametrize("path", sorted(p for folder in CORE_FOLDERS for p in (PACKAGE / folder).rglob("*.py")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_core_imports_only_torch_and_the_standard_library(path: Path) -> None:
    allowed = CORE_ALLOWED | {"lightning_zero"} | CORE_KNOWN_EXCEPTIONS.get(path.name, set())
    outside = sorted(i for i in _imports(path) if i.split(".")[0] not in allowed)
    inside = sorted(i for i in _imports(path) if i.startswith("lightning_zero.") and not any(
        i == f"lightning_zero.{folder}" or i.startswith(f"lightning_zero.{folder}.") for folder in CORE_FOLDERS))
    assert outside == [] and inside == []


def test_every_module_opens_with_a_docstring() -> None:
    missing = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
               if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []


def _named_in_design_map() -> set[str]:
    """The file names (without ``.py``) that ``docs/design.md`` writes in backticks."""
    spans = re.findall(r"`([^`]+)`", (ROOT / "docs" / "design.md").read_text())
    return {Path(word).stem for span in spans for word in re.split(r"[\s,/]+", span) if word}


def test_docs_design_map_names_every_module() -> None:
    named = _named_in_design_map()
    unnamed = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
               if p.stem not in {"__init__", "__main__"} and p.stem not in named]
    assert unnamed == [], "add these files to the map in docs/design.md"


def test_docs_design_map_names_only_files_that_exist() -> None:
    spans = re.findall(r"`([^`/\s]+\.py)`", (ROOT / "docs" / "design.md").read_text())
    existing = {p.name for p in ROOT.glob("**/*.py") if ".venv" not in p.parts}
    assert sorted(set(spans) - existing) == []
