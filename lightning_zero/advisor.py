"""Former home of ``lightning_zero.estimator.advisor`` (moved in 0.2): importing it from here still works for one
release and warns where it moved."""

import warnings

from lightning_zero.estimator.advisor import Advice, Candidate, Hardware, Shortfall, advise, needs_of

warnings.warn("lightning_zero.advisor moved to lightning_zero.estimator.advisor"
              "; import from there (this path goes away in the next release)",
              DeprecationWarning, stacklevel=2)

__all__ = ['Advice', 'Candidate', 'Hardware', 'Shortfall', 'advise', 'needs_of']
