"""The hang watchdog's progress logic, single process with a fake clock and store (helpers from
tests/e2e/test_hang_watchdog.py): NCCL collectives issued but not completed, the timeout + one interval bound
on every rank, the first steps of each fit and a slow data loader exempt, ``lightning_zero.long_phase``,
nested recorded blocks, and a rank 0 that wakes after another rank named it."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_zero.core.reliability.heartbeat import HeartbeatWatchdog
from lightning_zero.core.reliability.progress_record import ProgressRecord, parse_progress
from tests.e2e.test_hang_watchdog import Clock, _diverged, _ranks, _round


class FakeWork:
    """A collective's handle as NCCL returns it: issued, completed later on the device."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_a_rank_blocked_after_an_nccl_collective_returned_counts_as_waiting_in_it() -> None:
    # NCCL: the collective returns at once and the host blocks later (flags[r].item()), outside any block
    clock, _, dogs, _ = _ranks()
    works = []
    for d in dogs:
        d.record.device_probe = FakeWork  # what comm.blocking's exit records (a CUDA event on NCCL)
        for _ in range(3):
            with d.record.collective("all_gather"):
                pass
            d.record.pending[2].done = True
        d.mark("training_step", 3)
    for d in (dogs[0], dogs[2]):  # ranks 0 and 2 issue collective #4, which never completes: rank 1 skipped it
        with d.record.collective("all_reduce (flags)"):
            pass
        works.append(d.record.pending[2])
    state = parse_progress(dogs[0].record.to_text(1))
    assert state is not None and state.inside and state.waiting_seq == 4
    for _ in range(8):
        assert _round(dogs, clock) == [None, None, None]
    found = _round(dogs, clock)
    assert all(r is not None and r.kind == "stuck" for r in found), found
    text = found[0].text
    assert "ranks 0, 2: waiting in the strategy's collective #4 all_reduce (flags) (issued, not completed)" in text
    assert "Rank 1: behind, in user code ('training_step')" in found[0].text
    works[0].done = works[1].done = True  # completed: back in user code
    assert not parse_progress(dogs[0].record.to_text(2)).inside  # type: ignore[union-attr]


def test_an_async_collective_s_handle_is_polled_until_it_completes() -> None:
    record = ProgressRecord(Clock())
    work = FakeWork()
    record.track(record.issued("reduce_scatter"), "reduce_scatter", work)
    state = parse_progress(record.to_text(1))
    assert state is not None and (state.waiting_seq, state.kind) == (1, "reduce_scatter (issued, not completed)")
    work.done = True
    state = parse_progress(record.to_text(2))
    assert state is not None and not state.inside and state.seq == 1


def _run_until_found(dogs: list[HeartbeatWatchdog], clock: Clock, offsets: list[float],
                     limit_s: float) -> dict[int, float]:
    """Each rank runs its own loop (beat, check, sleep ``next_wait_s()``), rank r starting ``offsets[r]`` s
    late: the worst phases. Returns when each rank got the finding, on the shared clock."""
    start = clock.now
    by_rank = {d.rank: d for d in dogs}
    wake = {r: start + offsets[r] for r in by_rank}
    found: dict[int, float] = {}
    while len(found) < len(dogs) and clock.now < start + limit_s:
        rank = min((r for r in wake if r not in found), key=lambda r: wake[r])
        clock.now = wake[rank]
        by_rank[rank].beat()
        if by_rank[rank].check() is not None:
            found[rank] = clock.now
        wake[rank] = clock.now + by_rank[rank].next_wait_s()
    return found


@pytest.mark.parametrize("offsets", [[0.0, 0.5, 0.99], [0.99, 0.0, 0.5], [0.3, 0.98, 0.01]])
def test_every_rank_gets_a_stall_finding_within_the_timeout_plus_one_interval(offsets: list[float]) -> None:
    clock, _, dogs, _ = _ranks()  # timeout 10 s, interval 1 s
    _diverged(dogs)  # progress stops now
    stopped = clock.now
    found = _run_until_found(dogs, clock, offsets, 30.0)
    assert sorted(found) == [0, 1, 2], found
    # no earlier than the timeout less the one interval the ages seen may lag, no later than one interval after it
    assert all(9.0 <= t - stopped <= 11.0 + 1e-9 for t in found.values()), {r: t - stopped for r, t in found.items()}


def test_every_live_rank_gets_a_silence_finding_within_the_timeout_plus_one_interval() -> None:
    clock, _, dogs, _ = _ranks()
    _round(dogs, clock)
    stopped = clock.now  # rank 1 (SIGSTOPped) beats no more from here
    found = _run_until_found([dogs[0], dogs[2]], clock, [0.99, 0.0, 0.5], 30.0)
    assert sorted(found) == [0, 2], found
    assert all(t - stopped <= 11.0 + 1e-9 for t in found.values()), {r: t - stopped for r, t in found.items()}


