"""Model-state memory: the ZeRO formulas (one place) and a counter of the tensors that exist.

The formulas follow the ZeRO paper (Rajbhandari et al., 2020, section 3) for Adam-like
optimizers with two fp32 moments per element. Ψ is the number of trainable parameters and N the
number of data-parallel ranks. Both the memory estimator and the tests of
``ZeroStrategy.model_state_bytes()`` use :func:`model_state_formula` (and, with tensor or expert parallelism,
:func:`tensor_parallel_model_state` and :func:`expert_parallel_model_state` built on it); :func:`format_bytes`
prints sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_zero.core.common.choices import ZeroStage

# bytes per element
_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state on one rank, by kind."""

    params: float
    grads: float
    optimizer: float  # optimizer state plus the fp32 master copy when it is not a view of params
    comm_buffers: float = 0.0  # gradient buckets in flight and gathered stage-3 units (not nn.Module buffers)
    # idle memory kept for reuse: the gradient exchange's buffers (Note [reused buffers] in core/zero/exchange.py)
    # and stage 3's gather pool (Note [gather buffer pool] in core/stage3/gather_pool.py)
    pooled: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.comm_buffers + self.pooled


def model_state_formula(
    stage: int | ZeroStage,
    num_params: float,
    world_size: int,
    precision: str = "fp32",
    optimizer_state_per_param: int = 8,
) -> ModelStateBytes:
    """Per-rank model-state bytes predicted by the ZeRO formulas.

    Args:
        stage: ZeRO stage 0-3.
        num_params: Ψ, trainable parameters.
        world_size: N, data-parallel ranks.
        precision: ``"fp32"`` (master shard is a view of the parameters), ``"mixed"`` (16-bit
            params and grads, fp32 master + state: the paper's K = 12) or ``"bf16-true"``
            (bf16 params, grads and optimizer state, no master).
        optimizer_state_per_param: bytes of optimizer state per element in fp32 (Adam: 8).
    """
    stage = ZeroStage.of(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    psi, n = float(num_params), float(world_size)
    if precision == "fp32":
        p, g, o = 4 * psi, 4 * psi, optimizer_state_per_param * psi
    elif precision == "mixed":
        p, g, o = 2 * psi, 2 * psi, (4 + optimizer_state_per_param) * psi
    elif precision == "bf16-true":
        p, g, o = 2 * psi, 2 * psi, optimizer_state_per_param / 2 * psi
    else:
        raise ValueError(f"precision must be 'fp32', 'mixed' or 'bf16-true', got {precision!r}")
    if stage.shards_optimizer:
        o /= n
    if stage.shards_gradients:
        g /= n
    if stage.shards_parameters:
        p /= n
    return ModelStateBytes(params=p, grads=g, optimizer=o)


def tensor_parallel_model_state(
    stage: int | ZeroStage,
    split_params: float,
    replicated_params: float,
    tensor_parallel: int,
    data_parallel: int,
    precision: str = "fp32",
    optimizer_state_per_param: int = 8,
) -> ModelStateBytes:
    """Per-rank model-state bytes with tensor parallelism (Note [model state with TP]).

    Note [model state with TP]
        A tensor-parallel rank holds ``Ψ_split / tp`` of the split parameters (its slices) plus every
        replicated parameter whole (norms, the biases added after a row-parallel sum, position
        embeddings): ``Ψ_rank = Ψ_split / tp + Ψ_rep``. ZeRO then partitions ``Ψ_rank`` over the data
        ranks only (the TP ranks of one replica hold different tensors), so the ZeRO formula applies to
        ``Ψ_rank`` with ``N = data_parallel``.

    Args:
        stage: ZeRO stage 0-3.
        split_params: Ψ_split, trainable parameters the plan splits (counted whole, unsplit).
        replicated_params: Ψ_rep, trainable parameters every TP rank holds whole.
        tensor_parallel: ranks per tensor-parallel group.
        data_parallel: data-parallel ranks (world size / (tensor x pipeline x sequence)).
        precision, optimizer_state_per_param: as for :func:`model_state_formula`.
    """
    if int(tensor_parallel) != tensor_parallel or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    if split_params < 0 or replicated_params < 0:
        raise ValueError(f"parameter counts must be >= 0, got split={split_params!r}, replicated={replicated_params!r}")
    per_rank = float(split_params) / tensor_parallel + float(replicated_params)
    return model_state_formula(stage, per_rank, data_parallel, precision, optimizer_state_per_param)


def expert_parallel_model_state(
    stage: int | ZeroStage,
    dense_params: float,
    expert_params: float,
    expert_parallel: int,
    data_parallel: int,
    precision: str = "fp32",
    optimizer_state_per_param: int = 8,
) -> ModelStateBytes:
    """Per-rank model-state bytes with expert parallelism (Note [model state with EP]).

    Note [model state with EP]
        An expert-parallel rank holds ``Ψ_experts / ep`` of the expert parameters (its experts) and every dense
        parameter. ZeRO partitions each over its own group (Note [expert axes] in core/mesh/dims.py): the dense
        ones over the ``data`` ranks, the rank's experts over the ``data / ep`` ranks holding them. So the
        ZeRO formula applies twice and the two add up: ``f(Ψ_dense, N = data) + f(Ψ_experts / ep, N = data / ep)``.
        At stage 3 both terms are ``Ψ / data``: expert parallelism then saves traffic (a rank gathers its own
        experts only), not memory; at stages 0-2 the parameters (and at 0-1 the gradients) of the other experts.

    Args:
        stage: ZeRO stage 0-3.
        dense_params: Ψ_dense, trainable parameters outside the experts.
        expert_params: Ψ_experts, the experts' trainable parameters, all experts counted (unsplit).
        expert_parallel: ranks per expert-parallel group.
        data_parallel: data-parallel ranks (expert-parallel ranks included).
        precision, optimizer_state_per_param: as for :func:`model_state_formula`.
    """
    if int(expert_parallel) != expert_parallel or expert_parallel < 1 or data_parallel % expert_parallel:
        raise ValueError(f"expert_parallel must be a positive integer dividing data_parallel={data_parallel}, got "
                         f"{expert_parallel!r}")
    dense = model_state_formula(stage, dense_params, data_parallel, precision, optimizer_state_per_param)
    experts = model_state_formula(stage, float(expert_params) / expert_parallel, data_parallel // expert_parallel,
                                  precision, optimizer_state_per_param)
    return ModelStateBytes(params=dense.params + experts.params, grads=dense.grads + experts.grads,
                           optimizer=dense.optimizer + experts.optimizer)


class StorageCounter:
    """Counts bytes of tensors by kind, each storage once (the first kind that claims it wins)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "comm_buffers": 0, "pooled": 0}

    def add(self, kind: str, tensors: Iterable[torch.Tensor | torch.UntypedStorage | None]) -> None:
        for t in tensors:
            if isinstance(t, torch.UntypedStorage):
                storage = t
            elif t is None or not isinstance(t, torch.Tensor):
                continue
            else:
                storage = t.untyped_storage()
            if storage.device.type == "meta":
                continue
            key = (str(storage.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes[kind] += storage.nbytes()

    def result(self) -> ModelStateBytes:
        return ModelStateBytes(**{k: float(v) for k, v in self.bytes.items()})


# Where each offload choice may be used (ZeRO-Offload / ZeRO-Infinity as in DeepSpeed: NVMe and
# parameter offload need stage 3; optimizer offload to CPU works from stage 1 on).
OFFLOAD_STAGES: dict[str, tuple[int, ...]] = {
    "none": (0, 1, 2, 3),
    "optimizer_cpu": (1, 2, 3),
    "optimizer_nvme": (1, 2, 3),
    "param_cpu": (3,),
    "param_nvme": (3,),
}


def offloaded_model_state(
    stage: int | ZeroStage,
    num_params: float,
    world_size: int,
    precision: str = "fp32",
    offload: str = "none",
    optimizer_state_per_param: int = 8,
) -> tuple[ModelStateBytes, ModelStateBytes]:
    """Per-rank model state split into (kept on the device, moved to the offload target).

    Built on :func:`model_state_formula` (``offload="none"`` returns its result unchanged and an
    empty offloaded part). Placement, following ZeRO-Offload and ZeRO-Infinity:

    * optimizer offload (``optimizer_cpu`` / ``optimizer_nvme``) moves this rank's optimizer
      partition -- a master copy of the parameter partition (fp32; bf16 for ``"bf16-true"``) plus
      the optimizer state -- and a gradient partition in the master dtype to the target. The
      device keeps the parameters as the stage keeps them (whole for stages 1-2, the 1/N shard
      for stage 3) and, for stage 1 only, the whole 16-bit gradient; stages 2-3 keep no
      persistent gradient on the device (it passes through the reduce buckets, which are not
      model state). The master copy is counted even for ``"fp32"``, where the device
      formula shares it with the parameters: once offloaded it is a separate tensor.
    * parameter offload (``param_cpu`` / ``param_nvme``, stage 3 only) also moves the parameter
      shard; the device keeps no persistent model state (gathered layers are working memory).

    Args:
        stage: ZeRO stage 0-3.
        num_params: Ψ, trainable parameters.
        world_size: N, data-parallel ranks.
        precision: as for :func:`model_state_formula`.
        offload: ``"none"``, ``"optimizer_cpu"``, ``"optimizer_nvme"``, ``"param_cpu"`` or
            ``"param_nvme"``; see :data:`OFFLOAD_STAGES` for the stages each allows.
        optimizer_state_per_param: bytes of optimizer state per element in fp32 (Adam: 8).
    """
    base = model_state_formula(stage, num_params, world_size, precision, optimizer_state_per_param)
    if offload not in OFFLOAD_STAGES:
        raise ValueError(f"offload must be one of {sorted(OFFLOAD_STAGES)}, got {offload!r}")
    if stage not in OFFLOAD_STAGES[offload]:
        raise ValueError(f"offload={offload!r} needs ZeRO stage {OFFLOAD_STAGES[offload]}, got stage {stage}")
    if offload == "none":
        return base, ModelStateBytes(params=0.0, grads=0.0, optimizer=0.0)
    shard = float(num_params) / float(world_size)
    low = precision == "bf16-true"
    master = 2.0 if low else 4.0
    state = optimizer_state_per_param / 2 if low else float(optimizer_state_per_param)
    moved_params = base.params if offload.startswith("param_") else 0.0
    device = ModelStateBytes(
        params=base.params - moved_params, grads=0.0 if ZeroStage.of(stage).shards_gradients else base.grads,
        optimizer=0.0,
    )
    moved = ModelStateBytes(params=moved_params, grads=master * shard, optimizer=(master + state) * shard)
    return device, moved


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
