"""DeepSpeed's ``optimizer`` section as a ``torch.optim`` optimizer.

``{"type": "Adam", "params": {...}}`` is read as DeepSpeed reads it:

* ``Adam`` means **AdamW** (decoupled weight decay) unless ``"adam_w_mode": false``, which gives
  ``torch.optim.Adam`` (L2 penalty). ``AdamW`` is always AdamW. Without ``"torch_adam": true``,
  DeepSpeed runs its fused Adam, whose ``weight_decay`` defaults to 0 (torch's AdamW: 0.01): that
  default is kept, and on CUDA the fused torch kernel (``fused=True``) is used. With
  ``"torch_adam": true`` the plain torch optimizer with torch's defaults is built, as DeepSpeed does.
  ``bias_correction`` must stay true (torch has no switch).
* ``SGD``, ``Adagrad`` and any other ``torch.optim`` class name (DeepSpeed's fallback) are built
  from ``torch.optim`` with the params as keyword arguments.
* ``Lamb`` is not in torch: it is built from the ``torch-optimizer`` package when that is installed
  (only the common ``lr``, ``betas``, ``eps``, ``weight_decay`` keys), else it is refused with what to do.
  Lamb's trust ratio needs whole tensors, so ZeRO stages >= 1 refuse it anyway (stage 0 only).
* ``OneBitAdam`` builds :class:`lightning_zero.OneBitAdam` (ZeRO stage 0; docs/onebit_adam.md):
  ``lr``, ``freeze_step``, ``betas``, ``eps``, ``weight_decay`` are taken; ``cuda_aware`` and
  ``comm_backend_name`` are ignored with a warning (the compressed all-reduce runs on the
  strategy's own process group, gloo or NCCL, from host or device tensors alike);
  ``amsgrad``, ``eps_inside_sqrt``, ``max_grad_norm > 0`` and ``bias_correction: false`` are
  refused with the fix.
* Other DeepSpeed-only optimizers (1-bit Lamb, 0/1 Adam, MuAdam, ...) are refused, naming the supported ones.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.onebit_adam import OneBitAdam

_DEEPSPEED_ONLY = ("zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd", "lion", "cpuadam",
                   "fusedadam", "deepspeedcpuadam")
_FUSED_ADAM_DEFAULTS = {"weight_decay": 0.0}


@dataclass(frozen=True)
class OptimizerRecipe:
    """What the ``optimizer`` section builds: a class and its keyword arguments."""

    cls: type[Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)
    fused_on_cuda: bool = False  # DeepSpeed's fused Adam path (torch_adam false)

    def describe(self) -> str:
        args = ", ".join(f"{k}={_norm(v)!r}" for k, v in sorted(self.kwargs.items()))
        return f"{self.cls.__name__}({args})"

    def build(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]) -> Optimizer:
        """The optimizer over ``params`` (tensors or param-group dicts)."""
        params = list(params)
        kwargs = dict(self.kwargs)
        tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
        if self.fused_on_cuda and tensors and all(t.is_cuda for t in tensors):
            kwargs.setdefault("fused", True)
        return self.cls(params, **kwargs)

    def differences(self, optimizer: Optimizer) -> list[str]:
        """How ``optimizer`` (e.g. the one ``configure_optimizers`` returned) differs from this recipe."""
        if type(optimizer) is not self.cls:
            return [f"class {type(optimizer).__name__} vs {self.cls.__name__}"]
        out = []
        for key, value in sorted(self.kwargs.items()):
            theirs = optimizer.defaults.get(key, "<unset>")
            if _norm(theirs) != _norm(value):
                out.append(f"{key}={_norm(theirs)!r} vs {_norm(value)!r}")
        return out


def _norm(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v) for v in value)
    return value


def _lamb_class() -> type[Optimizer] | None:
    found = getattr(torch.optim, "Lamb", None)
    if found is not None:
        return found
    if importlib.util.find_spec("torch_optimizer") is not None:
        return importlib.import_module("torch_optimizer").Lamb
    return None


def _check_kwargs(cls: type[Optimizer], kwargs: dict[str, Any], name: str) -> None:
    signature = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    valid = [p for p in signature.parameters if p not in ("self", "params")]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"optimizer.params of {name}: {unknown} not accepted by {cls.__module__}.{cls.__name__}; "
                         f"valid keys: {valid}.")


def _onebit_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's OneBitAdam params as :class:`OneBitAdam`'s arguments (see the module doc)."""
    ignored = sorted(k for k in ("cuda_aware", "comm_backend_name") if kwargs.pop(k, None) is not None)
    if ignored:
        warnings.warn(f"optimizer.params {ignored} of OneBitAdam are ignored: lightning_zero's compressed "
                      "all-reduce runs on the strategy's own process group (gloo or NCCL).", stacklevel=3)
    refused = {
        "amsgrad": "1-bit Adam freezes the variance; AMSGrad's running maximum has no meaning there",
        "eps_inside_sqrt": "eps is added outside the square root, as in AdamW",
    }
    for key, why in refused.items():
        if kwargs.pop(key, False):
            raise ValueError(f"optimizer.params.{key}=true is not supported by OneBitAdam: {why}. Remove the key.")
    if kwargs.pop("max_grad_norm", 0) or 0:
        raise ValueError("optimizer.params.max_grad_norm of OneBitAdam: clip with the top-level "
                         "`gradient_clipping` key instead (the strategy clips, see docs/onebit_adam.md).")
    if not kwargs.pop("bias_correction", True):
        raise ValueError("optimizer.params.bias_correction=false: OneBitAdam always corrects the bias, as AdamW "
                         "does. Remove the key (or set it to true).")
    _check_kwargs(OneBitAdam, kwargs, "OneBitAdam")
    return kwargs


