"""Nothing is assigned into the engine or the strategy from another module after construction, and no private
attribute of the strategy is read outside its own folder.

The ZeRO engine and the strategy receive their collaborators (groups, the pipeline's coupling, the
resolved config, ...) in their constructors or through a method of their own (issue 30): an attribute
set from elsewhere is a dependency nobody sees at the constructor. Scanned from the source with
``ast``: an assignment (``=``, ``+=``, annotated) whose target is an attribute of an object named
``engine`` / ``strategy`` (also ``self._engine``, ``trainer.strategy``, ...), or that stores something
into another object's attribute named ``engine``. An object's assignments to its own attributes
(``self.x = ...``) are its own business and not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("lightning_zero", "benchmarks", "experiments")
OWNED_NAMES = {"engine", "_engine", "strategy", "_strategy"}  # objects that must not be assigned into
# any other name ending so (a class, ``ddp_strategy``, ``self.zero_engine``) is one too
OWNED_SUFFIXES = ("strategy", "engine")
# none allowed (a former method, ``ZeroStrategy.from_deepspeed_config``, is set on its class by lightning_zero/compat
# with the other former paths: Note [former paths]); an entry is "file: target" with its reason beside it
ALLOWED: set[str] = set()


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def outside_assignments(source: str, where: str) -> list[str]:
    """``file:line: target`` of every assignment into an engine / strategy in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            owner = _last_name(target.value)
            into_engine = target.attr in {"engine", "_engine"} and owner != "self"  # an object's own slot is its own
            owned = owner is not None and owner != "self" and owner.lower().endswith(OWNED_SUFFIXES)
            if (owner in OWNED_NAMES or owned or into_engine) and f"{where}: {ast.unparse(target)}" not in ALLOWED:
                found.append(f"{where}:{target.lineno}: {ast.unparse(target)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and (_last_name(node.args[0]) or "").lower().endswith(OWNED_SUFFIXES)):
            found.append(f"{where}:{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
    return found


def test_the_scan_finds_an_assignment_into_an_engine_or_a_strategy() -> None:
    source = ("engine.model_parallel = 1\nself._engine.norm_excess = f\nplugin.engine = e\n"
              "trainer.strategy.x += 1\nstrategy.y: int = 2\nengine.reducer.deferred = True\nself.z = 3\n"
              "self.engine = e\nZeroStrategy.alias = f\nself.zero_engine.x = 1\nsetattr(ddp_strategy, 'x', 1)\n")
    found = outside_assignments(source, "m.py")
    assert found == ["m.py:1: engine.model_parallel", "m.py:2: self._engine.norm_excess",
                     "m.py:3: plugin.engine", "m.py:4: trainer.strategy.x", "m.py:5: strategy.y",
                     "m.py:9: ZeroStrategy.alias", "m.py:10: self.zero_engine.x",
                     "m.py:11: setattr(ddp_strategy, ...)"], found


def test_no_module_assigns_into_the_engine_or_the_strategy() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            found += outside_assignments(path.read_text(), where)
    assert not found, ("attributes of the engine / the strategy assigned from another module (pass them to the "
                       "constructor, or call a method of the object that owns the attribute):\n" + "\n".join(found))


def private_strategy_reads(source: str, where: str) -> list[str]:
    """``file:line: expression`` of every read of a private attribute (``_name``) of an object named like a strategy
    (``strategy``, ``trainer.strategy``, ``ddp_strategy``, ...; ``self`` is the object's own business)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = _last_name(node.value)
            if owner is not None and owner != "self" and owner.lower().endswith("strategy"):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_a_private_read_of_a_strategy() -> None:
    source = ("a = strategy._run.mesh\nb = trainer.strategy._steps\nc = self._run\nd = strategy.engine\n"
              "e = s.__class__\n")
    found = sorted(private_strategy_reads(source, "m.py"))
    assert found == ["m.py:1: strategy._run", "m.py:2: trainer.strategy._steps"], found


def test_no_private_attribute_of_the_strategy_is_read_outside_its_folder() -> None:
    """The strategy's parts (``lightning_zero/lightning/``) are given what they need; everything else reads its public
    read-outs (``engine``, ``engine_comm``, ``layout()``, ``settings``, ...). Tests may look inside: they are not
    scanned."""
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if not where.startswith("lightning_zero/lightning/"):
                found += private_strategy_reads(path.read_text(), where)
    assert not found, "private attributes of the strategy read from outside lightning/:\n" + "\n".join(found)
