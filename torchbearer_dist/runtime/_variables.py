"""Integers read from environment variables, with a one-line error naming a bad one."""


def env_int(name, environ):
    """The integer in ``environ[name]``, or None where it is unset or empty.

    Raises:
        ValueError: the value is not an integer, naming the variable and the value
    """
    value = environ.get(name)
    if value is None or value == '':
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError('Environment variable {} should be an integer, but given {!r}; '
                         'fix or unset it'.format(name, value)) from None


def first_env_int(environ, *names):
    """The integer of the first of ``names`` set in ``environ``, or None."""
    return next((env_int(name, environ) for name in names if environ.get(name)), None)
