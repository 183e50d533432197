"""Lightning glue for stage-3 models built in ``configure_model``: their parameters go to the meta
device as they are registered, are sharded unit by unit at the strategy's setup (``parallel/parallelize.py``, for
fit and for test / validate / predict), and a ``ckpt_path`` is read after setup, into the shards. The
strategy's ``model_sharded_context`` and teardown call these; the mechanism is
``core/stage3/materialize.py`` and ``core/stage3/runtime.py``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

from torch import nn

from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.materialize import has_unmaterialized_tensors, parameters_on_meta


@contextmanager
def sharded_build_context(config: ZeroConfig, pipeline: PipelineConfig | None) -> Generator[None, None, None]:
    """Stage 3: parameters built in ``configure_model`` go to the meta device, and are materialised and
    sharded unit by unit at setup (Note [sharded construction] in core/stage3/materialize.py); buffers and
    metric states are created for real. With a pipeline (any ZeRO stage) parameters go to the meta device
    too, and each rank materialises only its own stage's layers at setup (Note [local construction] in
    pipeline/build.py)."""
    if not config.stage.shards_parameters and pipeline is None:
        yield
        return
    with parameters_on_meta():
        yield


def hidden_from_teardown(module: nn.Module | None) -> bool:
    """Whether Lightning's teardown, which calls ``module.cpu()``, must not see ``module``: a model that an
    error stopped before setup sharded it has meta tensors, and moving them would raise torch's meta-tensor
    error on top of the real one (such a module has nothing to move)."""
    return module is not None and has_unmaterialized_tensors(module)
