"""Hydra configs of ``lightning-zero train``: schemas, cross-group validation, builders and the launcher.

* :mod:`~lightning_zero.config.schema` -- typed group schemas in Hydra's ConfigStore (the settings groups':
  :mod:`~lightning_zero.config.settings_schema`).
* :mod:`~lightning_zero.config.settings` -- a config as the settings tree (the Hydra route in).
* :mod:`~lightning_zero.config.validate` -- :func:`validate_config`, the one cross-group gate, running one check
  per concern (``value_checks``, ``parallel_checks``, ``model_checks``);
  :mod:`~lightning_zero.config.describe` the line printed before launch.
* :mod:`~lightning_zero.config.run.build` -- config -> ZeroStrategy / Trainer / LightningModule / DataModule.
* :mod:`~lightning_zero.config.run.launch` -- the ``train`` command: Hydra, then ranks via torchrun.
* :mod:`~lightning_zero.config.run.worker` -- one rank, reading the run's ``config.yaml``.

Only this package imports Hydra / OmegaConf; :mod:`lightning_zero.core` never does.
"""

from lightning_zero.config.describe import describe
from lightning_zero.config.paths import register_configs
from lightning_zero.config.schema import TrainConfig, to_train_config
from lightning_zero.config.validate import validate_config

__all__ = ["TrainConfig", "describe", "register_configs", "to_train_config", "validate_config"]
