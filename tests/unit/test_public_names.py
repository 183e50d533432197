"""Every public name README.md and docs/*.md show can be imported, and former paths warn where they moved.

What is read: fenced ``python`` / ``bash`` blocks and inline code spans (console and text blocks are a
program's output: ``[lightning_zero.train][INFO]`` is a logger's name). What counts as a reference:
``from lightning_zero[.x] import A, B`` (also parenthesised over lines), ``import lightning_zero[.x]``,
dotted ``lightning_zero.x.Y`` (the longest importable module, then attributes), Hydra
``_target_: lightning_zero.x.Y`` (also in ``conf/**/*.yaml``), and ``Name.attr`` where ``Name`` was
imported from ``lightning_zero`` by some page (``DeepSpeedZeroStrategy.from_deepspeed_config``).

A reference under :data:`DEPRECATED` must warn with a DeprecationWarning; any other must not warn one
that names it, and none may be in :data:`DEPRECATED_ON_CALL` (a page that shows a deprecated name
should show the new one). ``from lightning_zero import *`` must give every name of ``__all__`` and
every name a page imports from the package.
"""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import lightning_zero

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HYDRA_CONFIGS = sorted((ROOT / "conf").rglob("*.yaml"))

# former documented paths, kept for one release: a reference at or under one must warn where it moved
DEPRECATED_MODULES = ("lightning_zero.core.engine", "lightning_zero.core.config", "lightning_zero.core.loss_scaler",
                      "lightning_zero.advisor", "lightning_zero.callbacks", "lightning_zero.monitoring",
                      "lightning_zero.progress", "lightning_zero.core.memory",
                      # issue 47's one order inside core/ (lightning_zero/compat/former.py)
                      "lightning_zero.core.zero.config", "lightning_zero.core.zero.memory",
                      "lightning_zero.core.zero.flat_param", "lightning_zero.core.offload.config",
                      "lightning_zero.core.reliability.agreement", "lightning_zero.core.stage3.teardown",
                      "lightning_zero.core.stage3.loading", "lightning_zero.lightning.own_bytes")
DEPRECATED = (*DEPRECATED_MODULES, "lightning_zero.DynamicLossScaler",
              "lightning_zero.core.precision.loss_scaler.DynamicLossScaler",
              # names the docs of the previous release showed at paths that moved (issue 30's reorganisation)
              "lightning_zero.callbacks.ZeroModelSummary", "lightning_zero.monitoring.dashboard_layout",
              "lightning_zero.progress.LineProgress", "lightning_zero.core.memory.model_state_formula",
              "lightning_zero.core.memory.offloaded_model_state", "lightning_zero.core.offload.nvme_path_problem",
              "lightning_zero.lightning.own_bytes.own_bytes",
              "lightning_zero.observability.callbacks.ZeroModelSummary",
              # names issue 47 moved (lightning_zero/compat/former.py): documented paths of the previous release
              "lightning_zero.core.zero.config.ZeroConfig", "lightning_zero.core.zero.config.DtypePolicy",
              "lightning_zero.core.zero.memory.model_state_formula",
              "lightning_zero.core.zero.memory.offloaded_model_state",
              "lightning_zero.core.offload.config.nvme_path_problem", "lightning_zero.core.offload.OffloadConfig",
              "lightning_zero.core.zero.ZeroConfig", "lightning_zero.core.offload.store.OptimizerOffload",
              "lightning_zero.deepspeed.strategy.precision_plugin_args")
# former names that warn when called, not when looked up (a page must not show them either; calling
# ZeroStrategy.from_deepspeed_config is tests/unit/test_deepspeed_config.py's old-name test)
DEPRECATED_ON_CALL = ("lightning_zero.ZeroStrategy.from_deepspeed_config",)

_FENCE = re.compile(r"^([ \t]*)```([A-Za-z]*)[ \t]*\n(.*?)^\1```", re.S | re.M)  # indented in a list item too
_FROM_IMPORT = re.compile(r"\bfrom\s+(lightning_zero(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w \t,]+(?:\\\n[\w \t,]+)*)")
_IMPORT = re.compile(r"(?<![\w.])import\s+((?:lightning_zero(?:\.\w+)*(?:\s+as\s+\w+)?\s*,?\s*)+)")
_DOTTED = re.compile(r"(?<![\w./-])lightning_zero(?:\.\w+)+")
_TARGET = re.compile(r"_target_['\"]?\s*[:=]\s*['\"]?(lightning_zero(?:\.\w+)+)")


