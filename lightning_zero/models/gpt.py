"""A nanoGPT-style byte-level decoder LM and its LightningModule.

Blocks live in ``GPT.blocks`` (an ``nn.ModuleList``) so that ZeRO stage 3 can gather parameters one block
at a time. Presets are in :data:`GPT_PRESETS`; :func:`count_parameters` counts on the meta device. The shape
(``GPTConfig``, ``GPT_PRESETS``) is in ``gpt_config.py``, one block (attention, MLP) in ``gpt_blocks.py``; this
module names them too (``__all__``): it is the GPT's documented path.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.models.data import NextTokenSteps
from lightning_zero.models.gpt_blocks import MLP, Block, CausalSelfAttention
from lightning_zero.models.gpt_config import GPT_PRESETS, GPTConfig, resolve_config
from lightning_zero.models.gpt_model import GPT, GPTEmbedding, GPTHead, count_parameters, gpt_param_init
from lightning_zero.sequence_parallel import SequenceGroup, check_sequence_parallel
from lightning_zero.tensor_parallel import ColumnParallelLinear, Colwise, vocab_parallel_cross_entropy

__all__ = ["GPT", "GPT_PRESETS", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "GPTEmbedding", "GPTHead",
           "GPTLightningModule", "count_parameters", "gpt_param_init", "lr_lambda", "param_groups", "resolve_config"]



def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups: decay for weight matrices/token embedding; none for biases, norms, positions.

    The split is by module type and name (not tensor rank), so it survives parameter flattening.
    """
    no_decay: set[str] = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, nn.LayerNorm) or p_name == "bias" or mod_name == "pos_emb":
                no_decay.add(full)
    params = dict(model.named_parameters())  # de-duplicates tied weights
    return [
        {"params": [p for n, p in params.items() if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in params.items() if n in no_decay], "weight_decay": 0.0},
    ]


