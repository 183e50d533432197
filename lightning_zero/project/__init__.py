"""The user's own code in a config (tools layer): ``_target_`` nodes for the model, the data, callbacks and
loggers (Note [user targets] in ``targets.py``), found from the project directory (Note [project directory] in
``locate.py``), checked before launch from their source and on each rank before anything is built, and
instantiated with ``hydra.utils.instantiate``.

* :mod:`~lightning_zero.project.targets` -- ``TargetNode``: one ``_target_`` node as the config holds it.
* :mod:`~lightning_zero.project.locate` -- the project directory, the checks from the source, ``locate``.
* :mod:`~lightning_zero.project.instantiate` -- a node made into its object on a rank.
"""

from lightning_zero.project.instantiate import instantiate_entries, instantiate_target
from lightning_zero.project.locate import TargetError, locate, static_problems, use_project_dir
from lightning_zero.project.targets import TargetNode, is_target, target_entries

__all__ = [
    "TargetError",
    "TargetNode",
    "instantiate_entries",
    "instantiate_target",
    "is_target",
    "locate",
    "static_problems",
    "target_entries",
    "use_project_dir",
]
