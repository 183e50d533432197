"""From a checked config to running ranks: ``launch`` (the ``train`` command: Hydra, the checks, then the ranks via
torchrun), ``worker`` (one rank, reading the run's ``config.yaml``), ``build`` (a config -> ZeroStrategy / Trainer /
LightningModule / DataModule, and the fit), ``console`` (the ranks' console and failure summary), ``deepspeed`` (a
DeepSpeed JSON merged into the config). Nothing in ``config/`` imports this folder: it sits on top of the schemas,
the settings route and the checks there. Nothing is imported here: the launcher runs without Lightning until a rank
builds its fit (``build``), and ``python -m lightning_zero.config.run.worker`` is a rank.
"""
