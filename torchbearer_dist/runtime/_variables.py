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
