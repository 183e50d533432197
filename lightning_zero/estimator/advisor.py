"""Stage advisor: the fastest ZeRO configuration that fits the given hardware.

The advisor walks :data:`PREFERENCE` (fastest first), estimates each configuration with
:func:`lightning_zero.estimator.estimate_config` and takes the first whose device, CPU and NVMe
needs fit the memory given, less ``headroom``. Every memory need is linear in the parameter
count Ψ for a fixed architecture, so the largest model each configuration holds is found in
closed form from two evaluations.

Tensor parallelism (Note [TP as the last resort]): with ``tensor_parallel`` given, every configuration of
:data:`PREFERENCE` is estimated at that size, offload included (it composes with TP: a rank offloads its share of
its slice's state). Without it, when nothing fits, the advisor tries TP 2, 4, ... (dividing the world size and
the heads, within a node) with every configuration of :data:`PREFERENCE` and says why TP is what makes the model
fit: a layer whose 16-bit parameters and gradients exceed a rank (ZeRO shards a layer's storage but gathers it
whole to compute it), or model states ZeRO and offload cannot bring under the device memory.

Note [TP as the last resort]
    TP adds activation all-reduces inside every layer (Megatron: 4 per block per step) where ZeRO's traffic
    is per step and offload's is per step too; so TP is proposed only when no ZeRO stage or offload fits
    without it, at the smallest size that fits, and kept inside a node (its traffic is per layer). At that
    size every configuration is tried in :data:`PREFERENCE`'s order, offload included (offload composes with
    TP), so a TP + offload candidate (e.g. stage 2 + optimizer_cpu + TP 2) is chosen when no faster one fits at
    that size, before any larger TP size is tried.
"""

from __future__ import annotations

import math
import shlex
import tempfile
from dataclasses import dataclass, replace

from typing_extensions import Unpack

from lightning_zero.core.settings.offload import nvme_path_problem
from lightning_zero.estimator import (
    PRECISIONS,
    Activations,
    Cluster,
    ConfigEstimate,
    EstimateOptions,
    MemoryEstimate,
    ModelSpec,
    estimate_config,
    estimate_memory,
    format_bytes,
    format_count,
    parse_size,
)
from lightning_zero.estimator.report import activation_line, describe, grid, wrap

