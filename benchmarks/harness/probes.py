"""Measurements inside a run: model-state bytes counted by hand (DDP, FSDP2, plain loops) and the
``--profile`` timers wrapped around ZeroEngine internals."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_zero.core.common.memory import StorageCounter

if TYPE_CHECKING:
    from benchmarks.harness.recorder import StepRecorder
    from lightning_zero import ZeroStrategy


def _local_tensor(t: Any) -> Any:
    """The tensor holding this rank's data: a DTensor's local shard, anything else itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def count_by_hand(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp: bool) -> dict[str, float]:
    """params + grads + optimizer state, each storage once; with ``ddp``, ``comm_buffers`` = DDP's reducer buckets
    (a full gradient copy, since Lightning's DDP keeps ``gradient_as_bucket_view=False``): sized, not counted.
    FSDP2: the DTensors' local shards (padding included), and as ``comm_buffers`` the unsharded parameters alive."""
    params = list(module.parameters())
    counter = StorageCounter()
    counter.add("params", [_local_tensor(p) for p in params])
    counter.add("grads", [_local_tensor(p.grad) for p in params])
    for state in optimizer.state.values():
        counter.add("optimizer", [_local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor)])
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                counter.add("comm_buffers", [t for fp in group.fsdp_params for t in fp.all_gather_outputs])
    out = asdict(counter.result())
    if ddp:
        out["comm_buffers"] = float(sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    return out


def live_tensor_bytes() -> float:
    """Bytes of every distinct tensor storage Python can reach (``gc``, after a collection): the model state of a
    system whose internals this harness does not count by hand, less :attr:`StepRecorder.live_base`. Tensors held
    only by C++ (autograd, DDP's reducer) are missed."""
    gc.collect()  # uncollected cycles are still in gc.get_objects(): count only what is reachable
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                if storage.nbytes() > 0:
                    seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # DTensors, invalid python storages
                continue
    return float(sum(seen.values()))


def attach_probes(strategy: ZeroStrategy, rec: StepRecorder) -> None:
    """--profile: time the engine's per-parameter hooks, bucket launches / waits, after_step, zero_grad and
    the strategy's step-error check by wrapping them on this run's objects (hooks are re-registered). Stage 3
    also: ``s3_gather`` (a unit's agreement all-reduce + gather launch), ``s3_gather_launch`` (the launch
    alone: shard copy + broadcasts issued), ``s3_gather_wait`` (waiting for a gather) and ``s3_release``."""
    engine, comm = strategy.engine, strategy.engine_comm
    assert engine is not None and comm is not None
    reducer = engine.reducer

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.add(key, time.perf_counter() - t)

        return wrapper

    reducer.remove_hooks()
    hook = timed(reducer._on_grad_ready, "hooks")
    reducer._hooks = [p.register_post_accumulate_grad_hook(hook) for p in reducer._where]
    targets = [(reducer, "_launch", "bucket_launch"), (reducer, "_retire", "bucket_wait"),
               (engine, "after_step", "after_step"), (engine, "zero_grad", "zero_grad"),
               (comm, "ranks_with", "step_check")]  # fmt: skip
    if engine.runtime is not None:  # stage 3: the unit gathers (the hooks look these up on the objects)
        targets.append((engine.runtime, "_gather", "s3_gather"))
        for unit in engine.units:
            targets += [(unit, "start_gather", "s3_gather_launch"), (unit, "wait", "s3_gather_wait"),
                        (unit, "release", "s3_release")]  # fmt: skip
    for obj, name, key in targets:
        setattr(obj, name, timed(getattr(obj, name), key))
