"""The estimate itself: per-rank device, CPU and NVMe bytes of ZeRO stages 0-3, with and without offload.

Model states come from :func:`lightning_zero.core.common.memory.model_state_formula` (the ZeRO paper's
2Ψ + 2Ψ + KΨ, partitioned by stage) and its offload split
:func:`~lightning_zero.core.common.memory.offloaded_model_state` -- the same functions the strategy's
measured memory is tested against. Activations follow Korthikanti et al. (2022), see
:func:`activation_memory`. DeepSpeed's own estimator figures are reproduced beside ours by
:func:`deepspeed_figures`. The stage advisor lives in :mod:`lightning_zero.estimator.advisor`; the
pieces of text this estimate's table shares with the advisor's are in :mod:`lightning_zero.estimator.report`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypedDict

from torch import nn

from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.common.memory import OFFLOAD_STAGES, ModelStateBytes, offloaded_model_state
from lightning_zero.estimator.activations import Activations, activation_memory
from lightning_zero.estimator.cluster import Cluster, make_cluster
from lightning_zero.estimator.deepspeed_figures import DeepSpeedFigures, deepspeed_figures
from lightning_zero.estimator.model_spec import ModelSpec, resolve_model
from lightning_zero.estimator.options import OFFLOADS, PRECISIONS, formula_precision
from lightning_zero.estimator.report import (
    activation_line,
    describe,
    expert_parallel_lines,
    grid,
    tensor_parallel_lines,
    wrap,
)
from lightning_zero.estimator.sizes import format_bytes, format_count, parse_count
from lightning_zero.estimator.working_set import (
    PROCESS_OVERHEAD_BYTES,
    StepIO,
    StreamSettings,
    WorkingSet,
    step_io,
    working_set,
)


@dataclass(frozen=True)
class ConfigEstimate:
    """Per-rank memory of one (stage, offload) configuration.

    Args:
        stage: ZeRO stage.
        offload: offload option.
        on_device: model state kept on the device.
        offloaded: model state moved to CPU or NVMe (empty without offload).
        working: stage 3: one largest layer's 16-bit params and grads gathered whole (0 if unknown).
        activations: activation memory, when the shape is known.
        deepspeed: DeepSpeed's figures, where it has an estimator.
        ranks_per_node: for the per-node CPU / NVMe totals.
        working_set: stage 3 on a CPU host or with disk offload, when the model's units are known: what a step
            holds besides model state (Note [working set] in ``working_set.py``); ``working`` is its total less
            the activations.
        step_io: stage 3 with ``param_nvme``: swap-file bytes per step and on disk.
        cpu_host: ranks are CPU processes: "device" is their host memory, which holds the process itself and
            a ``"cpu"`` offload's state too.
    """

    stage: int
    offload: str
    on_device: ModelStateBytes
    offloaded: ModelStateBytes
    working: float
    activations: Activations | None
    deepspeed: DeepSpeedFigures | None
    ranks_per_node: int
    working_set: WorkingSet | None = None
    step_io: StepIO | None = None
    cpu_host: bool = False

    @property
    def label(self) -> str:
        return f"stage {self.stage}" + ("" if self.offload == "none" else f" + {self.offload}")

    @property
    def target(self) -> str | None:
        """``"cpu"``, ``"nvme"`` or ``None``: where the offloaded state lives."""
        return None if self.offload == "none" else self.offload.rsplit("_", 1)[1]

    @property
    def device_bytes(self) -> float:
        """Model states on the device plus the stage-3 working memory (a CPU host: plus the process and a
        ``"cpu"`` offload's state, all in the same memory); no activations."""
        return self.on_device.model_states + self.working + (self.cpu_bytes if self.cpu_host else 0.0)

    def device_total(self, checkpointing: bool = False) -> float:
        """Device bytes including activations (with or without activation checkpointing)."""
        acts = self.activations
        return self.device_bytes + (0.0 if acts is None else acts.checkpointed if checkpointing else acts.full)

    @property
    def cpu_bytes(self) -> float:
        return self.offloaded.model_states if self.target == "cpu" else 0.0

    @property
    def nvme_bytes(self) -> float:
        return self.offloaded.model_states if self.target == "nvme" else 0.0


def estimate_config(
    stage: int, offload: str, model: ModelSpec, cluster: Cluster, precision: str = "mixed",
    activations: Activations | None = None, optimizer_state_per_param: int = 8, tensor_parallel: int = 1,
    expert_parallel: int = 1, cpu_host: bool = False, stream: StreamSettings | None = None,
) -> ConfigEstimate:
    """Estimate one configuration; see :func:`estimate_memory` for the arguments.

    With ``tensor_parallel`` = t > 1 a rank holds ``model.rank_params(t)`` parameters (Note [model state with
    TP]) and ZeRO partitions them over the ``world / t`` data ranks; stage 3 gathers a layer's slice, not the
    layer. Offload composes with TP as in the strategy (the engine offloads the shards of the rank's flat buffers):
    the offload split applies to the rank's own parameters, so a rank offloads its share, over the data ranks, of
    the optimizer state (and, with ``param_*``, the parameters) of its TP slice.

    Stage 3 with disk offload, or any stage 3 row on a CPU host (``cpu_host``), counts the working set of Note
    [working set] from the model's units (``stream``: the settings that size it) where they are known; a CPU
    host counts the process itself on every row.

    With ``expert_parallel`` = p > 1 a rank holds ``1/p`` of the expert parameters (its experts) and every dense
    one; ZeRO partitions the dense ones over the ``world`` data ranks and its experts over the ``world / p`` ranks
    holding them (Note [model state with EP] in core/common/memory.py), offload rows too; stage 3 gathers a
    rank's experts only.
    """
    formula = formula_precision(precision)
    data = cluster.world_size // tensor_parallel
    experts = model.expert_params or 0.0 if expert_parallel > 1 else 0.0
    on_device, moved = offloaded_model_state(
        stage, model.rank_params(tensor_parallel) - experts, data, formula, offload, optimizer_state_per_param
    )
    if experts:
        kept, gone = offloaded_model_state(stage, experts / expert_parallel, data // expert_parallel, formula,
                                           offload, optimizer_state_per_param)
        on_device, moved = _plus(on_device, kept), _plus(moved, gone)
    elem = 4 if formula == "fp32" else 2
    layer = model.rank_largest_layer(tensor_parallel, expert_parallel)
    sharded = ZeroStage.of(stage).shards_parameters
    working = 2 * elem * layer if sharded else 0.0
    ws = io = None
    nvme = offload.endswith("_nvme")
    if sharded and (nvme or cpu_host) and model.unit_params and tensor_parallel == 1 and expert_parallel == 1:
        settings = stream or StreamSettings()
        if not nvme:
            settings = replace(settings, buffer_sets=0)  # no swap buffers
        master = 2 if formula == "bf16-true" else 4
        ws = working_set(model, data, elem, activations, settings, cpu_host, master)
        if cpu_host:  # on a GPU the swap buffers are pinned host memory and the units stream as with param_cpu
            working = ws.total - ws.activations
        if offload == "param_nvme":
            io = step_io(model, data, elem, settings, master)
    elif cpu_host:
        working += PROCESS_OVERHEAD_BYTES
    ds = None
    if formula == "mixed" and tensor_parallel == 1 and expert_parallel == 1:  # DeepSpeed's take no TP / EP size
        ds = deepspeed_figures(stage, offload, model.num_params, model.largest_layer_params or 0.0, cluster)
    return ConfigEstimate(stage, offload, on_device, moved, working, activations, ds, cluster.gpus_per_node, ws, io,
                          cpu_host)


def _plus(a: ModelStateBytes, b: ModelStateBytes) -> ModelStateBytes:
    return ModelStateBytes(params=a.params + b.params, grads=a.grads + b.grads, optimizer=a.optimizer + b.optimizer)


@dataclass(frozen=True)
class MemoryEstimate:
    """Result of :func:`estimate_memory`: one :class:`ConfigEstimate` per (stage, offload)."""

    model: ModelSpec
    cluster: Cluster
    precision: str
    optimizer_state_per_param: int
    activations: Activations | None
    configs: tuple[ConfigEstimate, ...]
    tensor_parallel: int = 1
    accelerator: str = "gpu"
    stream: StreamSettings | None = None
    expert_parallel: int = 1

    def config(self, stage: int, offload: str = "none") -> ConfigEstimate:
        """The row for ``stage`` and ``offload``."""
        for c in self.configs:
            if c.stage == stage and c.offload == offload:
                return c
        raise KeyError(f"No estimate for stage {stage} with offload {offload!r} in this result.")

    def table(self, units: str = "GB") -> str:
        """The estimate as text (``units``: ``"GB"`` = 10^9 bytes or ``"GiB"`` = 2^30 bytes)."""
        return render_estimate(self, units)

    def __str__(self) -> str:
        return self.table()


class EstimateOptions(TypedDict, total=False):
    """The keyword arguments of :func:`estimate_memory` (less ``offload``): what is estimated, on how
    many ranks, in which precision; :func:`lightning_zero.estimator.advisor.advise` takes them as ``**options``."""

    model: str | nn.Module | None
    world_size: int | None
    num_nodes: int | None
    gpus_per_node: int | None
    precision: str
    micro_batch: int | None
    seq_len: int | None
    layers: int | None
    hidden: int | None
    heads: int | None
    flash_attention: bool
    largest_layer_params: float | None
    optimizer_state_per_param: int
    replicated_params: float | None
    accelerator: str
    stream: StreamSettings | None


def estimate_memory(
    num_params: float | str | None = None,
    *,
    model: str | nn.Module | None = None,
    world_size: int | None = None,
    num_nodes: int | None = None,
    gpus_per_node: int | None = None,
    precision: str = "mixed",
    offload: str = "all",
    micro_batch: int | None = None,
    seq_len: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    flash_attention: bool = False,
    largest_layer_params: float | None = None,
    optimizer_state_per_param: int = 8,
    replicated_params: float | None = None,
    tensor_parallel: int = 1,
    accelerator: str = "gpu",
    stream: StreamSettings | None = None,
    expert_parallel: int = 1,
) -> MemoryEstimate:
    """Per-rank memory of ZeRO stages 0-3, without offload and with each valid offload.

    Args:
        num_params: Ψ (a number, or text such as ``"7.5e9"`` / ``"7.5B"``); or give ``model``.
        model: preset name, ``nn.Module`` or ``"module.path:ClassOrFactory"`` (counted on meta).
        world_size, num_nodes, gpus_per_node: the data-parallel layout (see :func:`make_cluster`).
        precision: ``fp32``, ``mixed`` / ``bf16-mixed`` / ``16-mixed`` or ``bf16-true``.
        offload: ``"all"`` for every valid offload option, or one option (rows without offload
            are always included).
        micro_batch, seq_len, layers, hidden, heads: transformer shape for activation memory
            (a preset fills in layers, hidden, heads and seq_len).
        flash_attention: attention scores are not stored (see :func:`activation_memory`).
        largest_layer_params: parameters of the largest module, for stage 3's gathered layer.
        optimizer_state_per_param: fp32 bytes of optimizer state per parameter (Adam: 8, SGD
            with momentum: 4).
        replicated_params: parameters tensor parallelism keeps whole on every rank (default: counted from
            ``model``'s plan, else 0).
        tensor_parallel: ranks per tensor-parallel group t; ``world_size`` counts every rank, so ZeRO
            partitions over ``world_size / t`` data ranks, offload rows included (DeepSpeed's figures are not:
            its estimators take no tensor-parallel size).
        accelerator: ``"gpu"`` (device memory per rank beside host memory) or ``"cpu"``: the ranks are CPU
            processes, "device" is each one's host memory (the process itself and a ``"cpu"`` offload's state in
            it too) and stage 3's working set is counted (Note [working set] in ``working_set.py``).
        stream: the settings that size stage 3's working set (default: the strategy's).
        expert_parallel: ranks per expert-parallel group p: a MoE model's experts split over p data ranks
            (the model must have MoE layers: a ``--model`` with them, e.g. ``mixtral-8x7b``).
    """
    if accelerator not in ("gpu", "cpu"):
        raise ValueError(f"accelerator must be 'gpu' or 'cpu', got {accelerator!r}")
    if (num_params is None) == (model is None):
        raise ValueError("Give exactly one of the parameter count (--params) and the model (--model).")
    spec = resolve_model(model) if model is not None else ModelSpec(parse_count(num_params))  # type: ignore[arg-type]
    if largest_layer_params is not None:  # given: whether it is split is unknown, so it is taken as split
        spec = replace(spec, largest_layer_params=parse_count(largest_layer_params))
    if replicated_params is not None:
        rep = float(replicated_params)
        if not 0 <= rep <= spec.num_params:
            raise ValueError(f"--replicated-params {replicated_params!r} must be between 0 and the model's "
                             f"{spec.num_params:.4g} parameters")
        spec = replace(spec, replicated_params=rep)
    if offload != "all" and offload not in OFFLOADS:
        raise ValueError(f"Unknown offload {offload!r}; use 'all' or one of {', '.join(OFFLOADS)}.")
    cluster = make_cluster(world_size, num_nodes, gpus_per_node)
    formula_precision(precision)
    layers, hidden, heads = layers or spec.layers, hidden or spec.hidden, heads or spec.heads
    check_tensor_parallel(tensor_parallel, cluster, heads)
    check_expert_parallel(expert_parallel, tensor_parallel, cluster, spec)
    seq_len = seq_len or spec.seq_len
    acts = None
    if micro_batch is not None:
        missing = [flag for flag, v in (("--layers", layers), ("--hidden", hidden), ("--seq-len", seq_len)) if not v]
        if missing:
            raise ValueError(f"Activation memory for --micro-batch {micro_batch} also needs {', '.join(missing)} "
                             "(or a --model preset that knows the shape).")
        elem = 4 if formula_precision(precision) == "fp32" else 2
        acts = activation_memory(layers, hidden, seq_len, micro_batch, heads, elem, flash_attention, tensor_parallel)
    configs = tuple(
        estimate_config(stage, off, spec, cluster, precision, acts, optimizer_state_per_param, tensor_parallel,
                        expert_parallel, accelerator == "cpu", stream)
        for stage in range(4)
        for off in OFFLOADS
        if stage in OFFLOAD_STAGES[off] and (offload == "all" or off in ("none", offload))
    )
    return MemoryEstimate(spec, cluster, precision, optimizer_state_per_param, acts, configs, tensor_parallel,
                          accelerator, stream, expert_parallel)


def check_expert_parallel(expert_parallel: int, tensor_parallel: int, cluster: Cluster, model: ModelSpec) -> None:
    """Refuse an expert-parallel size the strategy would refuse: not a positive integer, not dividing the data ranks
    or the experts, with tensor parallelism, or for a model without MoE layers."""
    if int(expert_parallel) != expert_parallel or expert_parallel < 1:
        raise ValueError(f"--expert-parallel must be a positive integer (e.g. 2), got {expert_parallel!r}")
    if expert_parallel == 1:
        return
    if tensor_parallel > 1:
        raise ValueError("--expert-parallel with --tensor-parallel is not built yet: give one of them")
    if not model.expert_params:
        raise ValueError("--expert-parallel needs a model with MoE layers (a --model preset such as mixtral-8x7b, or "
                         "a module with lightning_zero.moe layers or a Hugging Face MoE)")
    if cluster.world_size % expert_parallel or (model.num_experts or 0) % expert_parallel:
        raise ValueError(f"--expert-parallel {expert_parallel} must divide the world size {cluster.world_size} and the "
                         f"{model.num_experts} experts per layer")


def check_tensor_parallel(tensor_parallel: int, cluster: Cluster, heads: int | None) -> None:
    """Refuse a tensor-parallel size the strategy would refuse: not a positive integer, not dividing the world
    size, or not dividing the attention heads."""
    if int(tensor_parallel) != tensor_parallel or tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be a positive integer (e.g. 2), got {tensor_parallel!r}")
    if cluster.world_size % tensor_parallel:
        raise ValueError(f"world size {cluster.world_size} is not a multiple of --tensor-parallel {tensor_parallel}: "
                         "the world is tensor x data ranks; choose a size dividing the world size")
    if heads and heads % tensor_parallel:
        raise ValueError(f"{heads} attention heads do not split over --tensor-parallel {tensor_parallel}: choose a "
                         "size dividing the heads")


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
    big = est.model.rank_largest_layer(est.tensor_parallel, est.expert_parallel)
    lines = describe(est.model, est.cluster, est.precision, est.optimizer_state_per_param)
    if est.tensor_parallel > 1:
        lines += tensor_parallel_lines(est.model, est.cluster, est.tensor_parallel)
    if est.model.expert_params:
        lines += expert_parallel_lines(est.model, est.cluster, est.expert_parallel, est.activations, units)
    lines += [
        "",
        f"Per-rank memory (ZeRO paper model states; {unit_note}). device = params + grads + optim kept on the",
        "device" + (f" + stage 3's gathered largest layer ({format_count(big)} params, 16-bit params+grads)"
                    if big else " (stage 3's gathered layer not included: largest layer unknown)") + "."
        + (" Stage 3 with nvme: its working set (below)." if any(c.working_set for c in est.configs) else ""),
        *(["CPU host: device = each rank's host memory (the process and cpu offload included)."]
          if est.accelerator == "cpu" else []),
        "",
        *grid(rows),
        "",
        "Offload: optimizer_* moves master + optimizer state + an fp32 gradient partition to CPU/NVMe (stages 2-3",
        "keep no gradient on the device); param_* moves the parameter shard too (stage 3). cpu/nvme are per rank.",
        activation_line(est.activations, units),
    ]
    lines += working_set_lines(est, units)
    if est.tensor_parallel > 1 or est.expert_parallel > 1:
        lines.append("DeepSpeed's: its estimators take no tensor-parallel size (nor an expert-parallel one), so they "
                     "are not shown with TP / EP")
    elif PRECISIONS[est.precision][0] == "mixed":
        lines.append(
            "DeepSpeed's: figures of DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (zero_init=True, "
            "additional_buffer_factor=1.5, largest layer "
            + (f"{format_count(big)} params" if big else "unknown: 0 assumed, give --largest-layer or --model")
            + "); cpu per node; '-': DeepSpeed has no estimator for that row."
        )
    else:
        lines.append("DeepSpeed's: its estimators assume mixed precision, so they are not shown for " + est.precision)
    return "\n".join(lines[:-2] + [wrap(line) for line in lines[-2:]])


def working_set_lines(est: MemoryEstimate, units: str = "GB") -> list[str]:
    """The working set of stage 3 + ``param_nvme`` (else + ``optimizer_nvme``), its parts and its disk traffic."""
    rows = [c for c in est.configs if c.working_set is not None and c.stage == 3]
    row = next((c for c in rows if c.offload == "param_nvme"), next(iter(rows), None))
    if row is None or row.working_set is None:
        return []
    ws, f = row.working_set, (lambda n: format_bytes(n, units))
    s = est.stream or StreamSettings()
    out = [
        "",
        wrap(f"Working set of stage 3 + {row.offload}, per rank (Note [working set]; prefetch_bucket_size "
             f"{s.prefetch_bucket_size:.3g}, reduce_bucket_size {s.reduce_bucket_size:.3g}, sub_group_size "
             f"{s.sub_group_size:.3g}): {f(ws.total)}"),
        f"  gathered units  {f(ws.gathered)}  (root + running unit of {format_count(est.model.unit_params or 0)} "
        f"params + {ws.units_ahead} ahead or kept)",
        f"  gradient        {f(ws.grads)}  (largest parameter, before it is staged)",
        f"  reduce buffers  {f(ws.buckets)}  (messages of {format_count(ws.message)} elements: 3 staging, 2 received)",
        f"  activations     {f(ws.activations)}",
        f"  swap buffers    {f(ws.swap_buffers)}  (the optimizer's sub-groups, pipelined)",
    ]
    if ws.overhead:
        out.append(f"  process         {f(ws.overhead)}  (Python, torch, Lightning, gloo: measured once)")
    io = row.step_io
    if io is not None:
        out.append(wrap(f"Disk per rank: {f(io.disk)} (parameter, gradient and optimizer shards); per step it reads "
                        f"{f(io.read)} and writes {f(io.written)} of swap files."))
    return out
