"""Stage 3 sharded construction: a model built on the meta device is materialised unit by unit.

Note [sharded construction]
    Parameters registered under :func:`parameters_on_meta` (the strategy's ``model_sharded_context``
    during ``configure_model``) have shapes but no values. :func:`replace_meta_parameters` swaps
    each for a CPU ``nn.Parameter`` of the same shape whose storage is already freed (tied
    parameters stay tied), so the optimizer can be built on them. Stage 3 then takes one unit
    at a time: allocates its flat buffer, points the parameters at it, initialises them there
    with ``param_init_fn`` (default: each module's ``reset_parameters``), broadcasts it from rank
    0, keeps this rank's shard and frees the buffer. No rank ever holds more than its shards and
    one unit.

    Only parameters are intercepted (as DeepSpeed's ``zero.Init`` intercepts parameters only):
    buffers, torchmetrics states and any other tensor created in ``configure_model`` are real,
    with their values, and stay whole on every rank.

    Initialisation differs from building the model whole: every module is initialised with the
    global RNG seeded from ``(base seed, module name)``, so the values do not depend on the
    world size, the rank or the order modules were built in (they are not the values an eager
    construction with the same seed gives).

Note [split owners]
    One module's parameters can belong to different units: below ``param_persistence_threshold``
    a bias goes to the persistent unit while its weight stays in a block, and a weight tied to
    another unit's module goes to the root. The module is initialised once, when the first unit
    holding one of its parameters is built; its parameters outside that unit have no storage
    then (writing into them crashed the interpreter), so they get a temporary tensor for the
    initialiser, and the unit built later copies the values in (``FlatParamGroup.bind`` copies
    every parameter that is no longer marked uninitialised).
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_zero.core.common.uninitialized import is_uninitialized, mark_initialized, mark_uninitialized

ParamInitFn = Callable[[nn.Module, str], None]  # (module, qualified name) -> initialise its own params


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def replace_meta_parameters(module: nn.Module, device: torch.device) -> int:
    """Replace every meta parameter of ``module`` by a storage-less parameter on ``device``.

    Returns the number of parameters replaced. Raises when a buffer is on the meta device (a
    buffer has no initialiser to rerun).
    """
    meta_buffers = [n for n, b in module.named_buffers() if b.is_meta]
    if meta_buffers:
        raise NotImplementedError(
            f"Buffers {meta_buffers[:3]} were created on the meta device, and a buffer cannot be initialised "
            "afterwards. Create buffers in the LightningModule's __init__ (outside configure_model), or compute "
            "them in forward."
        )
    new: dict[int, nn.Parameter] = {}  # id(old meta param) -> replacement (keeps ties)
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)
                replacement = nn.Parameter(t, requires_grad=p.requires_grad)
                mark_uninitialized(replacement)
                new[id(p)] = replacement
            mod._parameters[key] = new[id(p)]
    return len(new)


def default_init(module: nn.Module, name: str) -> None:
    """``module.reset_parameters()``; raises, naming the module, when it has none."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"Module {name!r} ({type(module).__name__}) was built on the meta device and has no reset_parameters() "
            "to initialise its parameters. Pass `ZeroStrategy(param_init_fn=fn)` with fn(module, name) that "
            "initialises the module's own parameters in place."
        )
    reset()


@torch.no_grad()
def initialize_modules(
    owners: list[tuple[str, nn.Module]], init_fn: ParamInitFn | None, base_seed: int,
    bound: set[nn.Parameter] | None = None,
) -> None:
    """Run the initialiser of each module owning uninitialised parameters (Note [sharded construction]).

    Args:
        owners: ``(qualified name, module)`` of the modules to initialise, in module order.
        init_fn: ``fn(module, name)``; ``None``: the module's ``reset_parameters``.
        base_seed: the run's base seed.
        bound: the parameters that have storage now (the unit being built). A module's other
            parameters (Note [split owners]) get temporary storage for the initialiser: an
            uninitialised one keeps the values it gets (its own unit copies them in when it is
            built); one initialised before (and sharded since) gets its value back untouched.
    """
    for name, module in owners:
        params = list(module.parameters(recurse=False))
        own = [p for p in params if is_uninitialized(p)]
        if not own:
            continue
        kept: dict[nn.Parameter, torch.Tensor] = {}
        for p in params:
            if bound is not None and p not in bound:  # Note [split owners]
                if not is_uninitialized(p):
                    kept[p] = p.data
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((base_seed + zlib.crc32(name.encode())) % (2**63))
            (init_fn or default_init)(module, name)
        for p, data in kept.items():
            p.data = data
        for p in own:
            mark_initialized(p)


@torch.no_grad()
def initialize_like_sharded(module: nn.Module, init_fn: ParamInitFn | None, base_seed: int, prefix: str = "") -> None:
    """Initialise a module built whole with the values a meta-device build of it gets (Note [sharded
    construction]: each module from ``(base_seed, its qualified name)``, ``prefix`` naming ``module`` inside
    the root the strategy sees, e.g. ``"model"``). So a run's initial weights are the same whether the model is
    built whole, by each pipeline stage or unit by unit at stage 3, for any world size. Meta parameters stay
    meta (nothing to write)."""
    for p in module.parameters():
        mark_uninitialized(p)
    initialize_modules(list(module.named_modules(prefix=prefix)), init_fn, base_seed)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block every ``nn.Parameter`` registered on a module is moved to the meta device
    (shape, dtype, ``requires_grad`` and attributes kept; a parameter registered twice stays one
    object). Everything else (buffers, metric states, plain tensors) is created for real, on the
    current default device. A parameter's values are freed at registration, so at most one
    parameter is ever allocated. Not thread-safe: ``nn.Module.register_parameter`` is patched.
    """
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}  # id(real) -> (its ref, its meta twin)

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and type(param) is nn.Parameter and not param.is_meta:
            seen = moved.get(id(param))
            if seen is None or seen[0]() is not param:
                meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)
                seen = moved[id(param)] = (weakref.ref(param), meta)
            param = seen[1]
        original(self, name, param)

    global _META_BUILDS
    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    _META_BUILDS += 1
    try:
        yield
    finally:
        _META_BUILDS -= 1
        nn.Module.register_parameter = original  # type: ignore[method-assign]


_META_BUILDS = 0  # how many parameters_on_meta blocks are open


def parameters_go_to_meta() -> bool:
    """Whether a parameter registered now goes to the meta device (inside :func:`parameters_on_meta`): a model
    built in ``configure_model`` that would load whole weights from files leaves them to the shards instead."""
    return _META_BUILDS > 0


def has_unmaterialized_tensors(module: nn.Module) -> bool:
    """Whether ``module`` holds meta tensors or parameters replaced from meta whose storage was
    never filled (a setup that failed before sharding them): moving it to a device would raise."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta or is_uninitialized(t) for t in tensors)
