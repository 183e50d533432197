"""Torch-only reliability: this rank's progress, the hang heartbeat and what it finds.

Public pieces: ``HeartbeatWatchdog``, ``HangReport`` (``heartbeat``), this rank's progress, ``ProgressRecord``,
``RankProgress``, ``RECORD`` (``progress_record``), and the findings as text (``hang_finding``). Below ``comm`` in
core/'s order: every collective records itself into ``RECORD``; the setup agreement, a collective, is
``core/comm/agreement.py``. The Lightning glue is ``lightning_zero/reliability/``.
"""

from lightning_zero.core.reliability.heartbeat import HangReport, HeartbeatWatchdog
from lightning_zero.core.reliability.progress_record import RECORD, ProgressRecord, RankProgress

__all__ = ["RECORD", "HangReport", "HeartbeatWatchdog", "ProgressRecord", "RankProgress"]
