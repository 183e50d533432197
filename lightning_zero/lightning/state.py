"""What :class:`~lightning_zero.ZeroStrategy` reports of its state and how it saves it: the strategy's
state dicts and checkpoint files (sharded or consolidated), with the memory and step figures read
from the same engine. A mixin, so ``strategy.py`` stays the lifecycle glue; it reads the strategy's
``_engine``, ``_comm`` and precision plugin.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.format import (
    LazyOptimizerState,
    LazyStateDict,
    ShardedCheckpoint,
    is_sharded_checkpoint,
    materialize_optimizer_state,
    save_sharded,
)
from lightning_zero.checkpoint.format import remove as remove_sharded
from lightning_zero.checkpoint.owned import load_owned_optimizer_state, load_owned_state_dict, load_whole_module
from lightning_zero.checkpoint.plain import CheckpointError
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.stage3.loading import load_full_state_dict
from lightning_zero.core.stage3.materialize import has_meta_parameters
from lightning_zero.core.stage3.sharded_unit import is_released
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.memory import ModelStateBytes
from lightning_zero.core.zero.optimizer_state import full_optimizer_state, load_full_optimizer_state
from lightning_zero.lightning.own_bytes import own_bytes
from lightning_zero.lightning.state_files import open_state_dict


class ZeroStateMixin:
    """Checkpoint and state methods of :class:`~lightning_zero.ZeroStrategy` (see the module docstring)."""

    _engine: ZeroEngine | None
    _pipeline: Any  # lightning_zero.pipeline.lightning.StrategyPipeline | None
    _after_fit_refusal: tuple[str, bool] | None = None  # StrategyPipeline.teardown: why a save now is incomplete
    pipeline_config: Any

    # ------------------------------------------------------------------ state
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of ``params``, ``grads``, ``optimizer`` and ``comm_buffers``, counted from the
        tensors that exist (each storage once), not from a formula."""
        if self._engine is None:
            raise RuntimeError("model_state_bytes() is available while fitting, after the strategy's setup.")
        return self._engine.model_state_bytes()

    def load_full_state_dict(
        self, source: str | os.PathLike | Mapping[str, Tensor], prefix: str = "", strict: bool = True
    ) -> None:
        """Load whole (unsharded) weights, e.g. a Hugging Face ``.safetensors`` file, into the model.

        Under stage 3 each rank streams the tensors one unit at a time into its shards, so the
        whole model is never resident; call it after the strategy's setup (e.g. in
        ``on_fit_start`` / ``on_test_start``), on every rank. Without an engine (stages 0-2 outside
        fit) it is ``load_state_dict`` on the LightningModule.

        Args:
            source: a ``.safetensors`` or ``torch.save`` file (a Lightning checkpoint's
                ``state_dict`` is found), or a mapping of key -> tensor.
            prefix: the keys' prefix before the LightningModule's own parameter names.
            strict: refuse missing and unexpected keys.
        """
        if self._engine is not None:
            state = open_state_dict(source)
            load_full_state_dict(self._engine, state, prefix, strict)
            self.precision_plugin.refresh_originals(self.lightning_module, state, prefix)  # frozen parameters
            return
        state = open_state_dict(source)
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        with self.precision_plugin.whole_precision(self.lightning_module):  # Note [loading a converted module]
            self.lightning_module.load_state_dict(own, strict=strict)

    @property
    def gathered_peak_numel(self) -> int:
        """Stage 3: the most parameter elements ever gathered at once on this rank (a peak over the
        whole fit, excluding the persistent unit); 0 for other stages."""
        runtime = self._engine.runtime if self._engine is not None else self._last_runtime
        return runtime.peak_live_numel if runtime is not None else 0

    @property
    def gathered_bound_numel(self) -> int:
        """Stage 3: the bound on :attr:`gathered_peak_numel` implied by ``prefetch_bucket_size`` and
        ``max_live_parameters`` for this model's units; 0 for other stages."""
        runtime = self._engine.runtime if self._engine is not None else self._last_runtime
        return runtime.live_bound() if runtime is not None else 0

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (``None`` in the other modes)."""
        return self.precision_plugin.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed (checkpointed)."""
        return self.precision_plugin.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (overflow on some rank)."""
        return self.precision_plugin.last_step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled) of the last step that measured it: every step in the 16-bit mixed
        modes, else when clipping by norm."""
        return self._engine.last_grad_norm if self._engine is not None else None

    def step_stats(self) -> dict[str, float]:
        """``train/loss_scale``, ``train/skipped_steps``, ``train/grad_norm`` where known, named as
        :class:`~lightning_zero.ZeroStatsMonitor` logs them."""
        out: dict[str, float] = {}
        if self.loss_scale is not None:
            out["train/loss_scale"] = float(self.loss_scale)
            out["train/skipped_steps"] = float(self.skipped_steps)
        if self.last_grad_norm is not None:
            out["train/grad_norm"] = float(self.last_grad_norm)
        return out

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Whole tensors (stage 3 gathers them unit by unit; every rank calls this). With an fp32
        master the checkpoint holds fp32 weights (the masters, gathered), like the module before
        the cast, so a resumed run starts from exact masters."""
        engine, module = self._engine, self.lightning_module
        if engine is None or module is None:
            return super().lightning_module_state_dict()
        if self._writes_shards:
            return {}  # save_checkpoint writes every rank's shards instead (no gather)
        if self._pipeline is not None and self._pipeline.checkpoint is not None:  # unsplit names, all stages
            return self._pipeline.checkpoint.state_dict(engine, module)
        state = engine.full_state_dict()  # stage 3 gathers unit by unit (every rank takes part)
        if not engine.separate_master:
            return state
        masters = engine.full_master_params()
        owner = dict(module.named_parameters(remove_duplicate=False))
        for key, value in state.items():
            p = owner.get(key)
            if p is not None and p in masters:
                state[key] = masters[p]
            elif isinstance(value, Tensor) and value.is_floating_point():
                state[key] = value.to(engine.dtypes.master_dtype)
        return state

    @property
    def engine(self) -> ZeroEngine | None:
        """The ZeRO engine driving the current fit, or, for a stage-3 model built in
        ``configure_model``, the current test / validate / predict run (``None`` otherwise)."""
        return self._engine

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._writes_shards:
            return {}  # save_checkpoint writes every rank's shards instead (no gather)
        if self._pipeline is not None and self._pipeline.checkpoint is not None and self._engine is not None:
            state = self._pipeline.checkpoint.optimizer_state(self._engine)  # numbered as the unsplit optimizer's
            return state if self.is_global_zero else {}
        if self._engine is None or self._engine.sharded is None:
            return optimizer.state_dict()
        # world-size independent: the state of the original parameters, gathered from all shards
        state = full_optimizer_state(self._engine.sharded, self._engine.comm)
        return state if self.is_global_zero else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint.get("optimizer_states", [])
        if self._pipeline is not None and self._pipeline.checkpoint is not None and self._engine is not None:
            for state in states[:1]:  # this stage's entries only (a sharded checkpoint's read lazily)
                self._pipeline.checkpoint.load_optimizer_state(self._engine, dict(state))
            return None
        if self._engine is None or self._engine.sharded is None or self._engine.sharded.whole:
            if any(isinstance(s.get("state"), Mapping) and not isinstance(s.get("state"), dict) for s in states):
                checkpoint = {**checkpoint, "optimizer_states": [materialize_optimizer_state(s) for s in states]}
            return super().load_optimizer_state_dict(checkpoint)
        for state in states[:1]:  # one optimizer (checked at setup)
            if isinstance(state.get("state"), LazyOptimizerState):  # a sharded checkpoint: owned slices only
                load_owned_optimizer_state(self._engine, state)
            else:
                load_full_optimizer_state(self._engine.sharded, state)
        return None

    # ------------------------------------------------------------------ checkpoint files
    @property
    def _writes_shards(self) -> bool:
        """Whether save_checkpoint writes the sharded format from the engine's shards."""
        return self._sharded_format() and self._engine is not None and self.zero_config.stage.shards_optimizer

    def _sharded_format(self) -> bool:
        """Whether checkpoints are saved in the sharded format (``checkpoint_format``, ``"auto"``: stage >= 1)."""
        fmt = self.checkpoint_format
        return fmt == "sharded" or (fmt == "auto" and self.zero_config.stage.shards_optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Sharded format (docs/checkpoints.md): every rank writes its shards into a temporary
        directory; once all succeeded rank 0 publishes it atomically under ``filepath``."""
        refusal = self._after_fit_refusal if self._pipeline is None else None
        if refusal is not None and ("optimizer_states" in checkpoint or not refusal[1]):
            raise CheckpointError(
                f"trainer.save_checkpoint after fit would write an incomplete checkpoint: {refusal[0]}. Save during "
                "fit instead (`ModelCheckpoint`, or `trainer.save_checkpoint` in a callback), where every stage "
                "contributes its part."
            )
        if not self._sharded_format():  # each tensor its own bytes, not the flat buffer it views
            return super().save_checkpoint(own_bytes(checkpoint), filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("The sharded checkpoint format takes no `storage_options`.")
        module = self.lightning_module
        if self._engine is None and module is not None and any(is_released(p) for p in module.parameters()):
            raise CheckpointError(
                "The model's stage-3 parameters were left released at the end of fit (it did not fit to be gathered, "
                "or `gather_on_teardown=False`), so there is nothing to save now. Save during fit: "
                "`trainer.save_checkpoint` in a callback or `ModelCheckpoint`."
            )
        comm, layout, merge = self._comm, None, None
        if self._pipeline is not None and self._pipeline.checkpoint is not None and self._writes_shards:
            layout, merge = self._pipeline.checkpoint.sharded_parts(self._engine, module)  # each stage its shards
        if self.pipeline_config is not None:  # every stage writes into one directory: the world's group agrees
            comm = DataParallelComm()
        save_sharded(
            filepath, checkpoint, self._engine if self._writes_shards else None, self.global_rank,
            self.world_size, broadcast=comm.broadcast_text if comm is not None else (lambda name: name),
            failed_ranks=comm.ranks_with if comm is not None else (lambda flag: [0] if flag else []),
            layout=layout, merge=merge,
        )
        return None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and is_sharded_checkpoint(filepath):
            remove_sharded(filepath)
            return
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory is read lazily (JSON + safetensors, never unpickled);
        a file goes to Lightning's CheckpointIO."""
        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        ckpt = ShardedCheckpoint(checkpoint_path)
        self._pending_rng = ckpt.rng_state(self.global_rank) if ckpt.world_size == self.world_size else None
        return ckpt.to_lightning()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Stage 3 reads a ``ckpt_path`` after setup, each rank only the slices of its shards
        (Note [owned slices] in checkpoint/owned.py), so the whole model never exists anywhere. A
        pipelined run reads before setup (its checkpoints hold the unsplit module, docs/pipeline.md),
        unless it was built on the meta device: then each stage reads its own layers after setup."""
        if self.pipeline_config is not None:
            return self.lightning_module is not None and has_meta_parameters(self.lightning_module)
        return self.zero_config.stage.shards_parameters

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Before setup the module is whole (and in its original dtype): ``load_state_dict``. After
        setup (stage 3 with a model built in ``configure_model``: ``restore_checkpoint_after_setup``)
        the values are streamed into the engine's shards one unit at a time, also for evaluation."""
        state = checkpoint["state_dict"]
        if self._pipeline is not None:  # after setup, built on meta: this stage's layers, by their unsplit names
            self._pipeline.load_local_state_dict(self.lightning_module, self._engine, state, strict)
            return None
        if self._engine is not None:  # after setup: into the shards
            if isinstance(state, LazyStateDict):
                load_owned_state_dict(self._engine, state, strict)  # this rank's slices only
                self.precision_plugin.refresh_originals(self.lightning_module, state)  # frozen parameters
            else:
                self.load_full_state_dict(state, strict=strict)  # masters take the loaded fp32 values
            return None
        if has_meta_parameters(self.lightning_module):  # load_state_dict would silently copy into nothing
            raise RuntimeError(
                "The model's parameters are on the meta device (built in `configure_model` under stage 3); they "
                "exist only after the strategy's setup. Load weights after setup: Lightning does so for `ckpt_path`; "
                "by hand, call `trainer.strategy.load_full_state_dict(...)` in `on_fit_start` / `on_test_start`."
            )
        # the module is whole; after setup (stage 3 evaluation) it may be converted to 16 bits: it takes the
        # values in its own dtype (Note [loading a converted module] in precision.py)
        with self.precision_plugin.whole_precision(self.lightning_module):
            if not isinstance(state, LazyStateDict):
                return super().load_model_state_dict(checkpoint, strict=strict)
            load_whole_module(self.lightning_module, state, strict)  # one tensor at a time
        return None