__all__ = ["PREFERENCE", "Advice", "Candidate", "Hardware", "Shortfall", "advise", "format_bytes", "format_count",
           "needs_of", "render_advice"]

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
    tensor_parallel: int = 1
    expert_parallel: int = 1

    @property
    def fits(self) -> bool:
        return not self.shortfalls

    @property
    def label(self) -> str:
        return (self.estimate.label + (f" + TP {self.tensor_parallel}" if self.tensor_parallel > 1 else "")
                + (f" + EP {self.expert_parallel}" if self.expert_parallel > 1 else ""))

    def overrides(self, precision: str, nvme_path: str | None = None) -> str:
        """Hydra overrides selecting this configuration, e.g. ``zero=stage2 offload=none precision=bf16``.

        Args:
            precision: the precision's user spelling (a key of :data:`PRECISIONS`).
            nvme_path: the directory for swap files, added as ``offload.nvme_path=...`` to an ``"nvme"``
                offload (default: the system's temporary directory).
        """
        e = self.estimate
        out = f"zero=stage{e.stage} offload={e.offload} precision={PRECISIONS[precision][1]}"
        if e.target == "nvme":
            out += f" offload.nvme_path={shlex.quote(nvme_path or tempfile.gettempdir())}"
        if self.tensor_parallel > 1:
            out += f" tensor_parallel.size={self.tensor_parallel}"
        if self.expert_parallel > 1:
            out += f" expert_parallel.size={self.expert_parallel}"
        return out


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
    nvme_path: str | None = None  # where "nvme" offload puts its swap files (None: the temporary directory)
    tensor_parallel_reason: str | None = None  # why TP is what makes it fit (Note [TP as the last resort])

    @property
    def choice(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def overrides(self) -> str | None:
        return None if self.choice is None else self.choice.overrides(self.precision, self.nvme_path)

    def nvme_path_problem(self) -> str | None:
        """Why the recommended ``"nvme"`` configuration's ``nvme_path`` cannot hold its state on this machine
        (:func:`~lightning_zero.core.settings.offload.nvme_path_problem`: exists, writable, the node's NVMe need free),
        or ``None`` (also when the choice does not use NVMe)."""
        choice = self.choice
        if choice is None or choice.estimate.target != "nvme":
            return None
        path = self.nvme_path or tempfile.gettempdir()
        return nvme_path_problem(path, dict(choice.needs)["NVMe"], "--nvme-path")

    def table(self, units: str = "GB") -> str:
        return render_advice(self, units)

    def __str__(self) -> str:
        return self.table()


def _max_params(stage: int, offload: str, spec: ModelSpec, cluster: Cluster, precision: str,
                acts: Activations | None, osp: int, hw: Hardware, checkpointing: bool, tp: int = 1,
                ep: int = 1) -> float:
    """Largest Ψ that fits: needs are affine in Ψ (same architecture, activations and largest layer; a MoE's expert
    share of Ψ kept)."""
    probe = 1e9
    share = (spec.expert_params or 0.0) / spec.num_params if spec.num_params else 0.0
    at = [dict(needs_of(estimate_config(stage, offload, replace(spec, num_params=x, expert_params=x * share or None),
                                        cluster, precision, acts, osp, tp, ep), checkpointing)) for x in (0.0, probe)]
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
    nvme_path: str | None = None,
    tensor_parallel: int | None = None,
    expert_parallel: int = 1,
    **options: Unpack[EstimateOptions],
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
        nvme_path: the directory an ``"nvme"`` choice's overrides name for its swap files (default: the
            system's temporary directory); :meth:`Advice.nvme_path_problem` checks it.
        tensor_parallel: advise at this tensor-parallel size; ``None``: none, and the smallest size that fits
            when nothing fits without it (Note [TP as the last resort]).
        expert_parallel: advise at this expert-parallel size (a MoE model; 1: none).
        options: the model, the cluster and the precision, as for
            :func:`lightning_zero.estimator.estimate_memory` (``model``, ``world_size``, ``num_nodes``,
            ``gpus_per_node``, ``precision``, ``micro_batch``, ``seq_len``, ``layers``, ``hidden``,
            ``heads``, ``flash_attention``, ``largest_layer_params``, ``optimizer_state_per_param``:
            :class:`~lightning_zero.estimator.EstimateOptions`).
    """
    hw = Hardware(parse_size(device_memory), parse_size(cpu_memory), parse_size(nvme), float(headroom))
    base = estimate_memory(num_params, offload="all", tensor_parallel=tensor_parallel or 1,
                           expert_parallel=expert_parallel, **options)
    candidates = _candidates(base, hw, activation_checkpointing)
    reason = None
    if tensor_parallel is None and expert_parallel == 1 and not any(c.fits for c in candidates):  # Note [TP as the
        # last resort]
        heads = options.get("heads") or base.model.heads
        for tp in _tensor_parallel_sizes(base.cluster, heads):
            with_tp = _candidates(estimate_memory(num_params, offload="all", tensor_parallel=tp, **options), hw,
                                  activation_checkpointing)
            candidates += with_tp
            if any(c.fits for c in with_tp):
                reason = _why_tensor_parallel(base, hw, tp)
                break
    return Advice(base.model, base.cluster, hw, base.precision, activation_checkpointing, base.activations,
                  candidates, base.optimizer_state_per_param, nvme_path, reason)


def _candidates(est: MemoryEstimate, hw: Hardware, checkpointing: bool) -> tuple[Candidate, ...]:
    """Each configuration of :data:`PREFERENCE` that ``est`` holds, checked against the hardware."""
    tp, ep = est.tensor_parallel, est.expert_parallel
    out = []
    for stage, offload in PREFERENCE:
        c = est.config(stage, offload)
        needs = needs_of(c, checkpointing)
        short = tuple(Shortfall(m, need, hw.usable(m)) for m, need in needs if need > hw.usable(m))
        biggest = _max_params(stage, offload, est.model, est.cluster, est.precision, est.activations,
                              est.optimizer_state_per_param, hw, checkpointing, tp, ep)
        out.append(Candidate(c, needs, short, biggest, tp, ep))
    return tuple(out)


def _tensor_parallel_sizes(cluster: Cluster, heads: int | None) -> list[int]:
    """TP sizes to try, smallest first: powers of two dividing the world size and the heads, within a node."""
    sizes, tp = [], 2
    while tp <= min(cluster.world_size, cluster.gpus_per_node):
        if cluster.world_size % tp == 0 and (not heads or heads % tp == 0):
            sizes.append(tp)
        tp *= 2
    return sizes


def layer_bytes(model: ModelSpec, precision: str) -> float:
    """The largest layer's parameters and gradients, whole, in the precision's parameter dtype: what computing
    it unsplit holds (ZeRO-3 gathers it whole)."""
    elem = 4 if PRECISIONS[precision][0] == "fp32" else 2
    return 2 * elem * (model.largest_layer_params or 0.0)


def _why_tensor_parallel(est: MemoryEstimate, hw: Hardware, tp: int) -> str:
    layer, usable = layer_bytes(est.model, est.precision), hw.usable("device")
    if layer > usable:
        return (f"the largest layer ({format_count(est.model.largest_layer_params or 0.0)} params) needs "
                f"{format_bytes(layer)} for its parameters and gradients whole, more than the {format_bytes(usable)} "
                "usable per rank: ZeRO shards a layer's storage but gathers it whole to compute it, tensor "
                f"parallelism splits it ({format_bytes(layer / tp)} per rank at TP {tp})")
    return (f"no ZeRO stage or offload brings the model states under the {format_bytes(usable)} usable per rank; TP "
            f"{tp} divides the split parameters' states (and the split activations) by {tp}")


def render_advice(adv: Advice, units: str = "GB") -> str:
    """The text ``lightning-zero advise`` prints."""
    hw = adv.hardware
    f = lambda n: "-" if n == 0 else format_bytes(n, units)  # noqa: E731
    lines = describe(adv.model, adv.cluster, adv.precision, adv.optimizer_state_per_param)
    lines += [
        f"Hardware: device {f(hw.device_memory)}/rank, CPU {f(hw.cpu_memory)}/node, NVMe {f(hw.nvme)}/node; "
        f"headroom {hw.headroom:.0%} of each kept free.",
        wrap(activation_line(adv.activations, units)),
    ]
    if adv.activations is not None:
        lines.append(f"Activation checkpointing is assumed {'on' if adv.checkpointing else 'off'} for the fit.")
    rows = [["#", "configuration", "device/rank", "cpu/node", "nvme/node", "fits", "largest model"]]
    for i, c in enumerate(adv.candidates, 1):
        need = dict(c.needs)
        rows.append([str(i), c.label, f(need["device"]), f(need["CPU"]), f(need["NVMe"]),
                     "yes" if c.fits else "no", format_count(c.max_params)])
    lines += ["", *grid(rows), ""]
    choice = adv.choice
    faster = adv.candidates if choice is None else adv.candidates[: adv.candidates.index(choice)]
    if choice is None:
        lines.append("Nothing fits. Add ranks or memory, shorten sequences / micro-batch, or enable checkpointing.")
        if layer_bytes(adv.model, adv.precision) > hw.usable("device"):
            lines.append(wrap(f"The largest layer alone needs {f(layer_bytes(adv.model, adv.precision))} for its "
                              "parameters and gradients whole, more than a rank: only tensor parallelism splits a "
                              "layer (--tensor-parallel, within a node)."))
    else:
        lines += [f"Recommended: {choice.label}",
                  f"Hydra overrides: {adv.overrides}"]
        if adv.tensor_parallel_reason:
            lines.append(wrap(f"Tensor parallelism is what makes it fit: {adv.tensor_parallel_reason}."))
    if faster:
        lines.append("Why not the faster options:" if choice else "Why each option does not fit:")
    for c in faster:
        why = "; ".join(
            f"{s.memory} memory short by {f(s.missing)} (needs {f(s.needed)}, {f(s.usable)} usable)"
            for s in c.shortfalls
        )
        lines.append(f"  {c.label}: {why}")
    lines.append("largest model: parameters each configuration holds on this hardware (same architecture).")
    return "\n".join(lines)