def _callbacks(dogs: list[HeartbeatWatchdog]) -> list[Any]:
    """The Lightning glue (HangWatchdog) of each rank, around the fake-clock watchdogs."""
    from lightning_zero.reliability.hang_watchdog import HangWatchdog
    hooks = []
    for d in dogs:
        hook = HangWatchdog(d.timeout_s, on_hang=lambda r: None)
        hook.watchdog = d
        hooks.append(hook)
    return hooks


class FakeTrainer:
    def __init__(self, global_step: int) -> None:
        self.global_step = global_step


def test_the_first_step_of_a_resumed_fit_is_exempt_until_a_step_time_is_measured() -> None:
    clock, _, dogs, _ = _ranks()
    hooks, trainer = _callbacks(dogs), FakeTrainer(100)  # resumed from a checkpoint at step 100
    for h in hooks:
        h.on_train_batch_start(trainer)
    with dogs[0].record.collective("all_gather"):  # rank 0 waits while rank 1 compiles its first step for 30 s
        for _ in range(30):
            assert _round(dogs, clock) == [None, None, None]
    for step in (100, 101):  # the first step (compilation) is apart; the second is measured: 1 s
        trainer.global_step = step
        for h in hooks:
            h.on_train_batch_start(trainer)
        clock.now += 1.0
        for h in hooks:
            h.on_train_batch_end(trainer)
    assert all(d.record.step_s == 1.0 for d in dogs)
    trainer.global_step = 102
    for h in hooks:  # measured now: a stall of rank 1 in user code is named
        h.on_train_batch_start(trainer)
    dogs[0].record.collective("all_reduce").__enter__()
    found = [r for _ in range(12) for r in _round(dogs, clock)]
    assert any(r is not None and r.kind == "stuck" for r in found)


def test_a_slow_data_loader_between_steps_is_never_stuck() -> None:
    clock, _, dogs, _ = _ranks()
    hooks, trainer = _callbacks(dogs), FakeTrainer(0)
    for step in range(3):
        trainer.global_step = step
        for h in hooks:
            h.on_train_batch_start(trainer)
        clock.now += 1.0
        for h in hooks:
            h.on_train_batch_end(trainer)
    trainer.global_step = 3
    hooks[0].on_train_batch_start(trainer)
    dogs[0].record.collective("all_reduce").__enter__()  # rank 0 waits; rank 1's data loader takes 30 s
    for _ in range(30):
        assert _round(dogs, clock) == [None, None, None]


def test_long_phase_marks_one_rank_s_own_long_work_and_restores_the_phase_after() -> None:
    import lightning_zero
    clock, _, dogs, _ = _ranks()
    _diverged(dogs)  # ranks 0, 2 wait in #4; rank 1 is in training_step
    with lightning_zero.long_phase("sampling", record=dogs[1].record):  # rank 1 samples alone for 30 s
        for _ in range(30):
            assert _round(dogs, clock) == [None, None, None]
        assert "sampling" in dogs[1].record.to_text(1)
    assert (dogs[1].record.phase, dogs[1].record.long_phase) == ("training_step", False)
    found = [r for _ in range(10) for r in _round(dogs, clock)]
    assert any(r is not None and r.kind == "stuck" for r in found)


def test_a_collective_nested_in_the_pipeline_schedule_s_block_leaves_the_rank_waiting_in_the_schedule() -> None:
    record = ProgressRecord(Clock())
    with record.collective("pipeline send/recv (schedule)"):
        with record.collective("all_reduce"):  # the stage's data-parallel reduction, inside the schedule
            pass
        state = parse_progress(record.to_text(1))
        assert state is not None and (state.waiting_seq, state.kind) == (1, "pipeline send/recv (schedule)")
    state = parse_progress(record.to_text(2))
    assert state is not None and not state.inside and state.seq == 2


def test_rank_0_waking_after_another_rank_named_it_keeps_that_finding() -> None:
    clock, store, dogs, _ = _ranks()
    _round(dogs, clock)
    for _ in range(10):  # rank 0 stopped: rank 1 and 2 name it
        found = _round(dogs, clock, skip=(0,))
    assert all(r is not None and "no heartbeat from rank 0" in r.text for r in found), found
    clock.now += 1  # rank 0 wakes up (SIGCONT) and runs a round: it reports the job's finding, not "ok"
    dogs[0].beat()
    mine = dogs[0].check()
    assert mine is not None and mine.text == found[0].text
    assert "no heartbeat from rank 0" in store.data["lightning_zero/heartbeat/verdict"].decode()
