"""Stage 3's gather memory (core/stage3/gather_pool.py): released memory is reused by the next gather of the same size,
never more than the most ever gathered is kept, and at one rank a gather moves the shard's memory instead of
copying it (Note [one rank]); the values seen through the parameters are the shard's either way."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.stage3.gather_pool import GatherPool
from lightning_zero.core.stage3.sharded_unit import ShardedUnit, UnitState


def test_released_memory_is_reused_and_bounded_by_the_most_ever_gathered() -> None:
    pool = GatherPool()
    a, b, c = (torch.UntypedStorage(0) for _ in range(3))
    pool.fill(a, 400)
    pool.fill(b, 400)  # two gathered at once: the limit is 800 bytes
    address = a.data_ptr()
    pool.empty(a)
    assert a.nbytes() == 0 and pool.pooled_bytes == 400
    pool.fill(c, 400)  # the memory a gave back
    assert c.data_ptr() == address and pool.reused == 1 and pool.pooled_bytes == 0
    pool.empty(b)
    pool.empty(c)
    assert pool.pooled_bytes == 800  # both kept: never more than was gathered at once
    pool.fill(a, 100)  # another size: fresh memory, the pool is not raided
    assert pool.pooled_bytes == 800 and pool.reused == 1
    pool.empty(a)
    assert a.nbytes() == 0 and pool.pooled_bytes == 800  # over the limit: freed, not kept
    pool.clear()
    assert pool.pooled_bytes == 0
    pool.fill(a, 400)
    pool.close()  # teardown: nothing is kept any more
    pool.fill(b, 400)
    pool.empty(a)
    pool.empty(b)
    assert pool.pooled_bytes == 0 and a.nbytes() == b.nbytes() == 0


def _unit() -> tuple[ShardedUnit, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    whole = torch.cat([p.detach().flatten() for p in layer.parameters()]).clone()
    group = FlatParamGroup(list(layer.parameters()), 1, 0)
    group.optimizer_group = 0
    group.bind()
    unit = ShardedUnit("layer", 0, [group])
    unit.shard()
    unit.pool = GatherPool()
    return unit, layer, whole


def test_one_rank_gathers_by_moving_the_shard_not_copying_it() -> None:
    unit, layer, whole = _unit()
    group, comm = unit.groups[0], DataParallelComm()
    shard, address = group.shard, group.shard.data_ptr()
    expected = whole.clone()
    for i in range(2):
        unit.start_gather(comm)
        unit.wait()
        assert unit.state is UnitState.GATHERED and group.flat.data_ptr() == address  # the same memory: no copy
        assert torch.equal(torch.cat([p.detach().flatten() for p in layer.parameters()]), expected)
        with torch.no_grad():
            layer.weight.fill_(0.25 * (i + 1))  # a change while gathered (gathered_parameters with a modifier) ...
        expected[: layer.weight.numel()] = 0.25 * (i + 1)
        unit.release()
        assert group.flat.untyped_storage().nbytes() == 0 and group.shard is shard  # ... lands in the shard
        assert shard.data_ptr() == address and torch.equal(shard[: whole.numel()], expected)
    assert (unit.gathers, unit.releases) == (2, 2)
