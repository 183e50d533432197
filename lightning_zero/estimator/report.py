"""The text reports ``lightning-zero estimate`` and ``lightning-zero advise`` print."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from lightning_zero.estimator.options import PRECISIONS
from lightning_zero.estimator.sizes import format_bytes, format_count

if TYPE_CHECKING:
    from lightning_zero.estimator.activations import Activations
    from lightning_zero.estimator.advisor import Advice
    from lightning_zero.estimator.cluster import Cluster
    from lightning_zero.estimator.estimate import MemoryEstimate
    from lightning_zero.estimator.model_spec import ModelSpec


def _grid(rows: list[list[str]], left: int = 2) -> list[str]:
    """Columns joined by two spaces; the first ``left`` and any ``|`` column left-aligned, others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left or c == "|" else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def _describe(model: ModelSpec, cluster: Cluster, precision: str, osp: int) -> list[str]:
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


def _activation_line(acts: Activations | None, units: str) -> str:
    if acts is None:
        return ("Activations: not estimated (give --micro-batch with --layers, --hidden and --seq-len, "
                "or a --model preset).")
    attn = ", flash attention" if acts.flash_attention else ""
    return (f"Activations per rank (Korthikanti et al. 2022; L={acts.layers} h={acts.hidden} a={acts.heads} "
            f"s={acts.seq_len} b={acts.micro_batch}, {acts.bytes_per_element}-byte{attn}): "
            f"{format_bytes(acts.full, units)} without checkpointing, "
            f"{format_bytes(acts.checkpointed, units)} with full activation checkpointing.")


def render_estimate(est: MemoryEstimate, units: str = "GB") -> str:
    """The text ``lightning-zero estimate`` prints."""
    f = lambda n: "-" if n == 0 else format_bytes(n, units)  # noqa: E731
    acts = est.activations is not None
    head = ["stage", "offload", "device", "params", "grads", "optim", "cpu", "nvme", "cpu/node", "nvme/node"]
    head += ["+act", "+act(ckpt)"] if acts else []
    head += ["|", "DeepSpeed's: device", "cpu/node"]
    rows = [head]
    for c in est.configs:
        d = c.on_device
        row = [str(c.stage), c.offload, f(c.device_bytes), f(d.params), f(d.grads), f(d.optimizer), f(c.cpu_bytes),
               f(c.nvme_bytes), f(c.cpu_bytes * c.ranks_per_node), f(c.nvme_bytes * c.ranks_per_node)]
        row += [f(c.device_total(False)), f(c.device_total(True))] if acts else []
        ds = c.deepspeed
        ds_cells = ["-", "-"] if ds is None else [format_bytes(ds.device, units), format_bytes(ds.cpu_per_node, units)]
        row += ["|", *ds_cells]
        rows.append(row)
    unit_note = "GB = 10^9 bytes" if units == "GB" else "GiB = 2^30 bytes"
    big = est.model.largest_layer_params
    lines = _describe(est.model, est.cluster, est.precision, est.optimizer_state_per_param)
    lines += [
        "",
        f"Per-rank memory (ZeRO paper model states; {unit_note}). device = params + grads + optim kept on the",
        "device" + (f" + stage 3's gathered largest layer ({format_count(big)} params, 16-bit params+grads)"
                    if big else " (stage 3's gathered layer not included: largest layer unknown)") + ".",
        "",
        *_grid(rows),
        "",
        "Offload: optimizer_* moves master + optimizer state + an fp32 gradient partition to CPU/NVMe (stages 2-3",
        "keep no gradient on the device); param_* moves the parameter shard too (stage 3). cpu/nvme are per rank.",
        _activation_line(est.activations, units),
    ]
    if PRECISIONS[est.precision][0] == "mixed":
        lines.append(
            "DeepSpeed's: figures of DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (zero_init=True, "
            "additional_buffer_factor=1.5, largest layer "
            + (f"{format_count(big)} params" if big else "unknown: 0 assumed, give --largest-layer or --model")
            + "); cpu per node; '-': DeepSpeed has no estimator for that row."
        )
    else:
        lines.append("DeepSpeed's: its estimators assume mixed precision, so they are not shown for " + est.precision)
    return "\n".join(lines[:-2] + [_wrap(line) for line in lines[-2:]])


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=110, subsequent_indent="  ", break_on_hyphens=False)


def render_advice(adv: Advice, units: str = "GB") -> str:
    """The text ``lightning-zero advise`` prints."""
    hw = adv.hardware
    f = lambda n: "-" if n == 0 else format_bytes(n, units)  # noqa: E731
    lines = _describe(adv.model, adv.cluster, adv.precision, adv.optimizer_state_per_param)
    lines += [
        f"Hardware: device {f(hw.device_memory)}/rank, CPU {f(hw.cpu_memory)}/node, NVMe {f(hw.nvme)}/node; "
        f"headroom {hw.headroom:.0%} of each kept free.",
        _wrap(_activation_line(adv.activations, units)),
    ]
    if adv.activations is not None:
        lines.append(f"Activation checkpointing is assumed {'on' if adv.checkpointing else 'off'} for the fit.")
    rows = [["#", "configuration", "device/rank", "cpu/node", "nvme/node", "fits", "largest model"]]
    for i, c in enumerate(adv.candidates, 1):
        need = dict(c.needs)
        rows.append([str(i), c.estimate.label, f(need["device"]), f(need["CPU"]), f(need["NVMe"]),
                     "yes" if c.fits else "no", format_count(c.max_params)])
    lines += ["", *_grid(rows), ""]
    choice = adv.choice
    faster = adv.candidates if choice is None else adv.candidates[: adv.candidates.index(choice)]
    if choice is None:
        lines.append("Nothing fits. Add ranks or memory, shorten sequences / micro-batch, or enable checkpointing.")
    else:
        lines += [f"Recommended: {choice.estimate.label}",
                  f"Hydra overrides: {adv.overrides}"]
    if faster:
        lines.append("Why not the faster options:" if choice else "Why each option does not fit:")
    for c in faster:
        why = "; ".join(
            f"{s.memory} memory short by {f(s.missing)} (needs {f(s.needed)}, {f(s.usable)} usable)"
            for s in c.shortfalls
        )
        lines.append(f"  {c.estimate.label}: {why}")
    lines.append("largest model: parameters each configuration holds on this hardware (same architecture).")
    return "\n".join(lines)
