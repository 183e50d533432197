"""Any ``transformers`` causal LM as a LightningModule (``model=hf_causal_lm``): from a local ``save_pretrained``
directory, or from a config with random weights.

Note [loading a Hugging Face checkpoint sharded]
    The model is built in ``configure_model``. Under ZeRO stage 3 that runs inside the strategy's sharded
    context (``core/stage3/materialize.py``): ``from_config`` registers every parameter on the meta device and
    nothing of the weights exists yet. The strategy then builds one unit at a time and calls its
    ``param_init_fn`` for each module owning parameters of the unit; :meth:`HFCausalLM.init_parameters` is that
    function: it reads the module's own tensors from the safetensors files (the index says which file holds which
    key; a file is memory-mapped, a tensor read when asked) into the unit's storage, the unit is sharded and freed.
    So no rank holds more than its shards and one unit of the model, whatever the checkpoint's size, and no
    weight is initialised at random first. A tied weight (``lm_head`` and ``embed_tokens``) is read under the
    name the file has. Outside stage 3 the model is whole on every rank anyway: ``from_pretrained`` loads it.
    Either way the model's names are compared with the file's first: a weight the model has and the file lacks,
    or a file's tensor the model has no place for, is an error listing them (Hugging Face's own
    ``_keys_to_ignore_on_load_*`` patterns excepted), never a silently random weight.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_zero.core.common.errors import UsageError
from lightning_zero.core.stage3.materialize import parameters_go_to_meta
from lightning_zero.hf.directory import HFDirectory
from lightning_zero.lightning.state_files import SafetensorsFiles
from lightning_zero.models.data import NextTokenSteps

MODEL_ATTRIBUTE = "model"  # the LightningModule's attribute holding the transformers model: names start with it
SPARSE_ATTENTION = "lightning_zero_sparse"  # the name block-sparse attention is registered under with transformers


def hf_config(path: str | None, config: str | Mapping[str, Any] | None) -> Any:
    """The ``transformers`` config of a directory, of a ``config.json`` (or a directory holding one), or of a
    mapping with ``model_type`` and the config's keys."""
    from transformers import AutoConfig

    if path is not None:
        return AutoConfig.from_pretrained(path)
    if isinstance(config, Mapping):
        values = dict(config)
        if "model_type" not in values:
            raise UsageError(f"model.config={values}: a mapping needs `model_type` (e.g. llama, gpt2, qwen2) and "
                             "the config's keys, e.g. model.config={model_type: llama, hidden_size: 64}.")
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if isinstance(config, str):
        return AutoConfig.from_pretrained(config)
    raise UsageError("model=hf_causal_lm needs model.path (a save_pretrained directory) or model.config.")


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter, tied names together, in module order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def key_problems(model: nn.Module, keys: set[str]) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the model's weights no key of ``keys`` holds (any name of a tied weight will do),
    and the keys the model has no parameter or persistent buffer for; the model's
    ``_keys_to_ignore_on_load_missing`` / ``_unexpected`` patterns are left out."""
    params = tie_groups(model)
    names = {n for group in params for n in group}
    buffers = [n for n in model.state_dict(keep_vars=True) if n not in names]
    ignore_missing = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    ignore_unexpected = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    missing = [g[0] for g in params if not any(n in keys for n in g)] + [b for b in buffers if b not in keys]
    missing = [m for m in missing if not any(p.search(m) for p in ignore_missing)]
    unexpected = sorted(k for k in keys - names - set(buffers) if not any(p.search(k) for p in ignore_unexpected))
    return missing, unexpected


def _listing(keys: list[str], most: int = 12) -> str:
    return ", ".join(keys[:most]) + (f" ... ({len(keys)} in all)" if len(keys) > most else "")


class HFCausalLM(NextTokenSteps, LightningModule):
    """Next-token training of a ``transformers`` ``AutoModelForCausalLM`` on ``(inputs, targets)`` batches.

    Args:
        pretrained: a directory ``save_pretrained`` wrote (config, safetensors weights, possibly sharded with an index;
            the CLI's ``model.path``; named apart from the data module's ``path``, since Lightning merges both
            hyper-parameters).
        config: instead of ``pretrained``, the config to build with random weights: a ``config.json``, a directory
            holding one, or a mapping with ``model_type``.
        lr: learning rate.
        weight_decay: AdamW's decay (not of biases and norms).
        betas: Adam's betas (SGD: ``betas[0]`` is the momentum).
        warmup_steps: linear warm-up steps (0: none).
        optimizer: ``adamw``, ``adam`` or ``sgd``.
        attn_implementation: ``transformers``' attention (``sdpa``, ``eager``, or a registered name).
        sparse_attention: a DeepSpeed ``sparse_attention`` section (``lightning_zero.sparse_attention``): block-sparse
            attention registered with ``transformers`` (``lightning_zero.models.hf_sparse``) replaces
            ``attn_implementation``.
    """

    def __init__(self, pretrained: str | None = None, config: str | Mapping[str, Any] | None = None, lr: float = 1e-4,
                 weight_decay: float = 0.0, betas: tuple[float, float] | list[float] = (0.9, 0.999),
                 warmup_steps: int = 0, optimizer: str = "adamw", attn_implementation: str = "sdpa",
                 sparse_attention: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if (pretrained is None) == (config is None):
            raise UsageError("model=hf_causal_lm needs exactly one of model.path (a save_pretrained directory) and "
                             "model.config (random weights).")
        if optimizer not in ("adamw", "adam", "sgd"):
            raise UsageError(f"model.optimizer={optimizer} is not built for model=hf_causal_lm. Fix: adamw, adam "
                             "or sgd.")
        config = dict(config) if isinstance(config, Mapping) else config
        self.save_hyperparameters({"pretrained": pretrained, "config": config,
                                   "lr": lr, "weight_decay": weight_decay, "betas": [float(b) for b in betas],
                                   "warmup_steps": warmup_steps, "optimizer": optimizer,
                                   "attn_implementation": attn_implementation,
                                   "sparse_attention": dict(sparse_attention) if sparse_attention else None})
        self.model: nn.Module | None = None
        self._files: SafetensorsFiles | None = None
        self._aliases: dict[str, list[str]] = {}  # a parameter's name -> every name of it (ties)

    @property
    def directory(self) -> HFDirectory | None:
        """The checkpoint directory (``None``: built from a config)."""
        path = self.hparams.pretrained
        return HFDirectory(Path(path)) if path else None

    def configure_model(self) -> None:
        """Build the model once (Note [loading a Hugging Face checkpoint sharded]): at stage 3 on the meta device,
        the strategy streaming the weights into the shards through :meth:`init_parameters`; else whole."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hparams
        config = hf_config(hp.pretrained, hp.config)
        kwargs = {"attn_implementation": self._attention(config), "dtype": torch.float32}
        directory = self.directory
        if directory is None or parameters_go_to_meta():
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(directory.path), config=config, **kwargs)
        model.config.use_cache = False  # training: no key-value cache
        if directory is not None:
            weight_map = directory.weight_files()
            missing, unexpected = key_problems(model, set(weight_map))
            if missing or unexpected:
                raise UsageError(
                    f"model.path={directory.path}: the checkpoint does not match {type(model).__name__}: "
                    f"missing {_listing(missing) or 'none'}; unexpected {_listing(unexpected) or 'none'}. Fix: the "
                    "directory save_pretrained wrote for this architecture (its config.json and weights together).")
            self._files = SafetensorsFiles(weight_map)
            self._aliases = {n: group for group in tie_groups(model) for n in group}
            if parameters_go_to_meta():  # buffers are real: those the file holds are read now
                buffers = dict(model.named_buffers())
                with torch.no_grad():
                    for name in set(buffers) & set(weight_map):
                        buffers[name].copy_(self._files[name])
        self.model = model

    def _attention(self, config: Any) -> str:
        """The attention implementation: block-sparse when configured (registered now), else the given one."""
        section = self.hparams.sparse_attention
        if not section:
            return str(self.hparams.attn_implementation)
        from lightning_zero.models.hf_sparse import register_hf_sparse_attention
        from lightning_zero.sparse_attention.section import make_sparsity_config

        register_hf_sparse_attention(make_sparsity_config(section, config.num_attention_heads),
                                     config.max_position_embeddings, name=SPARSE_ATTENTION,
                                     executor=section.get("executor", "auto"))
        return SPARSE_ATTENTION

    @torch.no_grad()
    def init_parameters(self, module: nn.Module, name: str) -> None:
        """The strategy's ``param_init_fn`` for a model built on the meta device: ``module``'s own parameters read
        from the checkpoint (or, built from a config, initialised the model's own way).

        Args:
            module: a module owning parameters of the unit being built.
            name: its qualified name in this LightningModule.
        """
        assert self.model is not None
        if self._files is None:
            self.model._init_weights(module)  # type: ignore[operator]
            return
        prefix = name[len(MODEL_ATTRIBUTE) + 1:] if name.startswith(MODEL_ATTRIBUTE + ".") else name
        for own, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{own}" if prefix else own
            found = next((k for k in self._aliases.get(key, [key]) if k in self._files), None)
            if found is None:  # key_problems refused this at configure_model
                raise UsageError(f"model.path: no tensor for {key!r} in the checkpoint.")
            value = self._files[found]
            if tuple(value.shape) != tuple(p.shape):
                raise UsageError(f"model.path: {found!r} has shape {tuple(value.shape)} in the checkpoint, "
                                 f"{tuple(p.shape)} in the model built from its config.json.")
            p.copy_(value)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for token ids."""
        if self.model is None:
            raise RuntimeError("model not built yet: call configure_model() first")
        return self.model(input_ids=input_ids).logits

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of ``(inputs, targets)``: what the model's own loss gives with
        ``labels=targets, shift_labels=targets`` (its ``ForCausalLMLoss``, logits in float32)."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True, batch_size=batch[0].size(0))
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The most likely next token at every position."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if hp.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=hp.lr, momentum=hp.betas[0])
        else:
            cls = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
            opt = cls(groups, lr=hp.lr, betas=tuple(hp.betas))
        if hp.warmup_steps <= 0:
            return opt
        warm = int(hp.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