@dataclass(frozen=True)
class Reference:
    """A dotted name a page shows (``lightning_zero.x.Y``) and where."""

    name: str
    where: str


def code_of(text: str) -> list[str]:
    """The fenced python / bash blocks and the inline code spans of a Markdown text."""
    code = [textwrap.dedent(m.group(3)) for m in _FENCE.finditer(text)
            if m.group(2) in {"python", "py", "bash", "sh", "yaml"}]
    prose = _FENCE.sub("", text)
    return code + re.findall(r"`([^`\n]+)`", prose)


def references_in(code: str, where: str) -> list[Reference]:
    """The ``lightning_zero`` names one piece of code refers to (without the ``Name.attr`` ones)."""
    found: list[str] = []
    for module, names in _FROM_IMPORT.findall(code):
        for item in re.split(r"[,\s()\\]+", re.sub(r"#[^\n]*", "", names)):
            if item and item != "as" and item != "*" and not found_alias(names, item):
                found.append(f"{module}.{item}")
    for group in _IMPORT.findall(code):
        found += [part.split()[0] for part in group.split(",") if part.strip()]
    found += _DOTTED.findall(code) + _TARGET.findall(code)
    return [Reference(name, where) for name in found]


def found_alias(names: str, item: str) -> bool:
    """Whether ``item`` is the alias of an ``import A as item`` in ``names`` (not a name to import)."""
    return re.search(rf"\bas\s+{re.escape(item)}\b", names) is not None


def imported_from_package(references: list[Reference]) -> set[str]:
    """Names shown as imported from the package root (``from lightning_zero import X``): ``X``."""
    return {r.name.split(".")[1] for r in references if r.name.count(".") == 1 and r.name.split(".")[1][:1].isupper()}


def attribute_references(text: str, classes: set[str], where: str) -> list[Reference]:
    """``Name.attr`` in the code of ``text`` for each ``Name`` in ``classes``, as ``lightning_zero.Name.attr``."""
    if not classes:
        return []
    pattern = re.compile(rf"(?<![\w.])({'|'.join(sorted(classes))})\.([A-Za-z_]\w*)")
    return [Reference(f"lightning_zero.{c}.{attr}", where) for code in code_of(text)
            for c, attr in pattern.findall(code)]


def all_references() -> list[Reference]:
    refs: list[Reference] = []
    for page in DOCS:
        for code in code_of(page.read_text()):
            refs += references_in(code, page.name)
    for config in HYDRA_CONFIGS:
        refs += [Reference(name, str(config.relative_to(ROOT))) for name in _TARGET.findall(config.read_text())]
    classes = imported_from_package(refs)
    for page in DOCS:
        refs += attribute_references(page.read_text(), classes, page.name)
    return refs


