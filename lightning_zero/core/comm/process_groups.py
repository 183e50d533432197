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

    Fix: the strategy keeps one data-parallel group per strategy (not one per setup) and registers
    its ``DataParallelComm`` here; an ``atexit`` hook, which runs before finalization starts, closes
    every registered comm (destroys the group and drops the last reference, so the C++ object and its
    threads go away right there) and destroys the default group if it is still initialised.
"""

from __future__ import annotations

import atexit
import weakref

import torch.distributed as dist

from lightning_zero.core.comm.data_parallel import DataParallelComm

_owned: weakref.WeakSet[DataParallelComm] = weakref.WeakSet()


def own(comm: DataParallelComm) -> DataParallelComm:
    """Register ``comm`` (whose group its caller created) to be closed at exit; returns it."""
    _owned.add(comm)
    return comm


def reusable(comm: DataParallelComm | None) -> bool:
    """Whether ``comm``'s group is still live and spans the whole world (a new setup may reuse it)."""
    if comm is None or comm.group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        return dist.get_world_size(comm.group) == dist.get_world_size()
    except (ValueError, RuntimeError):  # destroyed meanwhile
        return False


def close_all() -> None:
    """Close every registered comm, then destroy the default group (run by ``atexit``)."""
    for comm in list(_owned):
        comm.close()
    _owned.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(close_all)
