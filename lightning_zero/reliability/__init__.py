"""Reliability in the Lightning layer: the hang watchdog, the non-finite guard, the setup agreement.

Public pieces: ``long_phase`` and the watchdog, ``HangWatchdog`` (``hang_watchdog``), the non-finite gradient
guard, ``NonFiniteGuard`` (``nonfinite_guard``), the agreement checked before training, ``setup_settings``
(``setup_agreement``), and a step error raised on every rank naming the rank, ``StepFailedElsewhere``
(``step_errors``). docs/reliability.md.
"""

from lightning_zero.reliability.hang_watchdog import HangWatchdog, long_phase
from lightning_zero.reliability.nonfinite_guard import NonFiniteGuard
from lightning_zero.reliability.setup_agreement import setup_settings
from lightning_zero.reliability.step_errors import StepFailedElsewhere

__all__ = ["HangWatchdog", "NonFiniteGuard", "StepFailedElsewhere", "long_phase", "setup_settings"]
