"""The hang watchdog's findings as text: silent ranks, or live ranks whose collectives no longer match
(which ranks wait in which collective, which rank is behind or elsewhere, and what to check).

Rank 0 composes the text once (Note [hang watchdog] in core/reliability/heartbeat.py) and every rank prints that
same text, so the reports of a job agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lightning_zero.core.reliability.progress_record import RankProgress

SILENT_EXIT_CODE = 75  # a rank stopped beating (EX_TEMPFAIL: may succeed when restarted without that host)
STUCK_EXIT_CODE = 76  # every rank alive, no rank's progress moved (EX_PROTOCOL: the ranks' code paths differ)


@dataclass(frozen=True)
class SilentRank:
    """A rank whose heartbeat stopped: its last published step and operation (``None``: never seen), and its
    process as it published it (``rank_process.py``: where, pid, start time; ``None``: not known)."""

    rank: int
    silent_s: float
    step: int | None
    operation: str | None
    process: str | None = None

    @property
    def pid(self) -> int | None:
        """The silent rank's process id, where it published one."""
        parts = (self.process or "").split()
        return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def rank_list(ranks: Iterable[int]) -> str:
    """``rank 3`` / ``ranks 0, 2-5``: sorted ranks, consecutive runs as ranges (short at 4,096 ranks)."""
    ordered = sorted(ranks)
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ordered) == 1 else f"ranks {text}"


def silent_text(silent: Sequence[SilentRank], timeout_s: float) -> str:
    """The finding for ranks that stopped beating."""
    who = ", ".join(
        f"rank {s.rank} ({'' if s.pid is None else f'pid {s.pid}, '}silent {s.silent_s:.0f} s, last seen "
        + ("never" if s.step is None else f"at step {s.step} in {s.operation!r}") + ")"
        for s in silent
    )
    return (f"no heartbeat from {who} for more than zero.hang_timeout_s={timeout_s:g} s: the process is stopped, "
            "frozen or its host is unreachable. Check the named rank's host (dmesg, OOM killer, a debugger or "
            "SIGSTOP); raise zero.hang_timeout_s if the host is only very slow.")


def stuck_text(states: Mapping[int, RankProgress | None], stall_s: float, timeout_s: float,
               limit_s: float | None = None, interval_s: float = 0.0) -> str:
    """The finding for live ranks that made no progress for ``stall_s`` (``None``: the rank finished).

    Groups the ranks by where they are; the largest group is the reference, every other group is
    named as behind, ahead, in a different collective or in user code, with what to check.

    Args:
        states: each rank's progress (``None``: it finished).
        stall_s: the stall as measured, from reports up to ``interval_s`` old (Note [hang watchdog]: the
            decision comes one interval early, so the measured stall may be below the limit).
        timeout_s: ``zero.hang_timeout_s``.
        limit_s: the limit the stall reached (default ``timeout_s``; longer when 3 of the longest training
            step are longer).
        interval_s: the watchdog's interval.
    """
    groups: dict[str, list[int]] = {}
    sample: dict[str, RankProgress | None] = {}
    for rank in sorted(states):
        state = states[rank]
        where = "finished its fit (left the strategy's collectives)" if state is None else state.where()
        groups.setdefault(where, []).append(rank)
        sample.setdefault(where, state)
    order = sorted(groups, key=lambda w: (-len(groups[w]), groups[w][0]))
    limit_s = timeout_s if limit_s is None else limit_s
    limit = f"zero.hang_timeout_s={timeout_s:g} s" if limit_s <= timeout_s else \
        f"3 x the longest training step ({limit_s:.0f} s; zero.hang_timeout_s={timeout_s:g} s)"
    lines = [f"every rank is alive but none made progress for {limit} (measured {stall_s:.1f} s, from reports up to "
             f"one {interval_s:g} s watchdog interval old):"]
    lines += [f"  {rank_list(groups[w])}: {w}" for w in order]
    ref = sample[order[0]]
    if len(order) == 1:
        assert ref is not None
        lines.append(f"Every rank waits in the same collective #{ref.waiting_seq} {ref.kind}, which does not "
                     "complete: check the network and the backend (NCCL_DEBUG=INFO), or a process group created "
                     "differently on some ranks.")
        return "\n".join(lines)
    odd = order[1:]
    lines += [f"{rank_list(groups[w]).capitalize()}: {_relation(sample[w], ref)}." for w in odd]
    culprits = sorted(r for w in odd for r in groups[w])
    step = next((s.step for s in (sample[w] for w in odd) if s is not None), ref.step if ref else 0)
    lines.append(
        f"Check the code {rank_list(culprits)} ran at step {step}: a collective called on some ranks only (a "
        "torch.distributed call, self.log(..., sync_dist=True), a barrier or a checkpoint save under `if "
        "self.global_rank == ...` or a condition on the data), or data-dependent control flow that makes the "
        "ranks issue different collectives (ZeRO-3: a module used on some ranks only gathers its parameters "
        "there only). Stopping every rank instead of waiting for the collective timeout (zero.timeout_s).")
    return "\n".join(lines)


def _relation(state: RankProgress | None, ref: RankProgress | None) -> str:
    """How a group's position differs from the reference group's."""
    if state is None:
        return "finished while the others still wait for it"
    if ref is None:
        return "still running while the others finished"
    if state.inside and ref.inside:
        if state.waiting_seq == ref.waiting_seq:
            return (f"in a different collective: #{state.waiting_seq} is {state.kind} there and {ref.kind} on "
                    "the others")
        ahead = state.waiting_seq > ref.waiting_seq
        return (f"{'ahead' if ahead else 'behind'}: in collective #{state.waiting_seq} {state.kind} against "
                f"#{ref.waiting_seq} {ref.kind} on the others")
    if not state.inside and ref.inside:
        if state.seq < ref.waiting_seq:
            return (f"behind, in user code ({state.phase!r}): not yet at the strategy's collective "
                    f"#{ref.waiting_seq} {ref.kind} the others wait in (stuck in a collective of their own, a "
                    "deadlock or a loop)")
        return (f"in user code ({state.phase!r}) past collective #{ref.waiting_seq}, which the others still "
                "wait in")
    if state.inside:
        return (f"waiting in the strategy's collective #{state.waiting_seq} {state.kind} while the others are in "
                f"user code ({ref.phase!r}) and have not reached it")
    return f"in user code at a different place ({state.phase!r} at step {state.step})"
