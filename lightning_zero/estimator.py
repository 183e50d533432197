"""Memory estimator: per-rank device, CPU and NVMe bytes of ZeRO stages 0-3, with and without offload.

Model states come from :func:`lightning_zero.core.memory.model_state_formula` (the ZeRO paper's
2Ψ + 2Ψ + KΨ, partitioned by stage) and its offload split
:func:`~lightning_zero.core.memory.offloaded_model_state` -- the same functions the strategy's
measured memory is tested against. Activations follow Korthikanti et al. (2022), see
:func:`activation_memory`. DeepSpeed's own estimator figures are reproduced beside ours by
:func:`deepspeed_figures`. The stage advisor lives in :mod:`lightning_zero.advisor`.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_zero.core.memory import OFFLOAD_STAGES, ModelStateBytes, offloaded_model_state

# user spelling -> (formula precision of model_state_formula, Hydra `precision/` option)
PRECISIONS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "32-true": ("fp32", "fp32"),
    "mixed": ("mixed", "bf16"),
    "bf16-mixed": ("mixed", "bf16"),
    "bf16": ("mixed", "bf16"),
    "16-mixed": ("mixed", "fp16"),
    "fp16": ("mixed", "fp16"),
    "bf16-true": ("bf16-true", "bf16_true"),
    "bf16_true": ("bf16-true", "bf16_true"),
}
OFFLOADS: tuple[str, ...] = tuple(OFFLOAD_STAGES)


@dataclass(frozen=True)
class ModelSpec:
    """What the estimate knows about the model. Unknown fields are ``None``.

    Args:
        num_params: Ψ, trainable parameters (frozen ones are not counted).
        name: preset name or import path it came from.
        layers, hidden, heads, seq_len: transformer shape, for activation memory.
        largest_layer_params: parameters of the largest single module (its own, not its
            children's): the layer stage 3 must gather whole.
    """

    num_params: float
    name: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    largest_layer_params: float | None = None


def _gpt2_params(layers: int, hidden: int, vocab: int = 50257, positions: int = 1024) -> int:
    return vocab * hidden + positions * hidden + layers * (12 * hidden**2 + 13 * hidden) + 2 * hidden


def _llama_params(layers: int, hidden: int, ffn: int, vocab: int = 32000) -> int:
    return 2 * vocab * hidden + layers * (4 * hidden**2 + 3 * hidden * ffn + 2 * hidden) + hidden


def _preset(name: str, params: int, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> ModelSpec:
    return ModelSpec(float(params), name, layers, hidden, heads, seq, float(vocab * hidden))


# Parameter counts from the architectures' formulas (tied GPT-2 embeddings; untied Llama head).
PRESETS: dict[str, ModelSpec] = {
    p.name: p  # type: ignore[misc]
    for p in (
        _preset("gpt2", _gpt2_params(12, 768), 12, 768, 12, 1024, 50257),
        _preset("gpt2-medium", _gpt2_params(24, 1024), 24, 1024, 16, 1024, 50257),
        _preset("gpt2-large", _gpt2_params(36, 1280), 36, 1280, 20, 1024, 50257),
        _preset("gpt2-xl", _gpt2_params(48, 1600), 48, 1600, 25, 1024, 50257),
        _preset("gpt3-175b", _gpt2_params(96, 12288, positions=2048), 96, 12288, 96, 2048, 50257),
        _preset("llama2-7b", _llama_params(32, 4096, 11008), 32, 4096, 32, 4096, 32000),
        _preset("llama2-13b", _llama_params(40, 5120, 13824), 40, 5120, 40, 4096, 32000),
    )
}


def count_parameters(model: nn.Module, name: str | None = None) -> ModelSpec:
    """Trainable parameters (shared ones once) and the largest single module of ``model``.

    Args:
        model: any module; meta-device parameters are fine.
        name: label for the result.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ModelSpec(float(total), name, largest_layer_params=float(largest))


def _project_preset(name: str) -> ModelSpec | None:
    """A preset of ``experiments.gpt.GPT_PRESETS`` (this repository's GPT), built on meta and counted."""
    try:
        from experiments.gpt import GPT, GPT_PRESETS  # optional: the experiments package may be absent
    except ImportError:
        return None
    if name not in GPT_PRESETS:
        return None
    cfg = GPT_PRESETS[name]
    with torch.device("meta"):
        counted = count_parameters(GPT(cfg), name)
    return replace(counted, layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, seq_len=cfg.seq_len)


def resolve_model(model: str | nn.Module) -> ModelSpec:
    """A :class:`ModelSpec` from a preset name, a module instance or ``"module.path:attr"``.

    Presets are :data:`PRESETS` and, when the ``experiments`` package is importable, this
    repository's GPT presets (``experiments.gpt.GPT_PRESETS``, e.g. ``gpt_small``).

    ``attr`` names a class or factory called with no arguments under ``torch.device("meta")`` (no
    memory is allocated); a LightningModule's ``configure_model`` hook is called there too.

    Args:
        model: preset (see :data:`PRESETS`), ``nn.Module``, or import path ``"pkg.mod:Class"``.
    """
    if isinstance(model, nn.Module):
        return count_parameters(model, type(model).__name__)
    if model in PRESETS:
        return PRESETS[model]
    project = _project_preset(model)
    if project is not None:
        return project
    module_name, sep, attr = model.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"Unknown model {model!r}. Give a preset ({', '.join(PRESETS)}) or an import path "
            "'package.module:ClassOrFactory' whose call with no arguments builds the nn.Module."
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"Cannot load {model!r}: {err}. Check the module is importable (PYTHONPATH).") from err
    with torch.device("meta"):
        built = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
        hook = getattr(built, "configure_model", None)
        if callable(hook):
            hook()
    if not isinstance(built, nn.Module):
        raise ValueError(f"{model!r} built a {type(built).__name__}, not a torch.nn.Module.")
    return count_parameters(built, model)


