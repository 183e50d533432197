"""Dropout randomness under tensor parallelism: one stream where activations are replicated, one per TP
rank where they are split.

Note [dropout streams]
    Replicated activations (after a row-parallel layer's all-reduce, the embeddings, the residual stream)
    are computed on every rank of a TP group and must draw the same dropout mask everywhere, or the copies
    (and the replicated parameters they train) drift apart silently while the loss, all-reduced, still
    agrees. They draw from the default generator, which ``agree_default_rng`` makes identical across the
    group at setup (TP rank 0's state broadcast: processes nobody seeded alike start from different
    states); every TP rank then consumes it alike (the same replicated computation, the same shapes).

    Split activations (attention probabilities of this rank's heads) must draw different masks per TP
    rank, or head ``h`` and head ``h + heads/tp`` would share one: inside ``split_region_rng`` the default
    generator is swapped for a generator seeded from one number drawn from the CPU default stream (the
    same on every TP rank) and the TP rank, and swapped back after (Megatron's model-parallel RNG tracker).
    Deriving the split stream from the default one, rather than keeping a state of its own, makes
    activation checkpointing exact: ``torch.utils.checkpoint`` restores the default CPU and device states
    before recomputing, so the recompute draws the same number and the forward's masks (a stream kept
    aside would have moved on, and backward would use other masks than the forward did).

    Masks are therefore not the unsplit model's: parity with it holds at dropout 0, as for any change of
    layout. Where the split regions are: the GPT's attention (``split_region_rng``), and any ``nn.Dropout``
    between a column-parallel layer with a split output and a row-parallel one inside an ``nn.Sequential``
    (``plan='auto'``'s pairs, or a user's plan on such a stack), which ``apply_plan`` wraps in
    ``SplitRegionDropout``, and a Hugging Face model's attention function (transformers draws the attention
    dropout inside the function it looks up by ``config._attn_implementation``; ``split_hf_attention``
    registers that function wrapped in its attention module's split stream under a name of its own, so the
    residual dropout beside it, replicated, stays on the default stream).

    Under sequence parallelism every activation is split: a rank holds its slice of the tokens, and inside
    attention its share of the heads (Note [Ulysses all-to-all]). The ranks of a sequence group start from
    one seed, so on the default stream token ``i`` and token ``i + T/P`` (or head ``j`` and head
    ``j + H/P``) would draw one mask. Each rank therefore draws from its own stream, made the same way with
    the sequence rank (``SequenceGroup.dropout_stream``): around the attention callable, and around the
    GPT's whole forward (its embedding and residual dropouts). Recompute under activation checkpointing is
    exact for the same reason as above.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.layers import ColumnParallelLinear

SPLIT_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel stream
SEQUENCE_SEED_OFFSET = 3141  # the sequence ranks' streams (Note [dropout streams])
_RANK_STRIDE = 0x9E3779B97F4A7C15  # an odd 64-bit constant: the TP ranks' seeds are far apart


class SplitRegionRNG:
    """TP rank ``rank``'s dropout stream for split activations (Note [dropout streams]); ``offset`` keeps another
    dimension's streams (the sequence ranks') apart from the TP ranks'."""

    def __init__(self, rank: int, offset: int = SPLIT_SEED_OFFSET) -> None:
        self.rank, self.offset = rank, offset

    def _default(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    def _set_default(self, device: torch.device, state: torch.Tensor) -> None:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        draw = int(torch.randint(0, 2**62, (1,)))  # the CPU default stream: the same on every TP rank
        gen = torch.Generator(device=device)
        gen.manual_seed((draw + self.offset + self.rank * _RANK_STRIDE) % 2**63)
        outside = self._default(device)
        self._set_default(device, gen.get_state())
        try:
            yield
        finally:
            self._set_default(device, outside)


class SplitRegionDropout(nn.Module):
    """An ``nn.Dropout`` that ``apply_plan`` found between a column-parallel layer (split output) and a
    row-parallel one in an ``nn.Sequential``: its activations are split, so it draws this TP rank's masks
    (Note [dropout streams]); ``dropout`` is the module it replaced."""

    def __init__(self, dropout: nn.Dropout, rng: SplitRegionRNG) -> None:
        super().__init__()
        self.dropout = dropout
        self.tp_rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.tp_rng.fork(x.device):
            return self.dropout(x)


def split_region_rng(module: nn.Module) -> Any:
    """The split stream of a column-parallel ``module`` (its ``tp_rng``), or no change for any other module."""
    rng: SplitRegionRNG | None = getattr(module, "tp_rng", None)
    if rng is None:
        return nullcontext()
    return rng.fork(next(module.parameters()).device)


def split_hf_attention(root: nn.Module, rng: SplitRegionRNG) -> None:
    """Each Hugging Face attention module under ``root`` whose projections ``apply_plan`` made column-parallel
    draws its attention dropout from ``rng`` (Note [dropout streams]): the module gets ``tp_rng`` and its
    model's attention implementation ``name`` becomes ``tp_split_name``, ``name``'s function (the modeling
    file's own eager function for ``eager``) called inside ``split_region_rng(module)``, with ``name``'s mask."""

    configs = {}
    for module in root.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            continue
        if any(isinstance(child, ColumnParallelLinear) for child in module.children()):
            module.tp_rng = rng
            configs[id(config)] = (config, module)
    for config, module in configs.values():
        name = config._attn_implementation or "eager"
        if not name.startswith("tp_split_"):
            config._attn_implementation = _register_split(name, module)


def _register_split(name: str, module: nn.Module) -> str:
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = (getattr(sys.modules[type(module).__module__], "eager_attention_forward", None) if name == "eager"
             else ALL_ATTENTION_FUNCTIONS.get(name))
    if inner is None:
        raise ValueError(f"tensor parallelism cannot find the attention function {name!r} of "
                         f"{type(module).__name__}, so its dropout could not draw per-rank masks. Fix: "
                         "attn_implementation='sdpa' (or 'eager').")

    def split_attention(attention: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with split_region_rng(attention):
            return inner(attention, *args, **kwargs)

    split = f"tp_split_{name}"
    AttentionInterface.register(split, split_attention)
    if name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(split, ALL_MASK_ATTENTION_FUNCTIONS[name])
    return split


def agree_default_rng(tp: TPGroup, device: torch.device) -> None:
    """Give every rank of the TP group TP rank 0's default generator states (CPU, and ``device``'s when it is a
    GPU): the replicated activations' dropout masks then agree (Note [dropout streams]). A collective."""
    if tp.size == 1:
        return
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        states.append((lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
    for get, put in states:
        state = get()
        tp.broadcast_first([state])
        put(state)
