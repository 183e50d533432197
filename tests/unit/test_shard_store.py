"""The one storage interface of the sharded optimizer (Note [one storage interface]): one store per device,
chosen once, and every optimizer operation going through it, wherever the shards live (one process)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.offload import shard_store, store
from lightning_zero.core.offload.file_store import FileStore
from lightning_zero.core.offload.host_store import HostStore
from lightning_zero.core.offload.shard_store import DeviceStore, ShardStore
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.engine import ZeroEngine

OPERATIONS = sorted(n for n, v in vars(ShardStore).items() if inspect.isfunction(v) and not n.startswith("_"))


def test_open_shard_store_chooses_one_store_per_device(tmp_path) -> None:
    assert type(store.open_shard_store(OffloadConfig())) is DeviceStore
    cpu = store.open_shard_store(OffloadConfig(optimizer_device="cpu"))
    nvme = store.open_shard_store(OffloadConfig(optimizer_device="nvme", nvme_path=str(tmp_path)))
    try:
        assert type(cpu) is HostStore and type(nvme) is FileStore
        assert [s.device.value for s in (DeviceStore(), cpu, nvme)] == ["none", "cpu", "nvme"]
        assert [s.runs_step for s in (DeviceStore(), cpu, nvme)] == [False, True, True]
    finally:
        cpu.close()
        nvme.close()


@pytest.mark.parametrize("cls", [DeviceStore, HostStore, FileStore])
def test_every_store_implements_every_operation_with_the_protocols_signature(cls: type) -> None:
    assert "receive_grad" in OPERATIONS and "write_back" in OPERATIONS
    for name in OPERATIONS:
        theirs = inspect.signature(getattr(cls, name)).parameters
        assert list(theirs) == list(inspect.signature(getattr(ShardStore, name)).parameters), (cls, name)


def test_a_store_refuses_another_devices_config_and_the_former_name_warns(tmp_path) -> None:
    with pytest.raises(ValueError, match="open_shard_store"):
        HostStore(OffloadConfig(optimizer_device="nvme", nvme_path=str(tmp_path)))
    with pytest.warns(DeprecationWarning, match="HostStore"):
        old = store.OptimizerOffload(OffloadConfig(optimizer_device="cpu"))
    assert type(old) is HostStore


def _recording(base: type) -> type:
    """``base`` with every operation's name recorded in ``calls`` before it runs."""

    def wrap(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return getattr(base, name)(self, *args, **kwargs)
        return method

    return type(f"Recording{base.__name__}", (base,), {"calls": [], **{n: wrap(n) for n in OPERATIONS}})


@pytest.mark.parametrize("device", ["none", "cpu"])
def test_the_optimizer_calls_the_store_it_was_given_and_steps_as_a_plain_optimizer(device: str, monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    reference.load_state_dict(model.state_dict())
    made: list[Any] = []

    def open_recording(config: OffloadConfig, *args: Any) -> ShardStore:
        chosen = type(store.open_shard_store(config))
        cls = _recording(chosen)
        made.append(cls() if chosen is DeviceStore else cls(config))
        return made[-1]

    monkeypatch.setattr("lightning_zero.core.zero.engine_setup.open_shard_store", open_recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=1), DataParallelComm(),
                        offload=OffloadConfig(optimizer_device=device))
    (recorded,) = made
    x = torch.randn(5, 6)
    for _ in range(2):
        model(x).square().mean().backward()
        engine.finish_backward()
        engine.prepare_step()
        optimizer.step()
        engine.after_step()
        reference(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
    engine.detach()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    calls = set(recorded.calls)
    assert {"new_master", "use_kernels", "receive_grad", "grads_ready", "release_all", "close"} <= calls
    # the device store's step is the user's own; the host store runs it and writes each sub-group back
    assert ({"sub_groups", "step", "write_back", "place"} <= calls) is (device == "cpu")
    assert shard_store.DeviceStore.runs_step is False


def test_the_optimizer_and_the_engine_ask_the_store_never_the_device() -> None:
    """The last branches on the offload device outside the stores (the engine's ``master_grad_is_view``, the
    optimizer's checks of ``store.device``) ask the store whether its shards are offloaded (issue 47)."""
    from pathlib import Path

    zero = Path(__file__).resolve().parents[2] / "lightning_zero" / "core" / "zero"
    naming = sorted(p.name for p in zero.glob("*.py") if "OffloadDevice" in p.read_text())
    assert naming == [], naming  # only open_shard_store (core/offload/store.py) looks at the device
    assert DeviceStore.offloaded is False and HostStore.offloaded is True and FileStore.offloaded is True
    module = nn.Linear(4, 4)
    plain = ZeroEngine(module, torch.optim.AdamW(module.parameters()), ZeroConfig(stage=2), DataParallelComm())
    assert plain.master_grad_is_view and plain.sharded is not None and plain.sharded.offload is None
    module = nn.Linear(4, 4)
    offloaded = ZeroEngine(module, torch.optim.AdamW(module.parameters()), ZeroConfig(stage=2), DataParallelComm(),
                           offload=OffloadConfig(optimizer_device="cpu"))
    try:
        assert not offloaded.master_grad_is_view and offloaded.sharded is not None
        assert offloaded.sharded.offload is offloaded.sharded.store
    finally:
        offloaded.detach()
