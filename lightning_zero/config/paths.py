"""Where the Hydra configs live: the ``conf/`` directory and the root config's name."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_NAME = "config"
CONF_ENV = "LIGHTNING_ZERO_CONF"


def conf_dir() -> Path:
    """The ``conf/`` directory: ``$LIGHTNING_ZERO_CONF`` if set, else the one beside the package."""
    path = Path(os.environ.get(CONF_ENV) or Path(__file__).resolve().parents[2] / "conf")
    if not (path / f"{CONFIG_NAME}.yaml").is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME}.yaml in {path}; set {CONF_ENV} to the conf/ directory")
    return path
