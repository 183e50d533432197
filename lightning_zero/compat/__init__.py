"""Every former path of the package, served from this one place for one release (Note [former paths] in
``finder.py``); ``former.py`` is the table, ``docs/design.md`` ("Former paths") lists it for readers.

``import lightning_zero`` calls :func:`install` first. No module outside this folder keeps a former name.
"""

from lightning_zero.compat.finder import FormerPathFinder, install
from lightning_zero.compat.former import FORMER_METHODS, FORMER_MODULES, FORMER_NAMES, FormerModule, FormerName

__all__ = ["FORMER_METHODS", "FORMER_MODULES", "FORMER_NAMES", "FormerModule", "FormerName", "FormerPathFinder",
           "install"]
