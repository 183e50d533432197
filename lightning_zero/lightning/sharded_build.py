"""Lightning glue for stage-3 models built in ``configure_model``: their parameters go to the meta
device as they are registered, are sharded unit by unit at the strategy's setup (for fit and for
test / validate / predict), and a ``ckpt_path`` is read after setup, into the shards. A mixin of
:class:`~lightning_zero.ZeroStrategy`; the mechanism is ``core/stage3/materialize.py`` and ``core/stage3/runtime.py``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_zero.core.stage3.materialize import (
    has_unmaterialized_tensors,
    parameters_on_meta,
    replace_meta_parameters,
)
from lightning_zero.core.zero.config import ZeroConfig


class ShardedBuildMixin:
    """``model_sharded_context``, the meta-model preparation and the teardown guard of
    :class:`~lightning_zero.ZeroStrategy` for models built in ``configure_model``."""

    zero_config: ZeroConfig
    model: Any
    root_device: torch.device
    lightning_module: Any
    _lightning_module: Any
    _built_sharded: bool  # this run's model was built in configure_model (stage 3), until teardown
    pipeline_config: Any  # PipelineConfig | None: a pipeline materialises only its stage's layers

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: parameters built in ``configure_model`` go to the meta device, and are
        materialised and sharded unit by unit at setup (Note [sharded construction] in
        core/stage3/materialize.py); buffers and metric states are created for real. With a pipeline (any
        ZeRO stage) parameters go to the meta device too, and each rank materialises only its own
        stage's layers at setup (Note [local construction] in pipeline/build.py)."""
        if not self.zero_config.stage.shards_parameters and self.pipeline_config is None:
            yield
            return
        with parameters_on_meta():
            yield

    def _prepare_meta_model(self) -> None:
        """Parameters built on the meta device: give them storage-less CPU/GPU stand-ins that
        stage 3 initialises (or fills from a checkpoint) one unit at a time."""
        if not self.zero_config.stage.shards_parameters:
            raise NotImplementedError(
                "The model has parameters on the meta device. lightning_zero initialises meta-built models only "
                "with ZeRO stage 3 (unit by unit, sharded). Use stage=3, or build the model with real tensors."
            )
        replace_meta_parameters(self.model, self.root_device)
        self._built_sharded = True

    @contextmanager
    def _unmoved_if_unmaterialized(self) -> Generator[None, None, None]:
        """Around Lightning's teardown, which calls ``module.cpu()``: a model that an error stopped
        before setup sharded it has meta tensors, and moving them would raise torch's meta-tensor
        error on top of the real one. Such a module is hidden from it (it has nothing to move)."""
        module = self.lightning_module
        if module is None or not has_unmaterialized_tensors(module):
            yield
            return
        self._lightning_module = None
        try:
            yield
        finally:
            self._lightning_module = module
