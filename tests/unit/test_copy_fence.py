"""The order of offload's asynchronous pinned copies against the CPU (Note [asynchronous host copies]),
checked on the CPU: the copies are declared asynchronous and their CUDA events replaced by fakes that
log when they are recorded and synchronized, beside the CPU's reads and writes of the host side.
The same code runs with real events on a GPU in tests/unit/test_cuda.py.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.offload.copy_fence import CopyFence
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.zero import engine_step
from lightning_zero.core.zero.optimizer import ShardedOptimizer


class FakeEvent:
    """Logs ``record`` and ``synchronize`` with its serial number (a real one also orders the stream)."""

    log: ClassVar[list[str]] = []
    count = 0

    def __init__(self) -> None:
        FakeEvent.count += 1
        self.n = FakeEvent.count

    def record(self, stream: Any = None) -> None:
        FakeEvent.log.append(f"record {self.n}")

    def synchronize(self) -> None:
        FakeEvent.log.append(f"sync {self.n}")


@pytest.fixture
def fake_events(monkeypatch) -> list[str]:
    FakeEvent.log, FakeEvent.count = [], 0
    monkeypatch.setattr(CopyFence, "event_type", FakeEvent)
    monkeypatch.setattr(CopyFence, "asynchronous", staticmethod(lambda non_blocking, *tensors: True))
    return FakeEvent.log


def _unsynced(log: list[str], upto: int, since: int = 0) -> set[str]:
    """Events recorded in ``log[since:upto]`` but not synchronized before ``upto``."""
    recorded = {e.split()[1] for e in log[since:upto] if e.startswith("record")}
    return recorded - {e.split()[1] for e in log[:upto] if e.startswith("sync")}


def test_a_fence_waits_only_on_what_it_recorded(fake_events) -> None:
    fence = CopyFence()
    fence.record("a", True, torch.zeros(1))
    fence.record("b", True, torch.zeros(1))
    fence.wait("a")
    fence.wait("a")  # once only
    assert fake_events == ["record 1", "record 2", "sync 1"] and fence.pending == 1
    fence.wait_all()
    assert fake_events[-1] == "sync 2" and fence.pending == 0


def test_without_cuda_a_copy_is_synchronous_and_nothing_is_recorded() -> None:
    fence = CopyFence()
    fence.record("a", True, torch.zeros(1), torch.zeros(1))  # host tensors: copy_ returned after the copy
    assert fence.pending == 0
    assert not CopyFence.asynchronous(False, torch.zeros(1))


def test_offloaded_gradients_land_before_the_cpu_reads_them_and_masters_are_read_before_overwritten(
        fake_events, monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2), DataParallelComm(),
                        offload=OffloadConfig(optimizer_device="cpu"))
    real_norm, real_step = engine_step.local_sum_of_squares, ShardedOptimizer._step_sub_group

    def norm(grads: list[torch.Tensor]) -> float:
        fake_events.append("cpu reads grads")
        return real_norm(grads)

    def step_one(self: ShardedOptimizer, sg: Any) -> None:
        fake_events.append("cpu steps masters")
        real_step(self, sg)

    monkeypatch.setattr(engine_step, "local_sum_of_squares", norm)
    monkeypatch.setattr(ShardedOptimizer, "_step_sub_group", step_one)
    x = torch.randn(3, 4)
    for _ in range(2):
        model(x).square().mean().backward()
        engine.finish_backward()
        fake_events.append("prepare")  # the gradient copies into the host buffers start here
        engine.prepare_step(loss_scale=4.0)
        optimizer.step()
        engine.after_step()
    prepares = [i for i, e in enumerate(fake_events) if e == "prepare"]
    reads = [i for i, e in enumerate(fake_events) if e == "cpu reads grads"]
    steps = [i for i, e in enumerate(fake_events) if e == "cpu steps masters"]
    assert len(reads) == len(steps) == 2
    # the gradient copies were recorded, and waited on before the CPU reads the host gradients; every
    # copy recorded before the CPU overwrites the masters (the last step's write-backs too) before that
    for prepare, read in zip(prepares, reads):
        assert any(e.startswith("record") for e in fake_events[prepare:read])
        assert _unsynced(fake_events, read, since=prepare) == set(), (read, fake_events)
    for i in steps:
        assert _unsynced(fake_events, i) == set(), (i, fake_events)
    # the step's write-backs (master -> parameter shard) were recorded, waited on by the next step
    assert any(e.startswith("record") for e in fake_events[steps[0]:reads[1]])
    engine.detach()


def test_an_offloaded_parameter_shard_is_read_by_the_device_before_the_optimizer_overwrites_it(fake_events) -> None:
    from lightning_zero.core.offload.param_offload import ParamOffload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=3, param_persistence_threshold=0, unit_classes=(nn.Linear,))
    engine = ZeroEngine(model, optimizer, config, DataParallelComm(),
                        offload=OffloadConfig(optimizer_device="cpu", param_device="cpu"))
    store = engine.sharded.offload
    assert isinstance(store.params, ParamOffload)
    seen: list[tuple[str, list[float]]] = []
    original_sync = FakeEvent.synchronize

    def sync_and_look(self: FakeEvent) -> None:  # the shard's values when the CPU is let go on
        original_sync(self)
        seen.append((fake_events[-1], [g.shard.sum().item() for u in engine.units for g in u.groups]))

    FakeEvent.synchronize = sync_and_look  # type: ignore[method-assign]
    try:
        before = [g.shard.sum().item() for u in engine.units for g in u.groups]
        model(torch.randn(3, 4)).square().mean().backward()
        engine.finish_backward()
        engine.prepare_step()
        reads_recorded = store.params.fence.pending
        optimizer.step()
        engine.after_step()
    finally:
        FakeEvent.synchronize = original_sync  # type: ignore[method-assign]
    after = [g.shard.sum().item() for u in engine.units for g in u.groups]
    assert reads_recorded >= 2  # every released unit's shards were read at its gathers, recorded
    assert store.params.fence.pending == 0  # and waited on by the write-back
    assert after != before  # the optimizer did overwrite the shards
    # each read's wait happened while the shards still held the values the device was reading
    assert any(values == before for _, values in seen), seen
    engine.detach()
