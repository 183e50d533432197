"""The GPT itself, without Lightning: the decoder LM (``GPT``), its pipeline layers (``GPTEmbedding``,
``GPTHead``), its initialisation (``gpt_param_init``) and its parameter count (``count_parameters``, on the meta
device). ``gpt.py`` adds the LightningModule and names all of them; this module is what the CLI's checks and the
estimator import (no Lightning in the launcher: Note [lazy package names] in ``core/lazy.py``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zero.core.stage3.materialize import ParamInitFn, default_init, initialize_like_sharded
from lightning_zero.models.gpt_blocks import Block
from lightning_zero.models.gpt_config import GPTConfig, resolve_config
from lightning_zero.moe import GroupedMLPExperts, MoELayer
from lightning_zero.sequence_parallel import SequenceGroup


class GPT(nn.Module):
    """Decoder-only LM: token + learned position embeddings, ``blocks``, final LN, (tied) LM head.

    Args:
        config: the shape.
        init_prefix: this model's name inside the module a strategy trains (``"model"`` in
            :class:`GPTLightningModule`). Every module is initialised from ``(torch.initial_seed(), its
            qualified name)`` (:func:`gpt_param_init`'s values), as a build on the meta device is by each pipeline
            stage or ZeRO-3 unit: one seed gives the same weights whatever the layout (two models built after one
            ``torch.manual_seed`` are equal).
    """

    def __init__(self, config: GPTConfig, init_prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.sequence_group: SequenceGroup | None = None  # sequence parallel (use_sequence_group)
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        initialize_like_sharded(self, gpt_param_init(config), torch.initial_seed() % 2**63, init_prefix)

    def use_sequence_group(self, group: SequenceGroup | None) -> None:
        """Run on this rank's slice of each sequence (``None``: whole sequences again)."""
        self.sequence_group = group
        for block in self.blocks:
            block.attn.sequence_group = group

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, time, vocab)`` for token ids ``idx`` of shape ``(batch, time)`` (with a
        sequence group: this rank's slice of the sequences, at their global positions)."""
        sp, t = self.sequence_group, idx.size(1)
        whole = t if sp is None else t * sp.size
        if whole > self.config.seq_len:
            raise ValueError(f"sequence length {whole} exceeds the model's seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device) if sp is None else sp.positions(t, idx.device)
        with nullcontext() if sp is None else sp.dropout_stream(idx.device):  # split tokens: this rank's masks
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    def router_loss(self) -> torch.Tensor | None:
        """The MoE option's router losses of the last forward, weighted (``aux_loss_coef`` x the blocks' load-balancing
        losses + ``z_loss_coef`` x their z-losses); ``None`` for a dense GPT."""
        moe = self.config.moe
        if moe is None:
            return None
        total: torch.Tensor | None = None
        for block in self.blocks:
            layer = block.mlp
            if not isinstance(layer, MoELayer) or layer.aux_loss is None or layer.z_loss is None:
                continue
            term = moe.aux_loss_coef * layer.aux_loss + moe.z_loss_coef * layer.z_loss
            total = term if total is None else total + term
        return total


class GPTEmbedding(nn.Module):
    """Pipeline layer: token + position embeddings (and dropout) of a :class:`GPT`."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop, self.seq_len = gpt.tok_emb, gpt.pos_emb, gpt.drop, gpt.config.seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(1) > self.seq_len:
            raise ValueError(f"sequence length {idx.size(1)} exceeds the model's seq_len {self.seq_len}")
        return self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device)))


class GPTHead(nn.Module):
    """Pipeline layer: final LayerNorm and the (tied) LM head of a :class:`GPT`."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_param_init(config: GPTConfig | str | dict[str, Any]) -> ParamInitFn:
    """``param_init_fn`` for a :class:`GPT` built on the meta device (``configure_model``): GPT's own
    initialisation, one module at a time (``normal(0.02)`` weights, the residual projections scaled
    by ``1 / sqrt(2 n_layer)``, zero biases; LayerNorms their ``reset_parameters``)."""
    resid_std = 0.02 / math.sqrt(2 * resolve_config(config).n_layer)

    def init(module: nn.Module, name: str) -> None:
        if isinstance(module, GroupedMLPExperts):  # the MoE option's experts: like the MLP they replace
            module.reset_parameters(std=0.02, down_std=resid_std)
            return
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            default_init(module, name)
            return
        nn.init.normal_(module.weight, std=resid_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    return init


class _SkipInit(TorchFunctionMode):
    """``torch.nn.init``'s functions leave their tensor as it is: a meta build has no values to write (and torch's
    meta ``normal_``, which ``nn.Embedding`` runs, imports ``torch._dynamo``: 2.5 s of the launcher's CPU)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def count_parameters(config: GPTConfig | str | dict[str, Any]) -> int:
    """Number of distinct parameters (tied weights counted once), built on the meta device (not initialised)."""
    with torch.device("meta"), _SkipInit():
        model = GPT(resolve_config(config))
    return sum(p.numel() for p in model.parameters())


def state_shapes(config: GPTConfig | str | dict[str, Any], prefix: str = "model") -> dict[str, tuple[int, ...]]:
    """The shape of every state-dict key of a GPT held as ``prefix`` (``GPTLightningModule.model``), as a
    checkpoint names them; built on the meta device (not initialised)."""
    with torch.device("meta"), _SkipInit():
        model = GPT(resolve_config(config))
    return {f"{prefix}.{key}": tuple(value.shape) for key, value in model.state_dict().items()}
