"""The package's folders stay small: no folder of ``lightning_zero/`` holds more than 12 Python modules.

What counts: every ``*.py`` file directly in the folder -- its ``__init__.py``, ``__main__.py`` and the
modules kept for one release at a former documented path (they are files a reader has to look through
too). Sub-folders are counted on their own, not in their parent. A folder past the limit is a sign it
holds two mechanisms: split it by mechanism (docs/design.md says where each goes).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"
MAX_MODULES_PER_FOLDER = 12


def python_modules_by_folder(package: Path) -> dict[str, int]:
    """Folder (relative to ``package``'s parent) -> the number of ``*.py`` files directly in it."""
    folders = [package, *sorted(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return {str(f.relative_to(package.parent)): sum(1 for _ in f.glob("*.py")) for f in folders}


def test_counter_counts_init_shims_and_root_but_not_subfolders(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "__main__.py", "old_path_shim.py", "sub/__init__.py", "sub/a.py", "sub/b.py"):
        (package / name).write_text('"""x."""\n')
    (package / "notes.md").write_text("not a module")
    assert python_modules_by_folder(package) == {"pkg": 3, "pkg/sub": 3}


def test_no_folder_holds_more_than_twelve_python_modules() -> None:
    counts = python_modules_by_folder(PACKAGE)
    assert "lightning_zero" in counts and "lightning_zero/core/zero" in counts  # the root and nested folders
    crowded = {folder: n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}, f"split these folders by mechanism (at most {MAX_MODULES_PER_FOLDER} modules each)"


# folders whose __init__ is left to the branch reworking them (remove the entry when that lands)
NOT_YET_NAMED: dict[str, str] = {}  # a folder whose __init__ may not name its pieces yet, with the reason


def test_every_sub_package_names_its_public_pieces_or_says_why_not() -> None:
    """Each folder's ``__init__`` imports and lists in ``__all__`` what other layers and users use (every name
    resolving), or its docstring says why it names nothing (``Nothing is imported here``, e.g. a cycle)."""
    import importlib

    silent = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        name = ".".join(init.relative_to(PACKAGE.parent).parent.parts)
        if name in NOT_YET_NAMED:
            continue
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        if names is None:
            if "Nothing is imported here" not in (module.__doc__ or ""):
                silent.append(name)
            continue
        assert names and all(hasattr(module, n) for n in names), name
    assert silent == []


def _shim_reasons(path: Path, relative: str, former: set[str]) -> list[str]:
    """Why ``path`` is a shim module (empty: it is not): a file at a former path (compat/ serves those), a module
    that warns on import, or one that only hands names on without a word of its own (no definition, no Note)."""
    text = path.read_text()
    tree = ast.parse(text)
    out = []
    if relative in former:
        out.append("a file at a former path")
    if any(isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and "warn" in ast.unparse(n.value.func)
           for n in tree.body):
        out.append("warns on import")
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    defines = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))
               and not (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets))]
    if not defines and path.name not in ("__init__.py", "__main__.py") and "Note [" not in text:
        out.append("only hands names on")
    return out


def test_the_shim_scan_finds_each_kind(tmp_path: Path) -> None:
    reexport = tmp_path / "old.py"
    reexport.write_text('"""Moved."""\n\nfrom a.b import c\n\n__all__ = ["c"]\n')
    assert _shim_reasons(reexport, "x/old.py", {"x/old.py"}) == ["a file at a former path", "only hands names on"]
    warning = tmp_path / "warns.py"
    warning.write_text('"""Moved."""\n\nimport warnings\n\nwarnings.warn("moved", DeprecationWarning)\nX = 1\n')
    assert _shim_reasons(warning, "x/warns.py", set()) == ["warns on import"]
    face = tmp_path / "face.py"
    face.write_text('"""The format.\n\nNote [the format]\n    Described here.\n"""\n\nfrom a.b import c\n')
    assert _shim_reasons(face, "x/face.py", set()) == []


def test_no_shim_module_outside_compat() -> None:
    """Every former path is served from ``compat/`` (Note in ``compat/former.py``); no module elsewhere is a shim."""
    from lightning_zero.compat.former import FORMER_MODULES

    former = {m.old.removeprefix("lightning_zero.").replace(".", "/") + ".py" for m in FORMER_MODULES}
    former |= {f.removesuffix(".py") + "/__init__.py" for f in former}
    shims = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("compat/"):
            continue
        if reasons := _shim_reasons(path, relative, former):
            shims[relative] = reasons
    assert shims == {}
