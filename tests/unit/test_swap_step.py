"""Disk offload streams a step through fixed buffers (one process, stage 3 at world size 1): Note [swapped step],
Note [gradients on disk], Note [read ahead], Note [explicit swap I/O].

Every test steps a small stack of linear units with its parameter shards, gradient shards, fp32 masters and AdamW
moments in swap files, against the same stack without offload stepped by the same (fused) kernel.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.offload.swap_io import SwapIO
from lightning_zero.core.offload.swap_step import SwappedStep
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.stage3.sharded_unit import UnitState

PIECE = 64  # master pieces of 64 elements: sub-groups of 4 pieces


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch) -> None:
    from lightning_zero.core.zero import optimizer as zero_optimizer

    monkeypatch.setattr(zero_optimizer, "MASTER_PIECE_NUMEL", PIECE)


def _fit(offload: OffloadConfig | None, steps: int = 3, accumulate: int = 2, clip: float | None = 0.05,
         probe: Any = None) -> tuple[list[float], list[torch.Tensor], ZeroEngine]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(24, 24) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    config = ZeroConfig(stage=3, param_persistence_threshold=0, unit_classes=(nn.Linear,), prefetch_bucket_size=1500)
    engine = ZeroEngine(model, optimizer, config, DataParallelComm(), offload=offload)
    losses = []
    x = torch.randn(6, 24)
    for _ in range(steps):
        for micro in range(accumulate):
            with engine.no_sync() if micro < accumulate - 1 else torch.enable_grad():
                engine.before_backward()
                loss = model(x + micro).square().mean()
                loss.backward()
                engine.finish_backward()
            losses.append(loss.item())
        engine.prepare_step()
        if clip is not None:
            engine.clip_grad_norm_(clip)
        if probe is not None:
            probe(engine)
        optimizer.step()
        engine.after_step()
    params = [t.clone() for t in engine.full_state_dict().values()]
    return losses, params, engine


def _nvme(path: str, **kwargs: Any) -> OffloadConfig:
    return OffloadConfig(optimizer_device="nvme", param_device="nvme", nvme_path=path, sub_group_size=4 * PIECE,
                         **kwargs)


@pytest.mark.parametrize("pipeline", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["none", "read", "write", "both"])
def test_every_part_on_disk_steps_bitwise_as_without_offload_through_the_buffers_it_is_given(tmp_path,
                                                                                            pipeline) -> None:
    read, write = pipeline
    count = 4 * (1 + read + write)  # AdamW: master, gradient, two moments per sub-group in flight
    base, base_params, plain = _fit(None)
    plain.detach(keep_optimizer_state=False, gather_params=False)
    losses, params, engine = _fit(_nvme(str(tmp_path), buffer_count=count, pipeline_read=read,
                                        pipeline_write=write))
    assert losses == base
    assert all(torch.equal(a, b) for a, b in zip(params, base_params))
    store = engine.sharded.store
    buffers = [b for s in store.swapped.sets for b in s.buffers.values()]
    assert len(store.swapped.sets) == 1 + read + write and len(buffers) == count  # fixed, and as many as asked
    assert all(b.numel() == 4 * PIECE for b in buffers)  # one sub-group each
    # the gradient shards live in swap files, and the fp32 masters are the parameter shards' own files
    assert all(os.path.basename(os.readlink(f"/proc/self/fd/{f.fd}")).endswith("(deleted)")
               for f in store.grads.files.values())
    for fi, master in enumerate(engine.sharded.masters):
        assert master.data_ptr() == store.params.file_of(engine.groups[fi]).tensor.data_ptr()
    engine.detach(keep_optimizer_state=False, gather_params=False)


def test_too_few_buffers_for_the_pipeline_are_refused_before_a_step_with_the_count(tmp_path) -> None:
    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"buffer_count=11 is too few .*takes 4 .*3 sub-group\(s\).*buffer_count>=12"):
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3), DataParallelComm(),
                   offload=_nvme(str(tmp_path), buffer_count=11))
    SwappedStep(None, 4, False, False).check(4)  # DeepSpeed's default: enough without the pipeline
    with pytest.raises(ValueError, match="buffer_count>=8"):
        SwappedStep(None, 4, True, False).check(4)


def test_reads_run_ahead_of_the_sub_group_that_steps_and_writes_behind_it(tmp_path, monkeypatch) -> None:
    events: list[str] = []
    read, write = SwapIO.read, SwapIO.write
    monkeypatch.setattr(SwapIO, "read", lambda self, f, lo, d: events.append("read") or read(self, f, lo, d))
    monkeypatch.setattr(SwapIO, "write", lambda self, f, lo, s, drop=True, after=None: events.append("write") or write(
        self, f, lo, s, drop, after))

    def probe(engine: ZeroEngine) -> None:
        events.clear()
        if "_step_sub_group" not in vars(engine.sharded):  # wrapped once: the second step is recorded
            step = engine.sharded._step_sub_group
            engine.sharded._step_sub_group = lambda sg: events.append("step") or step(sg)  # type: ignore

    _, _, engine = _fit(_nvme(str(tmp_path)), steps=2, probe=probe)
    steps = [i for i, e in enumerate(events) if e == "step"]
    assert len(steps) >= 3
    # before sub-group k steps, sub-group k + 1's reads are submitted (pipeline_read); sub-group k - 1's writes are
    # submitted before sub-group k steps and not waited for first (pipeline_write: reads of k + 1 come after them)
    for k in range(1, len(steps) - 1):
        between = events[steps[k - 1] + 1 : steps[k]]
        assert "write" in between and "read" in between, (k, between)
        assert between.index("write") < len(between) - 1 - between[::-1].index("read"), between
    engine.detach(keep_optimizer_state=False, gather_params=False)


def _resident_swap_pages() -> int:
    """Resident pages of this process's mappings of deleted (swap) files."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                current = "/swap-" in line and "(deleted)" in line
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_a_step_reads_and_writes_the_swap_files_without_mapping_them(tmp_path, monkeypatch) -> None:
    seen: list[int] = []

    def probe(engine: ZeroEngine) -> None:
        if "_step_sub_group" not in vars(engine.sharded):
            step = engine.sharded._step_sub_group
            engine.sharded._step_sub_group = lambda sg: step(sg) or seen.append(_resident_swap_pages())  # type: ignore

    _, _, engine = _fit(_nvme(str(tmp_path)), steps=2, probe=probe)
    # a module's forward also reads nothing through the mappings: units gathered by reads into their buffers
    engine.module(torch.randn(2, 24)).sum().backward()
    engine.finish_backward()
    seen.append(_resident_swap_pages())
    assert seen and max(seen) == 0, seen
    # the mapping is what uses outside a step read: a whole state dict, through it, then released again
    assert all(torch.isfinite(t).all() for t in engine.full_state_dict().values())
    engine.sharded.store.release_all()
    assert _resident_swap_pages() == 0
    engine.detach(keep_optimizer_state=False, gather_params=False)


def test_the_next_units_shards_are_read_while_the_running_unit_computes(tmp_path) -> None:
    _, _, engine = _fit(_nvme(str(tmp_path)), steps=1, clip=None)
    runtime, states = engine.runtime, []
    blocks = runtime.blocks
    for i, unit in enumerate(blocks):
        unit_modules = runtime.unit_modules[unit.index]
        unit_modules[0].register_forward_hook(
            lambda m, a, o, i=i: states.append([u.state for u in blocks[i + 1 : i + 3]]))
    engine.before_backward()
    engine.module(torch.randn(2, 24)).sum().backward()
    engine.finish_backward()
    # a window of two units (prefetch_bucket_size 1500 elements, units of 600): while unit k computes, unit k + 1
    # is being all-gathered and unit k + 2's shard is being read (Note [read ahead]); the first unit starts both
    # reads, whose gathers the next hooks issue
    assert states[0] == [UnitState.READING, UnitState.READING], states
    assert states[1:3] == [[UnitState.GATHERING, UnitState.READING], [UnitState.GATHERING]], states
    engine.detach(keep_optimizer_state=False, gather_params=False)
