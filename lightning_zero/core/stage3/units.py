"""Stage 3: which parameters are gathered together (units), planned once from the module tree.

Note [units]
    A unit is a set of modules whose parameters are gathered, used and released together. By
    default the units are the children of every ``nn.ModuleList`` (the repeated blocks of a
    transformer), or the modules whose class a policy names; a unit never nests in another (the
    outermost match wins). Every parameter belongs to exactly one unit:

    * the *root* unit holds the parameters of no block (embeddings, final norm, head). It is
      gathered on first use in a step and released after backward, since its modules run
      before and after every block.
    * a parameter used by modules of two units (a tied embedding and output head) moves to the
      root unit, which is gathered whenever any block runs, so both users see it.
    * parameters with fewer than ``param_persistence_threshold`` elements form the *persistent*
      unit: never released (as stage 2 keeps parameters), so tiny tensors cost no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

ROOT = "<root>"
PERSISTENT = "<persistent>"


@dataclass
class UnitPlan:
    """The parameters and modules of one unit (Note [units])."""

    name: str  # qualified module name of the unit, or ROOT / PERSISTENT
    params: list[nn.Parameter] = field(default_factory=list)  # module order
    modules: list[nn.Module] = field(default_factory=list)  # the unit's top module(s) (empty for root/persistent)


def plan_units(
    module: nn.Module,
    names: dict[nn.Parameter, str],
    unit_classes: tuple[type[nn.Module], ...] = (),
    persistence_threshold: int = 0,
) -> list[UnitPlan]:
    """Split ``module``'s parameters into units (Note [units]).

    Args:
        module: the whole model.
        names: every parameter -> qualified name, in module order.
        unit_classes: module classes that make a unit; empty: the children of ``nn.ModuleList``s.
        persistence_threshold: parameters with fewer elements go to the persistent unit.

    Returns:
        The block units in module order, then the root unit, then the persistent unit (the last
        two only when they hold parameters).
    """
    tops: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module, parent_is_list: bool) -> None:
        is_unit = isinstance(mod, unit_classes) if unit_classes else parent_is_list
        if is_unit and prefix:
            tops.append((prefix, mod))
            return
        for child_name, child in mod.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child, isinstance(mod, nn.ModuleList))

    visit("", module, False)
    if unit_classes and not tops:
        raise ValueError(
            f"No module of the unit classes {[c.__name__ for c in unit_classes]} was found in "
            f"{type(module).__name__}. Name classes the model contains, or leave `unit_classes` empty to use "
            "the children of its nn.ModuleLists."
        )
    owner: dict[nn.Parameter, int] = {}  # parameter -> index of the unit whose modules use it
    shared: set[nn.Parameter] = set()
    for i, (_, top) in enumerate(tops):
        for p in top.parameters():
            if p in owner and owner[p] != i:
                shared.add(p)
            owner.setdefault(p, i)
    # a parameter also reachable from outside its unit (tied to a root module) is shared too
    root_reachable = _params_outside(module, {id(t) for _, t in tops})
    shared |= {p for p in owner if p in root_reachable}
    units = [UnitPlan(name, modules=[top]) for name, top in tops]
    root = UnitPlan(ROOT)
    persistent = UnitPlan(PERSISTENT)
    for p in names:
        if p.numel() < persistence_threshold:
            persistent.params.append(p)
        elif p in owner and p not in shared:
            units[owner[p]].params.append(p)
        else:
            root.params.append(p)
    out = [u for u in units if u.params]
    return out + [u for u in (root, persistent) if u.params]


def _params_outside(module: nn.Module, unit_ids: set[int]) -> set[nn.Parameter]:
    """Parameters owned directly by modules that are not inside any unit."""
    found: set[nn.Parameter] = set()

    def visit(mod: nn.Module) -> None:
        if id(mod) in unit_ids:
            return
        found.update(mod.parameters(recurse=False))
        for child in mod.children():
            visit(child)

    visit(module)
    return found


def direct_owners(module: nn.Module, params: set[nn.Parameter]) -> list[nn.Module]:
    """Modules that own one of ``params`` directly (``recurse=False``), in module order."""
    return [m for m in module.modules() if any(p in params for p in m.parameters(recurse=False))]
