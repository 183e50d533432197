"""Running one batch through the pipeline: PyTorch's schedules over this rank's chunks.

Training (``train_step``): the ZeRO engine's reduction is deferred for the whole schedule
(Note [deferred reduction] in ``core/zero/engine.py``): every micro-batch's backward accumulates into
the local parameters' ``.grad``; then tied parameters' gradients are summed across the stages
sharing them and the engine reduces once over the data-parallel group.

Note [loss scaling in the schedule]
    The schedules are built with ``scale_grads=False``: torch's own scaling divides ``p.grad`` after
    the last backward, which the ZeRO hooks have consumed by then (and the zero-bubble schedules
    assign weight gradients by hand, see ``config.REFUSED_SCHEDULES``). Instead the loss of each
    micro-batch is multiplied by ``loss_scale / (micro_batches x accumulate_grad_batches)`` before its
    backward (``loss_factor`` is ``loss_scale / accumulate_grad_batches``), so the summed gradients are
    those of the batch mean, scaled like the fp16 loss scaler expects, and divided by the accumulation
    count as Lightning divides an unpipelined ``training_step``'s loss before its backward (which never
    runs here: the schedule ran the backwards). The loss reported is the sum of the micro-batch terms
    divided by ``loss_factor``: the true batch mean.

Evaluation (``eval_step``) runs the forward-only pass of the same schedule (``schedule.eval``),
with as many micro-batches as divide the batch (at most ``micro_batches``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_zero.core.common.choices import PipeSchedule
from lightning_zero.core.reliability.progress_record import RECORD
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.pipeline.mesh import PipelineGroups
from lightning_zero.pipeline.model import LocalModel


class PipelineRunner:
    """The schedules of this rank's chunks (one per batch shape and mode, built on first use).

    Args:
        config: the pipeline policy.
        local: this rank's chunks (``model.split_module``).
        groups: its process groups.
        loss_fn: ``(output, target) -> mean loss`` of one micro-batch.
        device: where the chunks run.
    """

    def __init__(self, config: PipelineConfig, local: LocalModel, groups: PipelineGroups,
                 loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device) -> None:
        self.config, self.local, self.groups = config, local, groups
        self.loss_fn, self.device = loss_fn, device
        self.loss_factor: float = 1.0  # Note [loss scaling in the schedule]
        self.full_batch_size: int | None = None  # the train loader's batch size (else the largest batch seen)
        # reduce_per_micro_batch: called before and after each micro-batch's backward of a local chunk
        self.around_backward: tuple[Callable[[], None], Callable[[], None]] | None = None
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self.last_rank = groups.peer(config.stages - 1)

    @property
    def is_first(self) -> bool:
        return self.groups.stage == 0

    @property
    def is_last(self) -> bool:
        return self.groups.stage == self.config.stages - 1

    def _scaled_loss(self, micro_batches: int) -> Callable[[Any, Any], torch.Tensor]:
        def loss(output: Any, target: Any) -> torch.Tensor:
            return self.loss_fn(output, target).float() * (self.loss_factor / micro_batches)

        return loss

    def _schedule(self, micro_batches: int, training: bool, key: tuple[Any, ...], with_loss: bool = True) -> Any:
        full_key = (micro_batches, training, with_loss, *key)
        schedule = self._schedules.get(full_key)
        if schedule is not None:
            return schedule
        stages = [PipelineStage(chunk, c, self.config.chunks, self.device, group=self.groups.pp)
                  for chunk, c in zip(self.local.chunks, self.local.chunk_ids)]
        for stage in stages:
            stage.backward_one_chunk = self._bracketed(stage.backward_one_chunk)  # type: ignore[method-assign]
        loss = self._scaled_loss(micro_batches) if with_loss else None  # predict: outputs only
        if self.config.schedule is PipeSchedule.INTERLEAVED_1F1B:
            schedule = ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss, scale_grads=False)
        else:
            cls = Schedule1F1B if self.config.schedule is PipeSchedule.ONE_F_ONE_B and training else ScheduleGPipe
            schedule = cls(stages[0], micro_batches, loss_fn=loss, scale_grads=False)
        self._schedules[full_key] = schedule
        return schedule

    def _bracketed(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.around_backward is None:
                return backward(*args, **kwargs)
            self.around_backward[0]()
            out = backward(*args, **kwargs)
            self.around_backward[1]()
            return out

        return run

    def _broadcast_loss(self, losses: list[torch.Tensor], micro_batches: int) -> torch.Tensor:
        """The batch-mean loss on every rank of the pipeline (computed on the last stage)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last:
            total = torch.stack([t.detach().float() for t in losses]).sum() / self.loss_factor
        if self.config.stages > 1:
            with RECORD.collective("broadcast (pipeline loss)"):
                dist.broadcast(total, src=self.last_rank, group=self.groups.pp)
        return total

    @staticmethod
    def _shape_key(*values: Any) -> tuple[Any, ...]:
        return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in values)

    def train_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the batch-mean loss (every rank)."""
        size = _batch_size(inputs)
        if self.full_batch_size is None or size > self.full_batch_size:
            self.config.check_batch(size)
            self.full_batch_size = size
        self.config.check_batch(size, self.full_batch_size)
        m = self.config.micro_batches
        schedule = self._schedule(m, True, self._shape_key(inputs, target))
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        with RECORD.collective("pipeline send/recv (schedule)"):  # Note [progress record]: the whole schedule
            schedule.step(*args, target=target if self.is_last else None, losses=losses if self.is_last else None,
                          return_outputs=False)
        return self._broadcast_loss(losses, m)

    @torch.no_grad()
    def eval_step(self, inputs: Any, target: Any | None) -> tuple[torch.Tensor | None, Any]:
        """Forward-only pass. Returns ``(mean loss or None, output)``; the output (the last stage's,
        merged over micro-batches) is broadcast to every rank of the pipeline."""
        size = _batch_size(inputs)
        m = max(d for d in range(1, self.config.micro_batches + 1) if size % d == 0)
        if self.config.schedule is PipeSchedule.INTERLEAVED_1F1B and m % self.config.stages:
            raise ValueError(f"An evaluation batch of {size} samples does not split into a multiple of "
                             f"stages={self.config.stages} micro-batches, which the interleaved schedule needs. "
                             "Fix: an evaluation batch size that is a multiple of micro_batches.")
        with_loss = target is not None
        schedule = self._schedule(m, False, self._shape_key(inputs, target), with_loss)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        output = schedule.eval(*args, target=target if self.is_last and with_loss else None,
                               losses=losses if self.is_last and with_loss else None)
        loss = self._broadcast_loss(losses, m) if with_loss else None
        return loss, self._broadcast_output(output)

    def _broadcast_output(self, output: Any) -> Any:
        if self.config.stages == 1:
            return output
        meta = [(tuple(output.shape), output.dtype) if self.is_last else None]
        dist.broadcast_object_list(meta, src=self.last_rank, group=self.groups.pp)
        shape, dtype = meta[0]
        out = output.contiguous() if self.is_last else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(out, src=self.last_rank, group=self.groups.pp)
        return out

    @torch.no_grad()
    def sync_tied_grads(self, engine_groups: list[Any], flat_grads: list[torch.Tensor | None],
                        boundary: bool = True) -> None:
        """Sum the gradients of parameters shared by several stages across those stages (in ``.grad``
        at ZeRO stages 2-3, in the engine's whole gradient buffers ``flat_grads`` at stages 0-1).

        Args:
            engine_groups: the engine's parameter groups (their slots locate a parameter in ``flat_grads``).
            flat_grads: the whole gradient buffers (stages 0-1), ``None`` entries elsewhere.
            boundary: whether this backward ends the accumulation window. The whole buffers accumulate
                the window's batches, so they are summed once, at its end (summing them after every batch
                would add the earlier batches' stage sums again); ``.grad`` holds one batch and is summed
                every time.
        """
        views: dict[torch.Tensor, torch.Tensor] = {}
        for g, flat in zip(engine_groups, flat_grads):
            if flat is not None:
                views.update({s.param: flat[s.offset : s.offset + s.numel] for s in g.slots})
        for stages, params in self.local.ties.items():
            group = self.groups.ties[stages]
            for p in params:
                if p in views:
                    if boundary:
                        dist.all_reduce(views[p], group=group)
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)

    def norm_weight(self, param: torch.Tensor) -> float:
        """The share of ``param``'s norm terms this rank leaves out: all of a tied parameter's whose gradient
        another stage owns, so that it counts once in the global norm (Note [counting a parameter once] in
        core/zero/engine_step.py); nothing of the others."""
        return 0.0 if self.local.owner_stage.get(param, self.groups.stage) == self.groups.stage else 1.0


def _batch_size(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"Pipeline inputs must be a tensor (or a tuple of tensors), got {type(first).__name__}.")
    return int(first.shape[0])