@dataclass(frozen=True)
class Cluster:
    """Data-parallel ranks and how they sit on nodes (CPU memory and NVMe are per node)."""

    world_size: int
    gpus_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node


def make_cluster(world_size: int | None, num_nodes: int | None, gpus_per_node: int | None) -> Cluster:
    """Fill in the one of world size, nodes and ranks per node that is missing.

    With only ``world_size``: 8 ranks per node when it is a multiple of 8, else one node.

    Args:
        world_size: N, data-parallel ranks.
        num_nodes: machines.
        gpus_per_node: ranks per machine.
    """
    for label, v in (("world size", world_size), ("number of nodes", num_nodes), ("GPUs per node", gpus_per_node)):
        if v is not None and (int(v) != v or v < 1):
            flag = "--" + label.replace(" ", "-").replace("number-of-", "num-").lower()
            raise ValueError(f"The {label} must be a positive integer (e.g. {flag} 8), got {v!r}.")
    if world_size is None:
        if num_nodes is None or gpus_per_node is None:
            raise ValueError("Give the world size (--world-size N) or both --num-nodes and --gpus-per-node.")
        world_size = num_nodes * gpus_per_node
    if gpus_per_node is None:
        if num_nodes is not None:
            gpus_per_node = world_size // num_nodes
        else:
            gpus_per_node = 8 if world_size % 8 == 0 else world_size
    if world_size % gpus_per_node or (num_nodes is not None and num_nodes * gpus_per_node != world_size):
        raise ValueError(
            f"World size {world_size} is not {num_nodes or '?'} nodes x {gpus_per_node} GPUs per node; "
            "give consistent --world-size / --num-nodes / --gpus-per-node (world size = nodes x GPUs/node)."
        )
    return Cluster(int(world_size), int(gpus_per_node))


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


