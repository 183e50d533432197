"""Torch-only reliability: the setup agreement, the hang heartbeat and what it finds.

Public pieces: ``agreement`` (first differing entry and rank), ``Heartbeat`` (``heartbeat``), this rank's
progress (``progress_record``) and the findings as text (``hang_finding``). The Lightning glue is
``lightning_zero/reliability/``.
"""
