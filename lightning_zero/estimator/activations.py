"""Activation memory of a GPT-style transformer per rank (Korthikanti et al. 2022)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Activations:
    """Activation bytes per rank for one micro-batch (see :func:`activation_memory`)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int
    bytes_per_element: int
    flash_attention: bool
    full: float  # every layer's activations kept for backward
    checkpointed: float  # full activation checkpointing: layer inputs + one layer recomputed
    tensor_parallel: int = 1


def activation_memory(
    layers: int,
    hidden: int,
    seq_len: int,
    micro_batch: int,
    heads: int | None = None,
    bytes_per_element: int = 2,
    flash_attention: bool = False,
    tensor_parallel: int = 1,
) -> Activations:
    """Activation memory of a GPT-style transformer, per rank (data parallelism does not split it).

    Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (arXiv:2205.05198), section 4.1: without recomputation one layer stores
    ``s·b·h·(34 + 5·a·s/h)`` bytes with 16-bit activations and 1-byte dropout masks (attention
    11sbh + 5as²b, MLP 19sbh, two layer norms 4sbh). Of the 34 sbh bytes, 32 are 16 stored
    elements and 2 are masks; of the 5 as²b, 4 are 2 elements (softmax output, dropout output)
    and 1 a mask. For an element size ``e`` this is ``sbh·(16e + 2) + as²b·(2e + 1)`` per layer;
    ``flash_attention`` drops the as²b term (scores are never stored). With full activation
    checkpointing each layer keeps only its input, ``e·sbh``, and backward recomputes one layer
    at a time: ``L·e·sbh`` + one layer's full activations. Embeddings, the final norm, the logits
    and the loss are not included, nor sequence parallelism.

    With tensor parallelism t (Megatron's layers, section 4.2.1), 10 of the 34 sbh bytes stay whole on every
    rank (the layer norms' inputs, the inputs of the first linear layers and the two dropout masks after the
    row-parallel sums: 4 elements and 2 masks) and the other 24 (12 elements) and the scores are split:
    ``sbh·(4e + 2 + 12e/t) + as²b·(2e + 1)/t`` per layer, Korthikanti's ``sbh·(10 + 24/t + 5as/(ht))`` at
    e = 2. The checkpointed layer inputs stay whole.

    Args:
        layers: L, transformer layers.
        hidden: h, hidden size.
        seq_len: s, tokens per sample.
        micro_batch: b, samples per rank per forward.
        heads: a, attention heads (default ``hidden // 64``, i.e. head dim 64).
        bytes_per_element: e, 2 for 16-bit activations, 4 for fp32.
        flash_attention: attention without stored scores (FlashAttention / SDPA kernels).
        tensor_parallel: t, ranks per tensor-parallel group (heads and the MLP split over them).
    """
    heads = heads if heads is not None else max(1, hidden // 64)
    for label, v in (("layers", layers), ("hidden", hidden), ("seq_len", seq_len), ("micro_batch", micro_batch),
                     ("heads", heads)):
        if int(v) != v or v < 1:
            raise ValueError(f"Activation memory needs a positive integer {label}, got {v!r}.")
    if int(tensor_parallel) != tensor_parallel or tensor_parallel < 1:
        raise ValueError(f"Activation memory needs a positive integer tensor_parallel, got {tensor_parallel!r}.")
    sbh = float(seq_len) * micro_batch * hidden
    e, t = bytes_per_element, tensor_parallel
    scores = 0.0 if flash_attention else heads * seq_len**2 * micro_batch * (2 * e + 1.0) / t
    per_layer = sbh * (4 * e + 2 + 12 * e / t) + scores
    return Activations(layers, hidden, heads, seq_len, micro_batch, e, flash_attention,
                       full=layers * per_layer, checkpointed=layers * e * sbh + per_layer, tensor_parallel=t)
