"""The error of a mistake in what the user asked for that only the ranks can see (a ``_target_`` that does not
import, a checkpoint lacking a weight the model has): every layer raises it, the worker prints its message once, on
rank 0, as one line, and exits with code 2, the code of a configuration refused before launch."""


class UsageError(ValueError):
    """What the user asked for cannot work; the message names what and how to fix it."""


USAGE_EXIT = 2  # the exit code of a configuration refused, before launch or by the ranks