def optimizer_recipe(type_name: str, params: dict[str, Any] | None = None) -> OptimizerRecipe:
    """The torch class and keyword arguments for DeepSpeed's ``optimizer.type`` / ``optimizer.params``.

    Raises:
        ValueError: an unknown or unavailable type, or params the optimizer does not take.
    """
    kwargs = dict(params or {})
    lowered = type_name.lower()
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if lowered in ("adam", "adamw"):
        torch_adam = bool(kwargs.pop("torch_adam", False))
        adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
        if not kwargs.pop("bias_correction", True):
            raise ValueError("optimizer.params.bias_correction=false: torch's Adam/AdamW always correct the bias. "
                             "Remove the key (or set it to true).")
        cls: type[Optimizer] = torch.optim.AdamW if lowered == "adamw" or adam_w_mode else torch.optim.Adam
        if not torch_adam:
            kwargs = {**_FUSED_ADAM_DEFAULTS, **kwargs}
        _check_kwargs(cls, kwargs, type_name)
        return OptimizerRecipe(cls, kwargs, fused_on_cuda=not torch_adam)
    if lowered == "onebitadam":
        return OptimizerRecipe(OneBitAdam, _onebit_kwargs(kwargs))
    if lowered == "lamb":
        lamb = _lamb_class()
        if lamb is None:
            raise ValueError("optimizer.type=Lamb: Lamb is not part of torch, and the torch-optimizer package that "
                             "lightning_zero builds it from is not installed. Fix: `pip install torch-optimizer`, or "
                             "use Adam / AdamW, or return your own Lamb from configure_optimizers. Note that Lamb's "
                             "trust ratio needs whole tensors, so it runs under ZeRO stage 0 only.")
        _check_kwargs(lamb, kwargs, type_name)
        return OptimizerRecipe(lamb, kwargs)
    if lowered in _DEEPSPEED_ONLY:
        raise ValueError(f"optimizer.type={type_name!r} is a DeepSpeed-only optimizer that lightning_zero does not "
                         "provide. Use Adam, AdamW, SGD, Adagrad or another torch.optim class name.")
    named = {"sgd": "SGD", "adagrad": "Adagrad"}.get(lowered, type_name)
    cls_ = getattr(torch.optim, named, None)
    if not (isinstance(cls_, type) and issubclass(cls_, Optimizer)):
        raise ValueError(f"optimizer.type={type_name!r} is neither a DeepSpeed optimizer lightning_zero supports "
                         "(Adam, AdamW, Lamb) nor a torch.optim class. Use Adam, AdamW, SGD, Adagrad, or any "
                         "torch.optim class name.")
    _check_kwargs(cls_, kwargs, type_name)
    return OptimizerRecipe(cls_, kwargs)
