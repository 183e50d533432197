"""The text pieces both reports share: columns, the model / precision / cluster lines, the activation line.

The reports themselves are written beside their results, so that this module imports neither
(``render_estimate`` in :mod:`.estimate`, ``render_advice`` in :mod:`.advisor`).
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from lightning_zero.estimator.options import PRECISIONS
from lightning_zero.estimator.sizes import format_bytes, format_count

if TYPE_CHECKING:
    from lightning_zero.estimator.activations import Activations
    from lightning_zero.estimator.cluster import Cluster
    from lightning_zero.estimator.model_spec import ModelSpec


def grid(rows: list[list[str]], left: int = 2) -> list[str]:
    """Columns joined by two spaces; the first ``left`` and any ``|`` column left-aligned, others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left or c == "|" else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def describe(model: ModelSpec, cluster: Cluster, precision: str, osp: int) -> list[str]:
    formula = PRECISIONS[precision][0]
    k = {"fp32": osp, "mixed": 4 + osp, "bf16-true": osp / 2}[formula]
    what = {"fp32": "fp32 params and grads, master = params", "mixed": "16-bit params and grads, fp32 master",
            "bf16-true": "bf16 params, grads and optimizer state, no master"}[formula]
    name = f" ({model.name})" if model.name else ""
    return [
        f"Model: {format_count(model.num_params)} trainable parameters{name} = {model.num_params:.4g}",
        f"Precision: {precision} ({what}; optimizer K = {k:g} bytes/param)",
        f"Cluster: {cluster.world_size} ranks = {cluster.num_nodes} node(s) x {cluster.gpus_per_node} ranks/node",
    ]


def activation_line(acts: Activations | None, units: str) -> str:
    if acts is None:
        return ("Activations: not estimated (give --micro-batch with --layers, --hidden and --seq-len, "
                "or a --model preset).")
    attn = (", flash attention" if acts.flash_attention else "") + (
        f", t={acts.tensor_parallel}" if acts.tensor_parallel > 1 else "")
    return (f"Activations per rank (Korthikanti et al. 2022; L={acts.layers} h={acts.hidden} a={acts.heads} "
            f"s={acts.seq_len} b={acts.micro_batch}, {acts.bytes_per_element}-byte{attn}): "
            f"{format_bytes(acts.full, units)} without checkpointing, "
            f"{format_bytes(acts.checkpointed, units)} with full activation checkpointing.")


def wrap(text: str) -> str:
    return textwrap.fill(text, width=110, subsequent_indent="  ", break_on_hyphens=False)


def all_to_all_bytes(model: ModelSpec, ep: int, tokens: float, element_bytes: int) -> float:
    """Bytes one rank sends per micro-step through its MoE layers' all-to-alls (Note [all-to-all bytes] in
    moe/dispatch.py): ``4 x tokens x k x (p - 1) / p x hidden x element bytes`` per layer, routing uniform."""
    if ep <= 1 or not model.moe_layers or not model.top_k or not model.hidden:
        return 0.0
    return 4 * tokens * model.top_k * (ep - 1) / ep * model.hidden * element_bytes * model.moe_layers


def expert_parallel_lines(model: ModelSpec, cluster: Cluster, ep: int, acts: Activations | None,
                          units: str) -> list[str]:
    """What an expert-parallel rank holds and sends (Note [model state with EP] in ``core/common/memory.py``)."""
    experts, e = model.expert_params or 0.0, model.num_experts or 0
    line = (f"Experts: {format_count(experts)} of the parameters, {e} experts x {model.moe_layers} MoE layers, top-"
            f"{model.top_k}. ")
    if ep <= 1:
        return [wrap(line + "Every rank holds every expert (--expert-parallel N splits them).")]
    line += (f"Expert parallel {ep}: a rank holds {e // ep} expert(s) per layer ({format_count(experts / ep)} "
             f"parameters, ZeRO-partitioned over the {cluster.world_size // ep} ranks holding them) and every dense "
             "parameter (over all data ranks); stage 3 gathers a rank's own experts only.")
    if acts is not None:
        sent = all_to_all_bytes(model, ep, acts.micro_batch * acts.seq_len, acts.bytes_per_element)
        line += (f" The all-to-alls send {format_bytes(sent, units)} per rank and micro-step (4 x tokens x k x "
                 f"({ep}-1)/{ep} x hidden x bytes per layer, uniform routing).")
    return [wrap(line)]


def tensor_parallel_lines(model: ModelSpec, cluster: Cluster, tp: int) -> list[str]:
    """What a tensor-parallel rank holds (Note [model state with TP] in ``core/common/memory.py``)."""
    rep = model.replicated_params
    known = "" if rep is not None else " (replicated parameters unknown: every parameter taken as split; give " \
        "--replicated-params or a --model with a plan)"
    return [wrap(
        f"Tensor parallel: {tp} ranks per group, {cluster.world_size // tp} data-parallel ranks; a rank holds "
        f"Psi_split / {tp} + Psi_rep = {format_count(model.rank_params(tp))} parameters{known}. ZeRO partitions "
        "over the data ranks only; offload moves this rank's share of its slice's state.")]
