"""Materialising only this rank's layers of a module built on the meta device.

Note [local construction]
    Under a pipeline the strategy's ``model_sharded_context`` puts every parameter built in
    ``configure_model`` on the meta device (at any ZeRO stage: ``core/stage3/materialize.py``'s
    ``parameters_on_meta``), so no rank ever holds the whole model. At setup
    :func:`prepare_meta_module` swaps the meta parameters for storage-less stand-ins (ties kept), the
    split (``model.hold_stage``) turns the other stages' into placeholders, and
    :func:`materialize_local` gives this rank's parameters storage and initialises them: each module
    owning one of them runs ``param_init_fn`` (default ``reset_parameters``) under the RNG seeded
    from ``(base seed, module name)`` (``core/stage3/materialize.py``'s ``initialize_modules``). The values
    therefore do not depend on the stage layout: a parameter two stages share (a tied embedding) gets
    the same values on both, and they equal what the whole module built the same way gets
    (:func:`materialize_whole`, the tests' reference). A parameter initialised before keeps its
    values when a later module owning it too is initialised.

    A module built in ``__init__`` is already whole on every rank; the split then only frees the
    other stages' weights (docs/pipeline.md: build in ``configure_model`` for the memory saving).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.core.common.uninitialized import is_uninitialized, mark_initialized
from lightning_zero.core.stage3.materialize import (
    ParamInitFn,
    has_meta_parameters,
    initialize_modules,
    replace_meta_parameters,
)


def prepare_meta_module(module: nn.Module, device: torch.device) -> bool:
    """Replace the meta parameters of ``module`` by storage-less stand-ins; whether there were any."""
    if not has_meta_parameters(module):
        return False
    replace_meta_parameters(module, device)
    return True


@torch.no_grad()
def materialize_local(module: nn.Module, local: set[nn.Parameter], init_fn: ParamInitFn | None,
                      base_seed: int) -> int:
    """Give the stand-ins in ``local`` storage and initialise them (Note [local construction]); the
    others, already placeholders, stay so. Returns the number of parameters materialised."""
    for p in module.parameters():
        if p not in local and is_uninitialized(p):
            mark_initialized(p)  # a placeholder: owners restore it after running their initialiser
    owners = [(name, m) for name, m in module.named_modules()
              if any(p in local and is_uninitialized(p) for p in m.parameters(recurse=False))]
    count = sum(1 for p in local if is_uninitialized(p))
    initialize_modules(owners, init_fn, base_seed, bound=set())
    return count


def materialize_whole(module: nn.Module, init_fn: ParamInitFn | None, base_seed: int) -> None:
    """The whole module, initialised as :func:`materialize_local` initialises each stage's part."""
    prepare_meta_module(module, torch.device("cpu"))
    materialize_local(module, set(module.parameters()), init_fn, base_seed)