def activation_memory(
    layers: int,
    hidden: int,
    seq_len: int,
    micro_batch: int,
    heads: int | None = None,
    bytes_per_element: int = 2,
    flash_attention: bool = False,
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
    and the loss are not included, nor tensor / sequence parallelism (t = 1).

    Args:
        layers: L, transformer layers.
        hidden: h, hidden size.
        seq_len: s, tokens per sample.
        micro_batch: b, samples per rank per forward.
        heads: a, attention heads (default ``hidden // 64``, i.e. head dim 64).
        bytes_per_element: e, 2 for 16-bit activations, 4 for fp32.
        flash_attention: attention without stored scores (FlashAttention / SDPA kernels).
    """
    heads = heads if heads is not None else max(1, hidden // 64)
    for label, v in (("layers", layers), ("hidden", hidden), ("seq_len", seq_len), ("micro_batch", micro_batch),
                     ("heads", heads)):
        if int(v) != v or v < 1:
            raise ValueError(f"Activation memory needs a positive integer {label}, got {v!r}.")
    sbh = float(seq_len) * micro_batch * hidden
    e = bytes_per_element
    per_layer = sbh * (16 * e + 2) + (0.0 if flash_attention else heads * seq_len**2 * micro_batch * (2 * e + 1.0))
    return Activations(layers, hidden, heads, seq_len, micro_batch, e, flash_attention,
                       full=layers * per_layer, checkpointed=layers * e * sbh + per_layer)


@dataclass(frozen=True)
class DeepSpeedFigures:
    """DeepSpeed's own estimate for one configuration (mixed-precision Adam assumed).

    ``cpu_per_node`` is per node, as DeepSpeed reports it (it prints GiB labelled "GB").
    """

    device: float
    cpu_per_node: float
    function: str


def deepspeed_figures(
    stage: int, offload: str, num_params: float, largest_layer_params: float, cluster: Cluster,
    additional_buffer_factor: float = 1.5,
) -> DeepSpeedFigures | None:
    """Re-implementation of DeepSpeed's estimators (no ``deepspeed`` import), ``None`` where it has none.

    Transcribed from ``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (DeepSpeed's
    current master branch), with total GPUs ``N``, ranks per node ``g``, nodes ``n``, largest layer
    ``L`` and buffer factor ``f = 1.5`` (note ZeRO-2 with offload is ``2Ψ`` on the GPU there, the
    16-bit parameters only):

    * ``estimate_zero2_model_states_mem_needs``: no offload, gpu ``2Ψ + 18Ψ/N`` (16-bit params;
      16-bit grads + fp32 grads + fp32 master + moments partitioned; older DeepSpeed releases used
      ``4Ψ + 16Ψ/N``), cpu ``4Ψ·g·f`` (loading the model); ``cpu_offload=True``: gpu ``2Ψ``,
      cpu ``Ψ·max(4N, 16)·f``.
    * ``estimate_zero3_model_states_mem_needs`` with ``zero_init=True``: gpu ``4L + 18Ψ/N``,
      cpu ``4L·g·f``; optimizer offload: gpu ``4L + 2Ψ/N``, cpu ``16Ψ/n·f``; optimizer and param
      offload: gpu ``4L``, cpu ``18Ψ/n·f``.

    Stages 0-1, stage 1 offload and NVMe offload have no DeepSpeed estimator.

    Args:
        stage: ZeRO stage.
        offload: offload option (see :data:`OFFLOADS`).
        num_params: Ψ.
        largest_layer_params: L (0 when unknown).
        cluster: ranks and nodes.
        additional_buffer_factor: DeepSpeed's ``additional_buffer_factor``.
    """
    psi, big, f = float(num_params), float(largest_layer_params), additional_buffer_factor
    n, g, nodes = cluster.world_size, cluster.gpus_per_node, cluster.num_nodes
    fig: dict[tuple[int, str], tuple[float, float, str]] = {
        (2, "none"): (2 * psi + int(18 * psi / n), 4 * psi * g * f, "zero2(cpu_offload=False)"),
        (2, "optimizer_cpu"): (2 * psi, psi * max(4 * n, 16) * f, "zero2(cpu_offload=True)"),
        (3, "none"): (4 * big + int(18 * psi / n), 4 * big * g * f, "zero3(cpu_offload=False)"),
        (3, "optimizer_cpu"): (4 * big + int(2 * psi / n), 16 * psi / nodes * f,
                               "zero3(cpu_offload=True, cpu_offload_params=False)"),
        (3, "param_cpu"): (4 * big, 18 * psi / nodes * f, "zero3(cpu_offload=True, cpu_offload_params=True)"),
    }
    hit = fig.get((stage, offload))
    return None if hit is None else DeepSpeedFigures(float(int(hit[0])), float(int(hit[1])), hit[2])


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
    """

    stage: int
    offload: str
    on_device: ModelStateBytes
    offloaded: ModelStateBytes
    working: float
    activations: Activations | None
    deepspeed: DeepSpeedFigures | None
    ranks_per_node: int

    @property
    def label(self) -> str:
        return f"stage {self.stage}" + ("" if self.offload == "none" else f" + {self.offload}")

    @property
    def target(self) -> str | None:
        """``"cpu"``, ``"nvme"`` or ``None``: where the offloaded state lives."""
        return None if self.offload == "none" else self.offload.rsplit("_", 1)[1]

    @property
    def device_bytes(self) -> float:
        """Model states on the device plus the stage-3 working layer; no activations."""
        return self.on_device.model_states + self.working

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
    activations: Activations | None = None, optimizer_state_per_param: int = 8,
) -> ConfigEstimate:
    """Estimate one configuration; see :func:`estimate_memory` for the arguments."""
    formula = _formula_precision(precision)
    on_device, moved = offloaded_model_state(
        stage, model.num_params, cluster.world_size, formula, offload, optimizer_state_per_param
    )
    elem = 4 if formula == "fp32" else 2
    working = 2 * elem * (model.largest_layer_params or 0.0) if stage == 3 else 0.0
    ds = None
    if formula == "mixed":
        ds = deepspeed_figures(stage, offload, model.num_params, model.largest_layer_params or 0.0, cluster)
    return ConfigEstimate(stage, offload, on_device, moved, working, activations, ds, cluster.gpus_per_node)


def _formula_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision][0]


