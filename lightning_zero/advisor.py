"""Stage advisor: the fastest ZeRO configuration that fits the given hardware, and text reports.

The advisor walks :data:`PREFERENCE` (fastest first), estimates each configuration with
:func:`lightning_zero.estimator.estimate_config` and takes the first whose device, CPU and NVMe
needs fit the memory given, less ``headroom``. Every memory need is linear in the parameter
count Ψ for a fixed architecture, so the largest model each configuration holds is found in
closed form from two evaluations.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, replace

from torch import nn

from lightning_zero.estimator import (
    PRECISIONS,
    Activations,
    Cluster,
    ConfigEstimate,
    MemoryEstimate,
    ModelSpec,
    estimate_config,
    estimate_memory,
    parse_size,
)

# Fastest first: less partitioning means less communication; offload adds PCIe traffic and a CPU
# optimizer step; NVMe is slower than CPU memory.
PREFERENCE: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (1, "none"),
    (2, "none"),
    (2, "optimizer_cpu"),
    (3, "none"),
    (3, "optimizer_cpu"),
    (3, "param_cpu"),
    (3, "optimizer_nvme"),
    (3, "param_nvme"),
)


@dataclass(frozen=True)
class Hardware:
    """Memory available for training.

    Args:
        device_memory: bytes of accelerator memory per rank.
        cpu_memory: bytes of host memory per node.
        nvme: bytes of NVMe per node (0: none).
        headroom: fraction of each memory kept free for buffers, fragmentation, the CUDA context,
            the OS and whatever the estimate leaves out (activations when the shape is unknown).
    """

    device_memory: float
    cpu_memory: float
    nvme: float = 0.0
    headroom: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom is a fraction in [0, 1), e.g. 0.1 for 10%; got {self.headroom!r}.")

    def usable(self, memory: str) -> float:
        """Bytes usable of ``memory`` (``"device"``, ``"CPU"`` or ``"NVMe"``) after the headroom."""
        total = {"device": self.device_memory, "CPU": self.cpu_memory, "NVMe": self.nvme}[memory]
        return total * (1.0 - self.headroom)


@dataclass(frozen=True)
class Shortfall:
    """One memory a configuration does not fit in."""

    memory: str
    needed: float
    usable: float

    @property
    def missing(self) -> float:
        return self.needed - self.usable


@dataclass(frozen=True)
class Candidate:
    """One configuration of the preference list, checked against the hardware."""

    estimate: ConfigEstimate
    needs: tuple[tuple[str, float], ...]  # (memory, bytes): device per rank, CPU and NVMe per node
    shortfalls: tuple[Shortfall, ...]
    max_params: float  # largest Ψ this configuration holds on the hardware (inf: no limit)

    @property
    def fits(self) -> bool:
        return not self.shortfalls

    def overrides(self, precision: str) -> str:
        """Hydra overrides selecting this configuration, e.g. ``zero=stage2 offload=none precision=bf16``."""
        e = self.estimate
        return f"zero=stage{e.stage} offload={e.offload} precision={PRECISIONS[precision][1]}"


def needs_of(c: ConfigEstimate, checkpointing: bool) -> tuple[tuple[str, float], ...]:
    """Device bytes per rank, CPU and NVMe bytes per node of one configuration."""
    return (
        ("device", c.device_total(checkpointing)),
        ("CPU", c.cpu_bytes * c.ranks_per_node),
        ("NVMe", c.nvme_bytes * c.ranks_per_node),
    )


@dataclass(frozen=True)
class Advice:
    """Result of :func:`advise`; ``choice`` is ``None`` when nothing fits."""

    model: ModelSpec
    cluster: Cluster
    hardware: Hardware
    precision: str
    checkpointing: bool
    activations: Activations | None
    candidates: tuple[Candidate, ...]
    optimizer_state_per_param: int = 8

    @property
    def choice(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def overrides(self) -> str | None:
        return None if self.choice is None else self.choice.overrides(self.precision)

    def table(self, units: str = "GB") -> str:
        return render_advice(self, units)

    def __str__(self) -> str:
        return self.table()


def _max_params(stage: int, offload: str, spec: ModelSpec, cluster: Cluster, precision: str,
                acts: Activations | None, osp: int, hw: Hardware, checkpointing: bool) -> float:
    """Largest Ψ that fits: needs are affine in Ψ (same architecture, activations and largest layer)."""
    probe = 1e9
    at = [dict(needs_of(estimate_config(stage, offload, replace(spec, num_params=x), cluster, precision, acts, osp),
                        checkpointing)) for x in (0.0, probe)]
    best = math.inf
    for memory, fixed in at[0].items():
        slope = (at[1][memory] - fixed) / probe
        room = hw.usable(memory) - fixed
        if room < 0:
            return 0.0
        if slope > 0:
            best = min(best, room / slope)
    return best


def advise(
    num_params: float | str | None = None,
    *,
    device_memory: float | str,
    cpu_memory: float | str = 0.0,
    nvme: float | str = 0.0,
    headroom: float = 0.1,
    activation_checkpointing: bool = False,
    model: str | nn.Module | None = None,
    world_size: int | None = None,
    num_nodes: int | None = None,
    gpus_per_node: int | None = None,
    precision: str = "mixed",
    micro_batch: int | None = None,
    seq_len: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    flash_attention: bool = False,
    largest_layer_params: float | None = None,
    optimizer_state_per_param: int = 8,
) -> Advice:
    """The fastest configuration of :data:`PREFERENCE` that fits, with why each faster one does not.

    Args:
        num_params: Ψ (number or text like ``"7.5B"``); or give ``model``.
        device_memory: accelerator memory per rank, bytes or text (``"80GB"``, ``"80GiB"``).
        cpu_memory: host memory per node.
        nvme: NVMe capacity per node (0: none, NVMe options never fit).
        headroom: fraction of each memory left free (see :class:`Hardware`).
        activation_checkpointing: count checkpointed activations instead of full ones (only
            when the transformer shape is known).
        model, world_size, num_nodes, gpus_per_node, precision, micro_batch, seq_len, layers,
        hidden, heads, flash_attention, largest_layer_params, optimizer_state_per_param: as for
            :func:`lightning_zero.estimator.estimate_memory`.
    """
    hw = Hardware(parse_size(device_memory), parse_size(cpu_memory), parse_size(nvme), float(headroom))
    base = estimate_memory(
        num_params, model=model, world_size=world_size, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
        precision=precision, micro_batch=micro_batch, seq_len=seq_len, layers=layers, hidden=hidden, heads=heads,
        flash_attention=flash_attention, largest_layer_params=largest_layer_params,
        optimizer_state_per_param=optimizer_state_per_param,
    )
    candidates = []
    for stage, offload in PREFERENCE:
        c = base.config(stage, offload)
        needs = needs_of(c, activation_checkpointing)
        short = tuple(Shortfall(m, need, hw.usable(m)) for m, need in needs if need > hw.usable(m))
        biggest = _max_params(stage, offload, base.model, base.cluster, precision, base.activations,
                              optimizer_state_per_param, hw, activation_checkpointing)
        candidates.append(Candidate(c, needs, short, biggest))
    return Advice(base.model, base.cluster, hw, precision, activation_checkpointing, base.activations,
                  tuple(candidates), optimizer_state_per_param)


# ---------------------------------------------------------------------------------------- text
def format_bytes(n: float, units: str = "GB") -> str:
    """``n`` bytes with 3 significant digits in decimal (``"GB"``) or binary (``"GiB"``) units."""
    if units not in ("GB", "GiB"):
        raise ValueError(f"units must be 'GB' (10^9 bytes) or 'GiB' (2^30 bytes), got {units!r}.")
    base, names = (1000.0, ("B", "kB", "MB", "GB", "TB", "PB")) if units == "GB" else (
        1024.0, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
    value, i = float(n), 0
    while i < len(names) - 1 and float(f"{value:.3g}") >= 1000:
        value, i = value / base, i + 1
    return f"{value:.3g} {names[i]}"


def format_count(n: float) -> str:
    """A parameter count, e.g. ``7.5B``, ``124M`` (B = 10^9)."""
    if math.isinf(n):
        return "unlimited"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.3g}"


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
                  f"Hydra overrides: {choice.overrides(adv.precision)}"]
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
