"""Stage 3's working set per rank, from the model's shape: what one step holds when the model state is elsewhere.

Note [working set]
    With the parameter shards, gradient shards and optimizer state in swap files (``param_nvme``), a rank's
    memory no longer holds model state; it holds what one step needs at a time (docs/offload.md):

    * gathered units: the root unit (parameters of no block), the running unit, the units prefetched ahead
      of it (as many as ``prefetch_bucket_size`` elements hold) or kept gathered from their forward into
      their backward (Note [kept tail] in ``core/stage3/runtime.py``: as many), whichever is more, and the
      persistent unit; the gather pool keeps the most ever gathered at once, so this is held through the step;
    * the gradient of the largest parameter, whole, between autograd producing it and the reducer staging it;
    * the reducer's buffers: ``(in flight + 1)`` staging and ``in flight`` receive buffers of one message, a
      message being the largest bucket of a unit's gradients (parameters taken from the last until
      ``reduce_bucket_size`` elements), or as many whole units as fit in ``reduce_bucket_size`` (Note [reused
      buffers] in ``core/zero/exchange.py``; 2 in flight);
    * the activations of one micro-batch (:func:`~lightning_zero.estimator.activations.activation_memory`);
    * the optimizer's swap buffers: ``buffer_count`` buffers of ``sub_group_size`` elements (as many as the
      pipeline needs: 4 per sub-group for AdamW, times 3 sub-groups in flight; Note [swapped step]);
    * the process itself (Python, torch, Lightning, the gloo and I/O threads): :data:`PROCESS_OVERHEAD_BYTES`,
      measured once (below) and added on a CPU host, where all of the above is host memory.

    Only the first two and the message size grow with the model, and only with its largest unit (its
    largest parameter), not with its parameter count; the activations grow with layers x hidden size.
    Without parameter offload (stage 3, ``"none"`` or ``optimizer_*``) the same working set comes on top
    of the model state the rank keeps.

    The disk holds this rank's parameter shard (the fp32 master is the same file), gradient shard and the
    optimizer's moments; a step reads each unit's shard in forward and again in backward (but the units
    kept from forward into backward), every gradient once to measure the norm and once to step, the
    master and the moments, and writes the gradients, the master and the moments (:class:`StepIO`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.estimator.activations import Activations
from lightning_zero.estimator.model_spec import ModelSpec

# Note [working set]: VmHWM of one rank of `lightning-zero train model=gpt_tiny zero=stage3 offload=param_nvme
# precision=fp32 model.build_in_configure_model=true trainer.max_steps=3` (2 CPU ranks; torch 2.13, Lightning 2.6,
# Python 3.11; its model state is 1.5 MB), 420 MiB: the interpreter, torch, Lightning, the data loader, gloo and
# the I/O threads, their code pages included
PROCESS_OVERHEAD_BYTES = 440e6


@dataclass(frozen=True)
class StreamSettings:
    """The settings that size the working set (the strategy's defaults; Hydra ``zero.*`` / ``offload.*``)."""

    prefetch_bucket_size: float = 5e7
    max_live_parameters: float = 1e9
    max_reuse_distance: float = 1e9
    reduce_bucket_size: float = 1e7
    sub_group_size: float = 1e6
    state_tensors: int = 2  # per-element optimizer state (AdamW: two moments)
    buffer_sets: int = 3  # sub-groups in flight: stepping, reading the next, writing the last


@dataclass(frozen=True)
class WorkingSet:
    """One rank's working set in bytes (Note [working set])."""

    gathered: float  # root + persistent + running unit + prefetched or kept units
    grads: float  # the largest parameter's gradient before it is staged
    buckets: float  # the reducer's staging and receive buffers
    activations: float
    swap_buffers: float
    overhead: float  # the process itself (a CPU host)
    units_ahead: int  # units prefetched ahead of (or kept with) the running one
    message: float  # elements of one gradient message

    @property
    def total(self) -> float:
        return self.gathered + self.grads + self.buckets + self.activations + self.swap_buffers + self.overhead


@dataclass(frozen=True)
class StepIO:
    """One rank's swap-file bytes per optimizer step (one micro-batch) and on disk."""

    read: float
    written: float
    disk: float


def units_ahead(model: ModelSpec, settings: StreamSettings) -> int:
    """Units gathered besides the running one: prefetched (``prefetch_bucket_size``) or kept from forward into
    backward (Note [kept tail]: the same budget, also within ``max_reuse_distance``), whichever is more."""
    unit = model.unit_params or 0.0
    if unit <= 0:
        return 0
    root = model.root_params or 0.0
    ahead = int(min(settings.prefetch_bucket_size, settings.max_live_parameters - root - unit) // unit)
    kept = int(min(settings.prefetch_bucket_size, settings.max_live_parameters - root,
                   settings.max_reuse_distance) // unit) - 1
    return max(0, ahead, kept)


def largest_message(model: ModelSpec, bucket: float) -> float:
    """Elements of the largest gradient message of a unit: its parameters taken from the last, a bucket closed
    once it holds ``bucket`` elements (``FlatParamGroup.make_buckets``), whole units merged while within
    ``bucket`` (Note [owner-major message]); without the parameter sizes, at most the bucket plus a parameter."""
    unit = model.unit_params or 0.0
    sizes = model.unit_param_sizes
    if not sizes:
        return min(unit, bucket + (model.largest_layer_params or 0.0)) if unit else bucket
    out, size = 0.0, 0.0
    for n in reversed(sizes):
        size += n
        if size >= bucket:
            out, size = max(out, size), 0.0
    return max(out, size, unit * (bucket // unit) if unit and unit < bucket else 0.0)


def working_set(model: ModelSpec, world_size: int, elem: int, activations: Activations | None,
                settings: StreamSettings, cpu_host: bool, master_elem: int = 4) -> WorkingSet:
    """The working set of one rank of stage 3 (Note [working set]); ``elem``: bytes of a parameter element,
    ``master_elem``: of a master element; ``cpu_host``: count the process itself."""
    unit = model.unit_params or model.largest_layer_params or 0.0
    largest = model.largest_layer_params or unit
    ahead = units_ahead(model, settings)
    gathered = elem * ((model.root_params or 0.0) + (model.persistent_params or 0.0) + unit * (1 + ahead))
    message = largest_message(model, settings.reduce_bucket_size)
    in_flight = 2  # GradReducer.max_in_flight at stages 2-3
    peers = (world_size - 1) / world_size
    buckets = elem * message * ((in_flight + 1) + in_flight * peers)
    swap = master_elem * settings.sub_group_size * (2 + settings.state_tensors) * settings.buffer_sets
    return WorkingSet(gathered, elem * largest, buckets, 0.0 if activations is None else activations.full, swap,
                      PROCESS_OVERHEAD_BYTES if cpu_host else 0.0, ahead, message)


def step_io(model: ModelSpec, world_size: int, elem: int, settings: StreamSettings, master_elem: int = 4) -> StepIO:
    """Swap-file bytes of one step of stage 3 + ``param_nvme`` (AdamW-like: ``state_tensors`` moments) and the
    disk it takes, per rank (Note [working set])."""
    shard = model.num_params / world_size
    params, grads = elem * shard, elem * shard
    master = 0.0 if master_elem == elem else master_elem * shard  # fp32: the master is the parameter file
    state = settings.state_tensors * master_elem * shard
    unit = model.unit_params or 0.0
    blocks = max(model.num_params - (model.root_params or 0.0) - (model.persistent_params or 0.0), 0.0)
    kept = min(units_ahead(model, settings) * unit, blocks) / world_size * elem if unit else 0.0
    read = (2 * params - kept) + 2 * grads + (master or params) + state  # forward, backward, norm, step
    written = grads + (master or params) + state + (params if master else 0.0)
    return StepIO(read, written, params + grads + master + state)
