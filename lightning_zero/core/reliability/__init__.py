"""Torch-only reliability: the setup agreement, the hang heartbeat and what it finds.

Public pieces named here: ``HeartbeatWatchdog``, ``HangReport`` (``heartbeat``), this rank's progress,
``ProgressRecord``, ``RankProgress`` (``progress_record``), and the findings as text (``hang_finding``).
The setup agreement (``agreement``: ``check_same_everywhere``, first differing entry and rank) is imported from
its module: it imports ``core/comm``, whose ``data_parallel`` imports ``progress_record``, an import cycle
through this ``__init__``. The Lightning glue is ``lightning_zero/reliability/``.
"""

from lightning_zero.core.reliability.heartbeat import HangReport, HeartbeatWatchdog
from lightning_zero.core.reliability.progress_record import ProgressRecord, RankProgress

__all__ = ["HangReport", "HeartbeatWatchdog", "ProgressRecord", "RankProgress"]
