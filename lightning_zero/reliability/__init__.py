"""Reliability in the Lightning layer: the hang watchdog, the non-finite guard, the setup agreement.

Public pieces: ``long_phase`` and the watchdog, ``HangWatchdog`` (``hang_watchdog``), the non-finite gradient
guard, ``NonFiniteGuard`` (``nonfinite_guard``), and the agreement checked before training, ``setup_settings``
(``setup_agreement``). docs/reliability.md.
"""

from lightning_zero.reliability.hang_watchdog import HangWatchdog, long_phase
from lightning_zero.reliability.nonfinite_guard import NonFiniteGuard
from lightning_zero.reliability.setup_agreement import setup_settings

__all__ = ["HangWatchdog", "NonFiniteGuard", "long_phase", "setup_settings"]
