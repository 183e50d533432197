"""Process groups the ZeRO strategy creates are destroyed while the interpreter is fully alive.

Note [clean exit]
    About 3 launches in 100 ended with a rank aborting after a successful fit: ``terminate called
    without an active exception`` (SIGABRT, exit code 134). Cause: every setup created a
    ``dist.new_group`` group that nothing destroyed. ``dist.destroy_process_group()`` (the CLI worker
    calls it) only unregisters groups; the C++ ``ProcessGroupGloo`` and its worker threads live on as
    long as a Python object refers to it, and the strategy's ``DataParallelComm`` (inside the Trainer's
    reference cycles) did. So the group was destructed during interpreter finalization: its destructor
    releases the GIL and joins the gloo worker threads, and a worker thread that then needs the GIL
    (to free a tensor whose Python object it held the last reference to) hits CPython's "thread must
    exit" path in ``take_gil``: ``pthread_exit`` unwinds a C++ ``std::thread`` through ``noexcept``
    frames, which is ``std::terminate`` with no active exception. Whether a worker still held such a
    tensor at that moment is a race, hence the rare abort. (pytorch/pytorch#190489 describes the same
    crash for a default group that is never destroyed.)

    Fix: the strategy keeps one process mesh per strategy (not one per setup: ``ProcessMesh`` in
    ``core/mesh/groups.py``, reused by every setup) and registers it here, with the
    ``DataParallelComm`` over its ZeRO group; an ``atexit`` hook, which runs before finalization
    starts, closes everything registered (destroys the groups and drops the last references, so the
    C++ objects and their threads go away right there) and destroys the default group if it is still
    initialised. Every holder of a group the strategy created is registered: a group stays alive as
    long as any one of them refers to it.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol, TypeVar

import torch.distributed as dist

from lightning_zero.core.comm.data_parallel import DataParallelComm


class GroupHolder(Protocol):
    """Something that refers to process groups and can destroy them and drop them (``close()``)."""

    def close(self) -> None: ...


Holder = TypeVar("Holder", bound=GroupHolder)

_owned: weakref.WeakSet[GroupHolder] = weakref.WeakSet()


def own(holder: Holder) -> Holder:
    """Register ``holder`` (a ``DataParallelComm``, a ``ProcessMesh``, ... over groups its caller
    created) to be closed at exit; returns it."""
    _owned.add(holder)
    return holder


def reusable(comm: DataParallelComm | None) -> bool:
    """Whether ``comm``'s group is still live (a new setup of the same mesh may reuse it)."""
    if comm is None or comm.group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_world_size(comm.group)
    except (ValueError, RuntimeError):  # destroyed meanwhile
        return False
    return True


def close_owned() -> None:
    """Close every registered holder (their groups are destroyed); the default group stays."""
    for holder in list(_owned):
        holder.close()
    _owned.clear()


def close_all() -> None:
    """Close every registered holder, then destroy the default group (run by ``atexit``)."""
    close_owned()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(close_all)
