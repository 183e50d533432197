"""The parallel styles a plan can name, as small frozen policies, and the vocabularies that name them:
Hugging Face's strings (``"colwise"``, ``"rowwise"``, ``"colwise_rep"``, ``"embedding_rowwise"``, ...)
and torch's ``ColwiseParallel()`` / ``RowwiseParallel()`` objects.

A style we do not build (sequence parallel, HF's ``"gather"``, ``"local_*"``, expert parallel) is refused
with the reason; an unknown one with the list of known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Colwise:
    """Split an ``nn.Linear``'s output features (``chunks`` fused blocks cut separately); the output stays
    split unless ``gather_output``."""

    chunks: int = 1
    gather_output: bool = False


@dataclass(frozen=True)
class Rowwise:
    """Split an ``nn.Linear``'s input features; the output is summed over the group. ``input_is_parallel``:
    the input arrives split (after a ``Colwise``); else it is replicated and each rank takes its slice."""

    input_is_parallel: bool = True


@dataclass(frozen=True)
class VocabEmbedding:
    """Split an ``nn.Embedding``'s rows (the vocabulary); the lookups are summed over the group."""


@dataclass(frozen=True)
class Replicate:
    """Leave the module whole on every rank (its gradients are counted once in the norm)."""


@dataclass(frozen=True)
class ReplicateGradSum:
    """Leave the module whole on every rank, but sum its parameters' gradients over the TP group: for a module
    that acts on split activations with a whole parameter (Qwen3's per-head ``q_norm`` / ``k_norm`` after a
    column-parallel projection: each rank's gradient covers only its own heads). Hugging Face's
    ``"replicated_with_grad_allreduce"``; counted once in the gradient norm, as a replicated parameter."""


Style = Colwise | Rowwise | VocabEmbedding | Replicate | ReplicateGradSum
STYLES = (Colwise, Rowwise, VocabEmbedding, Replicate, ReplicateGradSum)

HF_STYLES: dict[str, Style] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "colwise_rep": Colwise(gather_output=True),
    "colwise_gather_output": Colwise(gather_output=True),
    "rowwise_rep": Rowwise(input_is_parallel=False),
    "rowwise_split_input": Rowwise(input_is_parallel=False),
    "packed_colwise": Colwise(chunks=2),  # HF's fused gate_up_proj: two blocks
    "embedding_rowwise": VocabEmbedding(),
    "vocab_parallel": VocabEmbedding(),
    "replicate": Replicate(),
    "replicated_with_grad_allreduce": ReplicateGradSum(),
}

NOT_BUILT: dict[str, str] = {
    "sequence_parallel": "sequence parallelism inside a TP group (layer norms over split tokens) is not built yet",
    "gather": "HF's 'gather' (an all-reduce of a module's output, for experts) is not built",
    "local": "HF's 'local' styles keep DTensor-free local shards with user code around them: not built",
    "local_colwise": "HF's 'local' styles keep DTensor-free local shards with user code around them: not built",
    "local_rowwise": "HF's 'local' styles keep DTensor-free local shards with user code around them: not built",
    "local_packed_rowwise": "HF's 'local' styles keep DTensor-free local shards with user code around them: not built",
    "isolated": "HF's 'isolated' (a module on a sub-mesh) is not built",
    "grouped_gemm": "expert (MoE) parallelism is not built",
    "ep_router": "expert (MoE) parallelism is not built",
    "moe_tp_experts": "expert (MoE) parallelism is not built",
}


def _layout(layouts: Any) -> str:
    """``"replicate"``, ``"shard-1"`` (last dim) or ``"shardN"`` of torch's one-entry layout tuple."""
    first = layouts[0] if isinstance(layouts, (tuple, list)) else layouts
    if type(first).__name__ == "Replicate":
        return "replicate"
    dim = getattr(first, "dim", None)
    return f"shard{dim}"


def _from_torch(style: Any, name: str) -> Style:
    kind = type(style).__name__
    if kind == "ColwiseParallel":
        inp, out = _layout(style.input_layouts), _layout(style.output_layouts)
        if inp != "replicate":
            raise ValueError(f"plan entry {name!r}: ColwiseParallel(input_layouts={inp}) takes a sequence-split input "
                             "(sequence parallelism): not built yet; use ColwiseParallel()")
        if out not in ("replicate", "shard-1", "shard2"):
            raise ValueError(f"plan entry {name!r}: ColwiseParallel(output_layouts={out}) is not built: use the "
                             "default (split output) or Replicate()")
        return Colwise(gather_output=out == "replicate")
    if kind == "RowwiseParallel":
        inp, out = _layout(style.input_layouts), _layout(style.output_layouts)
        if out != "replicate":
            raise ValueError(f"plan entry {name!r}: RowwiseParallel(output_layouts={out}) splits the output over "
                             "the sequence (sequence parallelism): not built yet; use RowwiseParallel()")
        if inp == "replicate":  # on an nn.Embedding (torchtitan's tok_embeddings): VocabEmbedding (plan.py)
            return Rowwise(input_is_parallel=False)
        if inp not in ("shard-1", "shard2"):  # the hidden (last) dimension of a [batch, seq, hidden] activation
            raise ValueError(f"plan entry {name!r}: RowwiseParallel(input_layouts={inp}) takes an input split over "
                             "the batch or sequence (sequence parallelism, not built yet): use RowwiseParallel() "
                             "(its input split along the last dimension, after a ColwiseParallel) or "
                             "RowwiseParallel(input_layouts=Replicate())")
        return Rowwise()
    if kind in ("SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"):
        raise ValueError(f"plan entry {name!r}: torch's {kind} is not built yet (sequence parallelism and layout "
                         "conversions between modules): leave it out; ColwiseParallel / RowwiseParallel are built")
    raise ValueError(f"plan entry {name!r}: unknown style {style!r}; known: ColwiseParallel(), RowwiseParallel() "
                     f"or one of {sorted(HF_STYLES)}")


def resolve_style(style: Any, name: str) -> Style:
    """The policy a plan entry names: one of ours, an HF string or a torch style object.

    Raises:
        ValueError: an unknown style (the message lists the known ones) or one not built (with the reason).
    """
    if isinstance(style, STYLES):
        return style
    if isinstance(style, str):
        if style in HF_STYLES:
            return HF_STYLES[style]
        if style in NOT_BUILT:
            raise ValueError(f"plan entry {name!r}: style {style!r}: {NOT_BUILT[style]}. Leave the entry out "
                             "(the module stays whole) or use one of " + ", ".join(sorted(HF_STYLES)))
        raise ValueError(f"plan entry {name!r}: unknown style {style!r}; known: {', '.join(sorted(HF_STYLES))}")
    return _from_torch(style, name)
