"""Precision plugins of :class:`~lightning_zero.ZeroStrategy`: fp32, DeepSpeed's fp16 and bf16, pure bf16.

Modes (Lightning's names; ``docs/precision.md`` has the table and the accuracy notes):

* ``"32-true"``: everything fp32; the master is the parameter buffer itself.
* ``"16-mixed"`` / ``"bf16-mixed"``: the module's parameters and gradients are 16-bit (the module
  is cast in :meth:`ZeroPrecision.convert_module`, float inputs in :meth:`convert_input`), the
  optimizer steps fp32 master shards that are cast back into the parameters. fp16 adds DeepSpeed's
  dynamic loss scaler; an overflowing step is skipped on every rank.
* ``"bf16-true"``: bf16 parameters, gradients and optimizer state; no master copy.

Note [loading a converted module]
    In the mixed modes the plugin keeps each parameter's pre-cast weight and gives it back at
    ``restore_module`` (teardown). Whatever writes weights into the module after
    ``convert_module`` (stage 3 reads ``ckpt_path`` after setup) would write only the 16-bit copy,
    and teardown would then put the stale pre-cast weight back: the module would be evaluated with
    the loaded weights and left with the initial ones. So every load into a converted module
    without an engine runs inside :meth:`ZeroPrecision.whole_precision`: it loads into the module in
    its own dtype and converts again from there. With an engine the masters take the loaded values
    (``core/zero/loading.py``), and the pre-cast weights still kept (parameters without a master: frozen
    ones) are replaced by the loaded values (:meth:`ZeroPrecision.refresh_originals`).

Gradient clipping has to see every shard, so the plugin hands clipping to the ZeRO engine (global
norm across ranks, on unscaled fp32 master gradients in the mixed modes).

Note [16-bit step order]
    ``optimizer_step`` of the mixed modes runs: closure (forward, scaled backward, reduction) ->
    ``engine.prepare_step`` (fp32 master gradients, unscaled, global norm, overflow agreed across
    ranks) -> loss-scaler update -> ``on_before_optimizer_step`` hooks and clipping -> the
    optimizer's step, unless the step overflowed. Manual optimization that clips before
    ``opt.step()`` triggers ``prepare_step`` from the clip, so clipping still sees unscaled values.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.precision.loss_scaler import LossScaler
from lightning_zero.core.settings.precision import DtypePolicy, LossScalerConfig, PrecisionConfig
from lightning_zero.core.stage3.sharded_unit import is_released
from lightning_zero.core.zero.engine import ZeroEngine


class ZeroPrecision(Precision):
    """Precision of :class:`~lightning_zero.ZeroStrategy` (see the module docstring for the modes): the Lightning
    plugin of the settings tree's precision node, :class:`~lightning_zero.core.settings.precision.PrecisionConfig`
    (``settings``), which checks the arguments (:meth:`of` builds the plugin from a node).

    Args:
        precision: ``"32-true"``, ``"16-mixed"`` (fp16 with loss scaling), ``"bf16-mixed"`` or
            ``"bf16-true"``.
        loss_scaler: fp16's loss-scaler policy (DeepSpeed's keys); default: dynamic, starting at
            2**16, window 1000, hysteresis 2. Only for ``"16-mixed"``.
        reduce_dtype: dtype gradients are reduced in (default: the compute dtype; ``float32``
            reduces more precisely at twice the traffic).
        grad_accum_dtype: dtype gradients are accumulated in across micro-steps (DeepSpeed's
            ``grad_accum_dtype``; default: the reduce dtype). ``float32`` keeps small gradients
            of long accumulations, at 2 more bytes per gradient element.
    """

    def __init__(
        self,
        precision: str = "32-true",
        *,
        loss_scaler: LossScalerConfig | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        grad_accum_dtype: torch.dtype | str | None = None,
    ) -> None:
        self.settings = PrecisionConfig(precision, loss_scaler, reduce_dtype, grad_accum_dtype)  # checked there
        self.precision: str = str(self.settings.mode)  # Lightning's name of the mode
        self.compute_dtype: torch.dtype = self.settings.compute_dtype
        self.reduce_dtype = self.settings.reduce_dtype
        self.grad_accum_dtype = self.settings.grad_accum_dtype
        self.scaler: LossScaler | None = (
            LossScaler(self.settings.loss_scaler or LossScalerConfig()) if self.settings.scaled else None
        )
        self.engine: ZeroEngine | None = None  # the fit's engine (bind_engine: the strategy, when fitting)
        self.last_step_skipped = False  # the last optimizer step overflowed and was skipped
        # weights as they were before convert_module, per parameter (mixed modes): the masters start
        # from them, and parameters the engine does not own get them back at restore_module
        self._originals: dict[nn.Parameter, Tensor] = {}
        self._module_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, settings: PrecisionConfig) -> ZeroPrecision:
        """The plugin of a precision node."""
        return cls(settings.mode, loss_scaler=settings.loss_scaler, reduce_dtype=settings.reduce_dtype,
                   grad_accum_dtype=settings.grad_accum_dtype)

    def bind_engine(self, engine: ZeroEngine | None) -> None:
        """The engine this plugin steps, clips and unscales through (the strategy's, while fitting; ``None``
        after)."""
        self.engine = engine

    # ------------------------------------------------------------------ dtypes
    @property
    def mixed(self) -> bool:
        """16-bit parameters with an fp32 master."""
        return self.precision in ("16-mixed", "bf16-mixed")

    def dtype_policy(self, module: nn.Module | None = None) -> DtypePolicy:
        """The engine's dtypes for this mode (``"32-true"`` keeps the dtype ``module`` has)."""
        param = self.compute_dtype
        if self.precision == "32-true" and module is not None:
            param = next((p.dtype for p in module.parameters() if p.is_floating_point()), param)
        master = torch.float32 if self.mixed else param
        return DtypePolicy(param_dtype=param, reduce_dtype=self.reduce_dtype, master_dtype=master,
                           accum_dtype=self.grad_accum_dtype)

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (``None`` without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed (fp16)."""
        return self.scaler.overflows if self.scaler is not None else 0

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "32-true":
            return module
        if self.mixed:
            self._originals = {p: p.data for p in module.parameters()
                               if p.is_floating_point() and p.dtype != self.compute_dtype}
            self._module_dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        return module.to(dtype=self.compute_dtype)

    def master_init(self) -> dict[nn.Parameter, Tensor]:
        """The pre-cast weights the engine's masters start from (empty outside the mixed modes)."""
        return dict(self._originals)

    def replace_originals(self, remap: Callable[[dict[nn.Parameter, Tensor]], dict[nn.Parameter, Tensor]]) -> None:
        """The pre-cast weights after a rewrite replaced parameters (tensor parallel's slices): ``remap`` gives
        the new mapping from the current one."""
        self._originals = remap(dict(self._originals))

    def release_originals(self, params: set[nn.Parameter]) -> None:
        """Forget the pre-cast weights of ``params`` (their master holds them now)."""
        self._originals = {p: t for p, t in self._originals.items() if p not in params}

    def restore_module(self, module: nn.Module) -> None:
        """Mixed modes, after a fit / validate / test: give the module its dtype back. Trainable
        parameters already hold their fp32 master values (``ZeroEngine.detach``); the others get
        their pre-cast weights back, unless stage 3 left them released (the whole module then is);
        buffers are cast."""
        if not self.mixed or self._module_dtype is None:
            return
        for p in module.parameters():
            original = self._originals.get(p)
            if original is not None and not is_released(p):  # a released stage-3 parameter stays released
                p.data = original
        module.to(dtype=self._module_dtype)
        self._originals, self._module_dtype = {}, None

    @contextmanager
    def whole_precision(self, module: nn.Module) -> Generator[None, None, None]:
        """Mixed modes, a converted module without an engine (evaluation): inside, the module has its
        own dtype and pre-cast weights back, so that weights loaded into it (a ``ckpt_path`` read
        after setup, ``load_full_state_dict``) keep their full precision; on exit it is converted
        again, from the loaded values, and each tensor goes back to its device (Note [loading a
        converted module])."""
        if not self.mixed or self._module_dtype is None:
            yield
            return
        devices = {name: t.device for name, t in (*module.named_parameters(), *module.named_buffers())}
        self.restore_module(module)
        try:
            yield
        finally:
            self.convert_module(module)
            with torch.no_grad():
                for name, t in (*module.named_parameters(), *module.named_buffers()):
                    if name in devices and t.device != devices[name]:
                        t.data = t.data.to(devices[name])

    def refresh_originals(self, module: nn.Module, state: Mapping[str, Tensor], prefix: str = "") -> None:
        """Mixed modes, after weights were loaded into an engine: the parameters it keeps no master for
        (frozen ones) take the loaded values as the pre-cast weights ``restore_module`` gives back
        (Note [loading a converted module])."""
        if not self._originals:
            return
        for name, p in module.named_parameters(remove_duplicate=False):
            original = self._originals.get(p)
            if original is not None and prefix + name in state:
                value = state[prefix + name]
                self._originals[p] = value.detach().to(device=original.device, dtype=original.dtype).clone()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        # bf16-true builds the module in bf16 right away; the mixed modes build it in fp32 so that
        # the masters start from exact weights
        return _default_dtype(self.compute_dtype) if self.precision == "bf16-true" else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    # ------------------------------------------------------------------ step
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = tensor.float() * self.scaler.scale  # fp32 product: the scale may exceed fp16's range
        return super().pre_backward(tensor, module)

    def _custom_step(self) -> bool:
        """Whether the optimizer's gradients need :meth:`ZeroEngine.prepare_step` (cast or unscale)."""
        e = self.engine
        return e is not None and (self.scaler is not None or not e.master_grad_is_view)

    def _prepare(self) -> bool:
        assert self.engine is not None
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return self.engine.prepare_step(scale, check_overflow=self.scaler is not None)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule | nn.Module, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if not self._custom_step():
            self.last_step_skipped = False
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(f"precision={self.precision!r} steps an fp32 master after one closure call; LBFGS "
                             "re-evaluates the closure. Use precision='32-true' with stage 0 for LBFGS.")
        assert self.engine is not None
        closure_result = closure()  # Note [16-bit step order]
        if closure_result is None and getattr(model, "automatic_optimization", False):
            self.engine.skip_step()  # training_step returned None: no backward, nothing to step
            return closure_result
        skipped = self._prepare()
        if self.scaler is not None:
            self.scaler.update(skipped)  # may raise MinLossScaleError, on every rank alike
        self.last_step_skipped = skipped
        if isinstance(model, pl.LightningModule):
            self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        return optimizer.step(**kwargs)

    @override
    def clip_gradients(
        self, optimizer: Optimizer, clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """With an engine, the engine clips every shard (mixed modes: unscaled fp32 master gradients,
        prepared here when manual optimization clips before ``opt.step()``)."""
        if self.engine is None or clip_val <= 0:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if self._custom_step():
            self._prepare()
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.engine.clip_grad_value_(float(clip_val))
        else:
            self.engine.clip_grad_norm_(float(clip_val))
        return None

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def to_zero_precision(plugin: Precision | None) -> ZeroPrecision:
    """Convert a stock Lightning precision plugin (as the Trainer selects it) to ours.

    Lightning has already rewritten ``Trainer(precision="16-mixed")`` to ``"bf16-mixed"`` on CPU
    when this runs; pass ``ZeroStrategy(precision="16-mixed")`` to keep fp16 there.
    """
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin or ZeroPrecision()
    name = getattr(plugin, "precision", None)
    if name is None or type(plugin) not in _stock_plugins():
        raise ValueError(
            f"ZeroStrategy cannot use the precision plugin {type(plugin).__name__}. Pass `precision=` to the Trainer "
            "or a `lightning_zero.ZeroPrecision` instance."
        )
    return ZeroPrecision(name)


def _stock_plugins() -> tuple[type, ...]:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    return (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