def resolve(name: str) -> object:
    """Import the longest module prefix of ``name``, then follow the rest as attributes (raises if missing)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def is_deprecated(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in DEPRECATED)


def resolve_and_warnings(name: str) -> tuple[str | None, list[str]]:
    """(why ``name`` does not resolve or None, the DeprecationWarnings resolving it gave that concern it).

    A former-path module warns when it is executed, so it is dropped from ``sys.modules`` first (it is a
    re-export: running it again changes nothing)."""
    for module in DEPRECATED_MODULES:
        if name == module or name.startswith(module + "."):
            sys.modules.pop(module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            return f"{type(e).__name__}: {e}", []
    ours = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
            and ("lightning_zero" in str(w.message) or name.split(".")[-1] in str(w.message))]
    return None, ours


def test_references_are_found_in_every_form() -> None:
    text = ("```python\nfrom lightning_zero import (\n    ZeroStrategy,  # the strategy\n    OffloadConfig as OC,\n)\n"
            "import lightning_zero.estimator as est, lightning_zero.cli\nlightning_zero.long_phase('x')\n"
            "strategy = DeepSpeedZeroStrategy.from_deepspeed_config(path)\n```\n"
            "```console\n[lightning_zero.train][INFO] - not code\n```\n"
            "Inline: `from lightning_zero.sparse_attention import FixedSparsityConfig`,"
            " `_target_: lightning_zero.models.gpt.GPT`, a path `lightning_zero/core/zero/engine.py` is no name.\n"
            "```bash\npython -c 'from lightning_zero import DeepSpeedZeroStrategy'\n```\n"
            "- a list item:\n\n  ```python\n  from lightning_zero.models import hf_sparse\n  ```\n")
    refs = [r.name for code in code_of(text) for r in references_in(code, "t.md")]
    assert sorted(set(refs)) == sorted({
        "lightning_zero.ZeroStrategy", "lightning_zero.OffloadConfig", "lightning_zero.estimator", "lightning_zero.cli",
        "lightning_zero.long_phase", "lightning_zero.sparse_attention",
        "lightning_zero.sparse_attention.FixedSparsityConfig", "lightning_zero.models.gpt.GPT",
        "lightning_zero.DeepSpeedZeroStrategy", "lightning_zero.models", "lightning_zero.models.hf_sparse"})
    classes = imported_from_package([Reference(n, "t.md") for n in refs])
    assert [r.name for r in attribute_references(text, classes, "t.md")] == [
        "lightning_zero.DeepSpeedZeroStrategy.from_deepspeed_config"]


def test_resolve_reports_a_missing_name_and_checks_the_warning() -> None:
    assert resolve_and_warnings("lightning_zero.ZeroStrategy")[0] is None
    assert "AttributeError" in (resolve_and_warnings("lightning_zero.core.zero.engine.NoSuchEngine")[0] or "")
    assert "no_such_module" in (resolve_and_warnings("lightning_zero.no_such_module.Thing")[0] or "")
    assert "moved to" in " ".join(resolve_and_warnings("lightning_zero.core.engine.ZeroEngine")[1])


def test_the_docs_show_many_names() -> None:
    names = {r.name for r in all_references()}
    assert len(names) > 30 and {"lightning_zero.ZeroStrategy", "lightning_zero.gathered_parameters"} <= names


def test_every_name_the_docs_show_imports() -> None:
    missing, unwarned, warned = [], [], []
    for name, refs in sorted(_by_name(all_references()).items()):
        problem, deprecations = resolve_and_warnings(name)
        where = ", ".join(sorted({r.where for r in refs}))
        if problem is not None:
            missing.append(f"{name} ({where}): {problem}")
        elif is_deprecated(name) and not deprecations:
            unwarned.append(f"{name} ({where})")
        elif not is_deprecated(name) and deprecations:
            warned.append(f"{name} ({where}): {deprecations[0]}")
        elif name in DEPRECATED_ON_CALL:
            warned.append(f"{name} ({where})")
    assert missing == [], "the docs show names that do not import"
    assert unwarned == [], "former paths that no longer warn"
    assert warned == [], "the docs show deprecated names: show the new ones, or list them in DEPRECATED"


@pytest.mark.parametrize("name", DEPRECATED)
def test_every_former_path_still_works_and_warns(name: str) -> None:
    problem, deprecations = resolve_and_warnings(name)
    assert problem is None and deprecations, f"{name}: {problem or 'no DeprecationWarning'}"


def test_star_import_covers_all_and_the_names_the_docs_import_from_the_package() -> None:
    namespace: dict[str, object] = {}
    exec("from lightning_zero import *", namespace)
    assert sorted(set(lightning_zero.__all__) - set(namespace)) == []
    top_level = {r.name.split(".")[1] for r in all_references() if r.name.count(".") == 1}
    shown = {name for name in top_level if not is_deprecated(f"lightning_zero.{name}")
             and not isinstance(getattr(lightning_zero, name, None), ModuleType)}
    assert sorted(shown - set(lightning_zero.__all__)) == [], "docs import these from lightning_zero: add to __all__"


def _by_name(refs: list[Reference]) -> dict[str, list[Reference]]:
    out: dict[str, list[Reference]] = {}
    for r in refs:
        out.setdefault(r.name, []).append(r)
    return out