def lr_lambda(kind: str | None, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Any:
    """Multiplier ``step -> factor`` for ``LambdaLR``: linear warmup then constant/cosine/linear decay."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind in (None, "none", "constant"):
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


class GPTLightningModule(NextTokenSteps, LightningModule):
    """Language-model training of :class:`GPT` with AdamW/Adam/SGD and an optional warmup/decay schedule.

    Args:
        model: preset name (see :data:`GPT_PRESETS`), :class:`GPTConfig` or a dict of its fields.
        lr: peak learning rate.
        weight_decay: decay of the decayed group (see :func:`param_groups`).
        betas: Adam betas; for SGD, ``betas[0]`` is the momentum.
        warmup_steps: linear warmup steps (0 = none).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"onebit_adam"`` (1-bit Adam, ZeRO stage 0).
        scheduler: ``None``/``"constant"`` (warmup only), ``"cosine"`` or ``"linear"`` decay.
        lr_decay_steps: decay horizon; default ``trainer.max_steps`` (or the estimated stepping batches).
        min_lr_ratio: final LR as a fraction of ``lr`` for the decaying schedules.
        model_overrides: ``GPTConfig`` fields replacing the preset's (e.g. ``{"seq_len": 128}``).
        build_in_configure_model: build the network in :meth:`configure_model` (sharded construction).
        freeze_step: ``optimizer="onebit_adam"``: AdamW warm-up steps before the momentum is compressed.
        fused: torch's fused kernel for ``"adamw"`` / ``"adam"`` / ``"sgd"`` (what offload steps with: set it on a
            run without offload to compare the two bitwise, docs/offload.md).
    """

    def __init__(
        self,
        model: GPTConfig | str | dict[str, Any] = "gpt_small",
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] | list[float] = (0.9, 0.95),
        warmup_steps: int = 20,
        optimizer: str = "adamw",
        scheduler: str | None = None,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        model_overrides: dict[str, Any] | None = None,
        build_in_configure_model: bool = False,
        freeze_step: int = 100,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "adam", "sgd", "onebit_adam"):
            raise ValueError(f"unknown optimizer {optimizer!r}")
        if scheduler not in (None, "none", "constant", "cosine", "linear"):
            raise ValueError(f"unknown scheduler {scheduler!r}")
        self.config = resolve_config(model, model_overrides)
        self.save_hyperparameters(
            {
                "model": model if isinstance(model, str) else asdict(resolve_config(model)),
                "lr": lr,
                "weight_decay": weight_decay,
                "betas": [float(b) for b in betas],
                "warmup_steps": warmup_steps,
                "optimizer": optimizer,
                "scheduler": scheduler,
                "lr_decay_steps": lr_decay_steps,
                "min_lr_ratio": min_lr_ratio,
                "model_overrides": dict(model_overrides) if model_overrides else None,
                "build_in_configure_model": build_in_configure_model,
                "freeze_step": freeze_step,
                "fused": fused,
            }
        )
        self.model: GPT | None = None if build_in_configure_model else GPT(self.config, init_prefix="model")

    def configure_model(self) -> None:
        """Build the network if not built yet (idempotent); runs inside the strategy's init context."""
        if self.model is None:
            self.model = GPT(self.config, init_prefix="model")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for token ids ``idx``."""
        if self.model is None:
            raise RuntimeError("model not built yet: call configure_model() first")
        return self.model(idx)

    def pipeline_layers(self) -> list[nn.Module]:
        """The pipeline protocol (docs/pipeline.md): embedding, blocks, head; a tied head shares the
        token embedding across the first and last stage."""
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return [GPTEmbedding(self.model), *self.model.blocks, GPTHead(self.model)]

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """The tensor-parallel plan (docs/tensor_parallel.md): heads split (q, k and v fused: three blocks), the
        MLP column- then row-parallel, a vocabulary-parallel embedding and LM head (tied, split alike) whose
        split logits go to the vocabulary-parallel cross-entropy."""
        return {"model.tok_emb": "embedding_rowwise", "model.blocks.*.attn.qkv": Colwise(chunks=3),
                "model.blocks.*.attn.proj": "rowwise", "model.blocks.*.mlp.fc": "colwise",
                "model.blocks.*.mlp.proj": "rowwise", "model.lm_head": "colwise"}

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of one micro-batch (the pipeline protocol)."""
        head = self.model.lm_head if self.model is not None else None
        if isinstance(head, ColumnParallelLinear) and not head.gather_output:  # logits split along the vocabulary
            return vocab_parallel_cross_entropy(logits, targets, head.tp)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def configure_sequence_parallel(self, group: SequenceGroup | None) -> None:
        """Sequence parallel (``ZeroStrategy(sequence_parallel=N)`` calls it; ``None`` undoes it): each rank
        takes its slice of every batch's sequences, at their global positions, attends through the
        all-to-alls and returns the token-weighted loss of the whole sequence (docs/sequence_parallel.md)."""
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        if group is not None:
            check_sequence_parallel(group.size, heads=self.config.n_head)
        self.model.use_sequence_group(group)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of an ``(inputs, targets)`` batch (with sequence parallel: of
        the whole sequences, from this rank's slice; Note [token-weighted loss over data x sequence])."""
        x, y = batch
        sp = self.model.sequence_group if self.model is not None else None
        if sp is None:
            return self.pipeline_loss(self(x), y)
        return sp.loss(self(sp.slice(x)), sp.slice(y))

    def training_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """:meth:`loss` plus, with the MoE option, the weighted router losses of that forward (what is trained on;
        the validation loss is the cross-entropy alone)."""
        loss = self.loss(batch)
        router = self.model.router_loss() if self.model is not None else None
        return loss if router is None else loss + router

    def _decay_horizon(self) -> int:
        hp = self.hparams
        if hp.lr_decay_steps:
            return int(hp.lr_decay_steps)
        if self._trainer is not None and self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        if self._trainer is not None and math.isfinite(self.trainer.estimated_stepping_batches):
            return int(self.trainer.estimated_stepping_batches)
        raise ValueError("set lr_decay_steps (or Trainer.max_steps) for a decaying LR schedule")

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        groups = param_groups(self.model, hp.weight_decay)
        fused = {"fused": True} if hp.get("fused") else {}
        if hp.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=hp.lr, momentum=hp.betas[0], **fused)
        elif hp.optimizer == "onebit_adam":
            opt = OneBitAdam(groups, lr=hp.lr, betas=tuple(hp.betas), freeze_step=hp.get("freeze_step", 100))
        else:
            cls = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
            opt = cls(groups, lr=hp.lr, betas=tuple(hp.betas), **fused)
        if hp.scheduler in (None, "none", "constant") and hp.warmup_steps <= 0:
            return opt
        total = self._decay_horizon() if hp.scheduler in ("cosine", "linear") else 0
        fn = lr_lambda(hp.scheduler, hp.warmup_steps, total, hp.min_lr_ratio)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
