"""Reliability in the Lightning layer: the hang watchdog, the non-finite guard, the setup agreement.

Public pieces: ``long_phase`` and the watchdog (``hang_watchdog``), the non-finite gradient guard
(``nonfinite_guard``), and the agreement checked before training (``setup_agreement``). docs/reliability.md.
"""
