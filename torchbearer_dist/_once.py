"""A warning given once per process: what the private-internals modules say when a guarantee is lost."""
import warnings

_given = set()


def warn_once(message, category=RuntimeWarning):
    """Warn with ``message`` unless this process already did.

    Args:
        message (str): what changed and which guarantee is lost because of it
        category (type): the warning's class
    """
    if message in _given:
        return
    _given.add(message)
    warnings.warn(message, category, stacklevel=3)