@dataclass(frozen=True)
class MemoryEstimate:
    """Result of :func:`estimate_memory`: one :class:`ConfigEstimate` per (stage, offload)."""

    model: ModelSpec
    cluster: Cluster
    precision: str
    optimizer_state_per_param: int
    activations: Activations | None
    configs: tuple[ConfigEstimate, ...]

    def config(self, stage: int, offload: str = "none") -> ConfigEstimate:
        """The row for ``stage`` and ``offload``."""
        for c in self.configs:
            if c.stage == stage and c.offload == offload:
                return c
        raise KeyError(f"No estimate for stage {stage} with offload {offload!r} in this result.")

    def table(self, units: str = "GB") -> str:
        """The estimate as text (``units``: ``"GB"`` = 10^9 bytes or ``"GiB"`` = 2^30 bytes)."""
        from lightning_zero.advisor import render_estimate

        return render_estimate(self, units)

    def __str__(self) -> str:
        return self.table()


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
    """
    if (num_params is None) == (model is None):
        raise ValueError("Give exactly one of the parameter count (--params) and the model (--model).")
    spec = resolve_model(model) if model is not None else ModelSpec(parse_count(num_params))  # type: ignore[arg-type]
    if largest_layer_params is not None:
        spec = replace(spec, largest_layer_params=parse_count(largest_layer_params))
    if offload != "all" and offload not in OFFLOADS:
        raise ValueError(f"Unknown offload {offload!r}; use 'all' or one of {', '.join(OFFLOADS)}.")
    cluster = make_cluster(world_size, num_nodes, gpus_per_node)
    _formula_precision(precision)
    layers, hidden, heads = layers or spec.layers, hidden or spec.hidden, heads or spec.heads
    seq_len = seq_len or spec.seq_len
    acts = None
    if micro_batch is not None:
        missing = [flag for flag, v in (("--layers", layers), ("--hidden", hidden), ("--seq-len", seq_len)) if not v]
        if missing:
            raise ValueError(f"Activation memory for --micro-batch {micro_batch} also needs {', '.join(missing)} "
                             "(or a --model preset that knows the shape).")
        elem = 4 if _formula_precision(precision) == "fp32" else 2
        acts = activation_memory(layers, hidden, seq_len, micro_batch, heads, elem, flash_attention)
    configs = tuple(
        estimate_config(stage, off, spec, cluster, precision, acts, optimizer_state_per_param)
        for stage in range(4)
        for off in OFFLOADS
        if stage in OFFLOAD_STAGES[off] and (offload == "all" or off in ("none", offload))
    )
    return MemoryEstimate(spec, cluster, precision, optimizer_state_per_param, acts, configs)


_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_DECIMAL = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
            "tb": 1e12, "p": 1e15, "pb": 1e15}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_COUNT = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _parse(text: float | str, table: dict[str, float], what: str, example: str, positive: bool) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in table:
            raise ValueError(f"Cannot read {what} {text!r}; write it like {example}.")
        value = float(m.group(1)) * table[unit]
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"The {what} must be a {sign} finite number, got {text!r}; write it like {example}.")
    return value


def parse_size(text: float | str) -> float:
    """Bytes from ``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512G"`` (= GB), ``"2TB"``, ``"1.5e9"``.

    Args:
        text: a number of bytes or a string with a decimal (k/M/G/T/P, optional B) or binary
            (KiB/MiB/GiB/TiB/PiB) unit; case-insensitive.
    """
    return _parse(text, {**_DECIMAL, **_BINARY}, "memory size", "80GB, 80GiB, 512G, 2TB or 1.5e9 (bytes)", False)


def parse_count(text: float | str) -> float:
    """A parameter count from ``7.5e9``, ``"7.5B"``, ``"350M"``, ``"1.2T"`` or ``"124k"``.

    Args:
        text: a number, or a string with an optional k / M / B (or G) / T suffix.
    """
    return _parse(text, _COUNT, "parameter count", "7.5e9, 7.5B or 350M", True)
