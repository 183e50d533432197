"""What :class:`~lightning_zero.ZeroStrategy` reports of its state and how it saves it (its part
``StrategyCheckpointing``): the strategy's state dicts and checkpoint files (sharded or consolidated),
with the memory and step figures read from the same engine. ``strategy.py`` stays the lifecycle glue;
its Lightning hooks delegate here, passing Lightning's own implementation where it still runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch import Tensor
from torch.optim import Optimizer

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
from lightning_zero.checkpoint.tensor_file import own_bytes
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.memory import ModelStateBytes
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.stage3.materialize import has_meta_parameters
from lightning_zero.core.stage3.sharded_unit import is_released
from lightning_zero.core.zero.loading import load_full_state_dict
from lightning_zero.core.zero.optimizer_state import full_optimizer_state, load_full_optimizer_state
from lightning_zero.lightning.precision import ZeroPrecision, to_zero_precision
from lightning_zero.lightning.run import ParallelRun
from lightning_zero.lightning.state_files import open_state_dict
from lightning_zero.lightning.steps import StepDispatch
from lightning_zero.moe.checkpoint import ExpertParallelCheckpoint
from lightning_zero.parallel.tensor import refuse_pipeline_checkpoint
from lightning_zero.tensor_parallel.checkpoint import TensorParallelCheckpoint
from lightning_zero.tensor_parallel.pipeline_checkpoint import pipelined_sharded_parts

Fallback = Callable[..., Any]  # Lightning's own implementation of the hook (the strategy's super())

# Note [state dicts for the strategy's own save]
#   ``Trainer.save_checkpoint`` (and ``ModelCheckpoint`` through it) builds the checkpoint dict in Lightning's
#   ``_CheckpointConnector.dump_checkpoint``, which calls the strategy's ``lightning_module_state_dict`` and
#   ``optimizer_state``, then hands the dict to the strategy's ``save_checkpoint``. In the sharded format that save
#   writes every rank's shards and ignores both entries, so gathering them there would only put the whole model on
#   every rank for nothing: for that caller alone the hooks return ``{}`` (docs/checkpoints.md: the hooks of a
#   sharded save see them empty). Any other caller (a callback exporting weights at ``on_train_end``, a user after
#   fit) gets the whole state, in every format. Lightning passes no flag saying who calls, so the hook looks at
#   its caller's code: ``dump_checkpoint``'s own functions. Were they renamed, every caller would get the whole
#   state (correct, only costlier), and tests/distributed/test_state_after_call.py, which checks both, would fail.
_DUMP_CODES = frozenset(
    getattr(_CheckpointConnector, name).__code__ for name in ("dump_checkpoint", "_get_lightning_module_state_dict")
    if hasattr(_CheckpointConnector, name)
)


def called_by_checkpoint_dump(depth: int = 1) -> bool:
    """Whether the strategy hook running ``depth`` frames above this call was called by Lightning's checkpoint dump
    (Note [state dicts for the strategy's own save]): 1, the hook called this function itself."""
    caller = sys._getframe(depth + 1)
    return caller.f_code in _DUMP_CODES


def _plugin(lightning: ParallelStrategy) -> ZeroPrecision:
    """The strategy's precision plugin as the ``ZeroPrecision`` it is (a stock one converted)."""
    return to_zero_precision(lightning.precision_plugin)


class StrategyCheckpointing:
    """Checkpoint and state methods of :class:`~lightning_zero.ZeroStrategy` (see the module docstring); the hooks
    that depend on the settings take the strategy's settings tree as they run (it may be replaced between saves).

    Args:
        lightning: the strategy, for what Lightning keeps on it (the module, the precision plugin, the ranks).
        run: its engine, stage and groups.
        steps: its step part, which continues a loaded checkpoint's random streams.
    """

    def __init__(self, lightning: ParallelStrategy, run: ParallelRun, steps: StepDispatch) -> None:
        self._lightning = lightning
        self._run = run
        self._steps = steps

    # ------------------------------------------------------------------ state
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of ``params``, ``grads``, ``optimizer`` and ``comm_buffers``, counted from the
        tensors that exist (each storage once), not from a formula."""
        if self._run.engine is None:
            raise RuntimeError("model_state_bytes() is available while fitting, after the strategy's setup.")
        return self._run.engine.model_state_bytes()

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
        host, module = self._lightning, self._lightning.lightning_module
        assert module is not None
        if self._run.engine is not None:
            state = open_state_dict(source)
            if self._run.tensor is not None:  # whole tensors cut to this rank's TP slices
                state = TensorParallelCheckpoint.split_state_dict(state, module, prefix)
            if self._expert_parallel() is not None:  # and to this rank's experts
                state = ExpertParallelCheckpoint.split_state_dict(state, module, prefix)
            load_full_state_dict(self._run.engine, state, prefix, strict)
            _plugin(host).refresh_originals(module, state, prefix)  # frozen parameters
            return
        state = open_state_dict(source)
        if self._run.tensor is not None:  # a split module (a finished fit's) takes its slices
            state = TensorParallelCheckpoint.split_state_dict(state, module, prefix)
        if self._expert_parallel() is not None:
            state = ExpertParallelCheckpoint.split_state_dict(state, module, prefix)
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        with _plugin(host).whole_precision(module):  # Note [loading a converted module]
            module.load_state_dict(own, strict=strict)

    @property
    def gathered_peak_numel(self) -> int:
        """Stage 3: the most parameter elements ever gathered at once on this rank (a peak over the
        whole fit, excluding the persistent unit); 0 for other stages."""
        runtime = self._run.engine.runtime if self._run.engine is not None else self._run.last_runtime
        return runtime.peak_live_numel if runtime is not None else 0

    @property
    def gathered_bound_numel(self) -> int:
        """Stage 3: the bound on :attr:`gathered_peak_numel` implied by ``prefetch_bucket_size`` and
        ``max_live_parameters`` for this model's units; 0 for other stages."""
        runtime = self._run.engine.runtime if self._run.engine is not None else self._run.last_runtime
        return runtime.live_bound() if runtime is not None else 0

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled) of the last step that measured it: every step in the 16-bit mixed
        modes, else when clipping by norm."""
        return self._run.engine.last_grad_norm if self._run.engine is not None else None

    def step_stats(self) -> dict[str, float]:
        """``train/loss_scale``, ``train/skipped_steps``, ``train/grad_norm`` where known, named as
        :class:`~lightning_zero.ZeroStatsMonitor` logs them."""
        out: dict[str, float] = {}
        plugin = _plugin(self._lightning)
        if plugin.loss_scale is not None:
            out["train/loss_scale"] = float(plugin.loss_scale)
            out["train/skipped_steps"] = float(plugin.skipped_steps)
        if self.last_grad_norm is not None:
            out["train/grad_norm"] = float(self.last_grad_norm)
        return out

    def _tensor_parallel(self) -> TensorParallelCheckpoint | None:
        """The TP side when this strategy split the module (its states are unsplit before they are saved)."""
        tp, module = self._run.tensor, self._lightning.lightning_module
        if tp is None or module is None or not tp.splits(module):
            return None
        return TensorParallelCheckpoint(tp.tp, tp.dims, tp.mesh.rank)

    def _expert_parallel(self) -> ExpertParallelCheckpoint | None:
        """The expert-parallel side when this strategy split the module's experts (they are unsplit when saved)."""
        ep, module = self._run.expert, self._lightning.lightning_module
        return ExpertParallelCheckpoint(ep.ep) if ep is not None and module is not None and ep.splits(module) else None

    def _unsplit(self, state: dict[str, Any], module: Any) -> dict[str, Any]:
        """A state dict of this rank's module with its TP slices and experts whole (collectives over those groups)."""
        tp, ep = self._tensor_parallel(), self._expert_parallel()
        state = tp.unsplit_state_dict(state, module) if tp is not None else state
        return ep.unsplit_state_dict(state, module) if ep is not None else state

    def _unsplit_optimizer(self, state: dict[str, Any], params: list[Any]) -> dict[str, Any]:
        tp, ep = self._tensor_parallel(), self._expert_parallel()
        state = tp.unsplit_optimizer_state(state, params) if tp is not None else state
        return ep.unsplit_optimizer_state(state, params) if ep is not None else state

    def lightning_module_state_dict(self, settings: Settings, fallback: Fallback, for_save: bool) -> dict[str, Any]:
        """Whole tensors (stage 3 gathers them unit by unit; tensor-parallel slices are gathered over the TP
        group and unsplit, experts over the expert-parallel group; every rank calls this). With an fp32 master the
        checkpoint holds fp32 weights (the masters, gathered), like the module before the cast, so a resumed run
        starts from exact masters. ``for_save``: called by Lightning's checkpoint dump, which a sharded save ignores
        (``{}`` then: Note [state dicts for the strategy's own save])."""
        engine, module = self._run.engine, self._lightning.lightning_module
        if engine is None or module is None:
            state = fallback()
            return self._unsplit(state, module) if module is not None else state
        if for_save and self._writes_shards(settings):
            return {}  # save_checkpoint writes every rank's shards instead (no gather)
        pipeline = self._run.pipeline
        if pipeline is not None and pipeline.checkpoint is not None:  # unsplit names, all stages
            return pipeline.checkpoint.state_dict(engine, module)
        state = engine.full_state_dict()  # stage 3 gathers unit by unit (every rank takes part)
        if engine.separate_master:
            masters = engine.full_master_params()
            owner = dict(module.named_parameters(remove_duplicate=False))
            for key, value in state.items():
                p = owner.get(key)
                if p is not None and p in masters:
                    state[key] = masters[p]
                elif isinstance(value, Tensor) and value.is_floating_point():
                    state[key] = value.to(engine.dtypes.master_dtype)
        return self._unsplit(state, module)

    def optimizer_state(self, settings: Settings, optimizer: Optimizer, for_save: bool) -> dict[str, Any]:
        """The whole optimizer state, numbered as the unsplit optimizer's, on rank 0 (``{}`` elsewhere; a
        collective). ``for_save``: as for :meth:`lightning_module_state_dict`."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if for_save and self._writes_shards(settings):
            return {}  # save_checkpoint writes every rank's shards instead (no gather)
        engine, pipeline = self._run.engine, self._run.pipeline
        if pipeline is not None and pipeline.checkpoint is not None and engine is not None:
            state = pipeline.checkpoint.optimizer_state(engine)  # numbered as the unsplit optimizer's
            return state if self._lightning.is_global_zero else {}
        if engine is None or engine.sharded is None:
            state = optimizer.state_dict()
            return self._unsplit_optimizer(state, [p for g in optimizer.param_groups for p in g["params"]])
        # world-size independent: the state of the original parameters, gathered from all shards, and TP- and
        # EP-size independent: split tensors whole
        state = full_optimizer_state(engine.sharded, engine.comm)
        state = self._unsplit_optimizer(state, [p for ps in engine.sharded.original_params for p in ps])
        return state if self._lightning.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any], fallback: Fallback) -> None:
        states = checkpoint.get("optimizer_states", [])
        engine, pipeline = self._run.engine, self._run.pipeline
        if pipeline is not None and pipeline.checkpoint is not None and engine is not None:
            tp = self._tensor_parallel()  # with TP, whole entries cut to this rank's slices
            for state in states[:1]:  # this stage's entries only (a sharded checkpoint's read lazily)
                pipeline.checkpoint.load_optimizer_state(engine, dict(state),
                                                         tp.split_optimizer_state if tp is not None else None)
            return None
        tp, ep = self._tensor_parallel(), self._expert_parallel()
        if engine is None or engine.sharded is None or engine.sharded.whole:
            if any(isinstance(s.get("state"), Mapping) and not isinstance(s.get("state"), dict) for s in states):
                states = [materialize_optimizer_state(s) for s in states]
            if engine is not None:  # whole tensors cut to this rank's slices and experts
                params = [p for g in engine.optimizer.param_groups for p in g["params"]]
                states = [tp.split_optimizer_state(s, params) if tp is not None else s for s in states]
                states = [ep.split_optimizer_state(s, params) if ep is not None else s for s in states]
            return fallback({**checkpoint, "optimizer_states": states})
        for state in states[:1]:  # one optimizer (checked at setup)
            if isinstance(state.get("state"), LazyOptimizerState) and ep is None:  # a sharded checkpoint: owned slices
                load_owned_optimizer_state(engine, state)  # a TP slice reads its part (checkpoint/slices.py)
            else:
                if isinstance(state.get("state"), LazyOptimizerState):  # whole, then cut to this rank's experts
                    state = materialize_optimizer_state(state)
                originals = [p for ps in engine.sharded.original_params for p in ps]
                if tp is not None:
                    state = tp.split_optimizer_state(state, originals)
                if ep is not None:
                    state = ep.split_optimizer_state(state, originals)
                load_full_optimizer_state(engine.sharded, state)
        return None

    # ------------------------------------------------------------------ checkpoint files
    def _writes_shards(self, settings: Settings) -> bool:
        """Whether save_checkpoint writes the sharded format from the engine's shards."""
        return self._sharded_format(settings) and self._run.engine is not None and settings.zero.stage.shards_optimizer

    def _sharded_format(self, settings: Settings) -> bool:
        """Whether checkpoints are saved in the sharded format (``settings.sharded_checkpoints``); with the experts
        split (their size the strategy's or the MoE layers'), the consolidated format, whose files hold the unsplit
        experts and resume at any expert-parallel size (``"sharded"`` is refused by the settings tree's rules)."""
        return settings.sharded_checkpoints and self._expert_parallel() is None

    def save_checkpoint(self, settings: Settings, checkpoint: dict[str, Any], filepath: Any, storage_options: Any,
                        fallback: Fallback) -> None:
        """Sharded format (docs/checkpoints.md): every rank writes its shards into a temporary
        directory; once all succeeded rank 0 publishes it atomically under ``filepath``."""
        writes_shards = self._writes_shards(settings)
        refuse_pipeline_checkpoint(settings.parallel.tensor, settings.parallel.pipeline is not None, writes_shards)
        refusal = self._run.after_fit_refusal if self._run.pipeline is None else None
        if refusal is not None and ("optimizer_states" in checkpoint or not refusal[1]):
            raise CheckpointError(
                f"trainer.save_checkpoint after fit would write an incomplete checkpoint: {refusal[0]}. Save during "
                "fit instead (`ModelCheckpoint`, or `trainer.save_checkpoint` in a callback), where every stage "
                "contributes its part."
            )
        if not self._sharded_format(settings):  # each tensor its own bytes, not the flat buffer it views
            return fallback(own_bytes(checkpoint), filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("The sharded checkpoint format takes no `storage_options`.")
        module = self._lightning.lightning_module
        if self._run.engine is None and module is not None and any(is_released(p) for p in module.parameters()):
            raise CheckpointError(
                "The model's stage-3 parameters were left released at the end of fit (it did not fit to be gathered, "
                "or `gather_on_teardown=False`), so there is nothing to save now. Save during fit: "
                "`trainer.save_checkpoint` in a callback or `ModelCheckpoint`."
            )
        comm, layout, merge, pipeline = self._run.comm, None, None, self._run.pipeline
        tp, staged = self._tensor_parallel(), pipeline.checkpoint if pipeline is not None else None
        if staged is not None and tp is not None and writes_shards:  # Note [pipeline x TP shards]
            layout, merge = pipelined_sharded_parts(staged, tp, self._run.engine, module)
        elif staged is not None and writes_shards:
            layout, merge = staged.sharded_parts(self._run.engine, module)  # each stage its shards
        elif tp is not None and writes_shards:  # each TP rank its slices (Note [TP slices in checkpoints])
            layout, merge = tp.sharded_parts(self._run.engine, module)
        if settings.parallel.pipeline is not None or self._run.tensor is not None:  # every stage / TP rank writes
            comm = DataParallelComm()  # into one directory: the world's group agrees
        save_sharded(
            filepath, checkpoint, self._run.engine if writes_shards else None, self._lightning.global_rank,
            self._lightning.world_size, broadcast=comm.broadcast_text if comm is not None else (lambda name: name),
            failed_ranks=comm.ranks_with if comm is not None else (lambda flag: [0] if flag else []),
            layout=layout, merge=merge,
        )
        return None

    def remove_checkpoint(self, filepath: Any, fallback: Fallback) -> None:
        if self._lightning.is_global_zero and is_sharded_checkpoint(filepath):
            remove_sharded(filepath)
            return
        fallback(filepath)

    def load_checkpoint(self, settings: Settings, checkpoint_path: Any, weights_only: bool | None,
                        fallback: Fallback) -> dict[str, Any]:
        """A sharded checkpoint directory is read lazily (JSON + safetensors, never unpickled);
        a file goes to Lightning's CheckpointIO."""
        if not is_sharded_checkpoint(checkpoint_path):
            return fallback(checkpoint_path, weights_only=weights_only)
        ckpt = ShardedCheckpoint(checkpoint_path)
        written_tp = ckpt.tensor_parallel.size if ckpt.tensor_parallel is not None else 1
        here_tp = settings.parallel.tensor.size  # known before setup (the mesh is built in setup)
        # each rank's RNG where the layout is the same (a TP group's ranks share the replicated regions' stream)
        same_world = ckpt.world_size == self._lightning.world_size and written_tp == here_tp
        self._steps.resume_rng(ckpt.rng_state(self._lightning.global_rank) if same_world else None)
        return ckpt.to_lightning()

    def restore_checkpoint_after_setup(self, settings: Settings) -> bool:
        """Stage 3 reads a ``ckpt_path`` after setup, each rank only the slices of its shards
        (Note [owned slices] in checkpoint/owned.py), so the whole model never exists anywhere. A
        pipelined run reads before setup (its checkpoints hold the unsplit module, docs/pipeline.md),
        unless it was built on the meta device: then each stage reads its own layers after setup."""
        module = self._lightning.lightning_module
        if settings.parallel.pipeline is not None:
            return module is not None and has_meta_parameters(module)
        return settings.zero.stage.shards_parameters

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool, fallback: Fallback) -> None:
        """Before setup the module is whole (and in its original dtype): ``load_state_dict``. After
        setup (stage 3 with a model built in ``configure_model``: ``restore_checkpoint_after_setup``)
        the values are streamed into the engine's shards one unit at a time, also for evaluation."""
        state, module = checkpoint["state_dict"], self._lightning.lightning_module
        assert module is not None
        if self._run.pipeline is not None:  # after setup, built on meta: this stage's layers, by their unsplit names
            self._run.pipeline.load_local_state_dict(module, self._run.engine, state, strict)
            return None
        if self._run.engine is not None:  # after setup: into the shards
            if isinstance(state, LazyStateDict) and self._expert_parallel() is None:
                load_owned_state_dict(self._run.engine, state, strict)  # this rank's slices only
                _plugin(self._lightning).refresh_originals(module, state)  # frozen parameters
            else:
                self.load_full_state_dict(state, strict=strict)  # masters take the loaded fp32 values
            return None
        if has_meta_parameters(self._lightning.lightning_module):  # load_state_dict would silently copy into nothing
            raise RuntimeError(
                "The model's parameters are on the meta device (built in `configure_model` under stage 3); they "
                "exist only after the strategy's setup. Load weights after setup: Lightning does so for `ckpt_path`; "
                "by hand, call `trainer.strategy.load_full_state_dict(...)` in `on_fit_start` / `on_test_start`."
            )
        # the module is whole; after setup (stage 3 evaluation) it may be converted to 16 bits: it takes the
        # values in its own dtype (Note [loading a converted module] in precision.py)
        with _plugin(self._lightning).whole_precision(self._lightning.lightning_module):
            if not isinstance(state, LazyStateDict):
                return fallback(checkpoint, strict=strict)
            load_whole_module(self._lightning.lightning_module, state, strict)  # one tensor at a time
        return None
