"""Ordering asynchronous copies between pinned host memory and a CUDA device against the CPU's use.

Note [asynchronous host copies]
    ``copy_(non_blocking=True)`` between pinned host memory and a GPU returns before the bytes have
    moved: the copy is queued on the device's current stream. Offload issues three of them:

    * the reduced gradient shard, device -> pinned host buffer (``HostStore.receive_grad``),
      which the CPU then unscales, measures and steps on (``ZeroEngine.prepare_step``);
    * a stage-3 parameter shard, pinned host -> the device's gather buffer (``ParamOffload.read``),
      which the CPU optimizer later overwrites with the stepped values (``write_back``);
    * the stepped master, pinned host -> the device's parameter shard (``write_back``), which the
      CPU optimizer overwrites at the next step.

    Each such copy records a CUDA event on the stream it was issued on, under the host tensor it
    reads or writes (:meth:`CopyFence.record`); before the CPU reads or overwrites that host tensor
    it synchronizes the event (:meth:`CopyFence.wait`). Copies issued together are all recorded
    first and waited on once, so they still overlap each other. Without CUDA (or a synchronous copy)
    nothing is recorded and every wait is free.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch


class CopyFence:
    """The CUDA events of copies still in flight, by the host tensor they touch (Note [asynchronous host copies])."""

    event_type: Any = None  # the event class; ``None``: ``torch.cuda.Event`` (tests put a fake here)

    def __init__(self) -> None:
        self._events: dict[Hashable, Any] = {}

    @staticmethod
    def asynchronous(non_blocking: bool, *tensors: torch.Tensor) -> bool:
        """Whether a copy between ``tensors`` with ``non_blocking`` may still be running when it returns."""
        return non_blocking and any(t.is_cuda for t in tensors)

    def record(self, key: Hashable, non_blocking: bool, *tensors: torch.Tensor) -> None:
        """After issuing a copy between ``tensors``: remember when it will have finished, under ``key``."""
        if not self.asynchronous(non_blocking, *tensors):
            return
        device = next((t.device for t in tensors if t.is_cuda), None)
        event = (self.event_type or torch.cuda.Event)()
        event.record(torch.cuda.current_stream(device) if device is not None else None)
        self._events[key] = event

    def wait(self, key: Hashable) -> None:
        """Block until the copy recorded under ``key`` (if any) has finished."""
        event = self._events.pop(key, None)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        """Block until every recorded copy has finished."""
        events, self._events = self._events, {}
        for event in events.values():
            event.synchronize()

    @property
    def pending(self) -> int:
        """Recorded copies not yet waited on."""
        return len(self._events)
