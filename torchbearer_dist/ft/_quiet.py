"""(private) torchft's own output, quiet by default: a replica writes one line per event (:mod:`._events`).

Left alone, torchft writes on stderr, besides its Rust log (INFO, several lines a step, where ``RUST_LOG`` is
unset): a traceback for each error it swallows (a lost peer's gloo error: four lines; a heal cut short: twenty),
an access line for each request its heal server answers, socketserver's traceback for each broken pipe of a heal
cut short, and torch's warning that a healed tensor's buffer is not writable.

While a :class:`~torchbearer_dist.ft.replica.Replica` lives (:class:`Quiet`), these go to the logger
``torchbearer_dist.ft.torchft`` (:data:`LOGGER`), which writes nothing itself: they are seen where the program
configures logging (e.g. ``logging.basicConfig()``), and torch's warning is ignored. ``RUST_LOG=warn`` holds
while torchft is first imported, where ``RUST_LOG`` is unset. ``TORCHBEARER_DIST_FT_VERBOSE=1``
(:data:`VERBOSE`) changes none of this: torchft's output as torchft writes it.
"""
import contextlib
import importlib
import logging
import os
import sys
import threading
import warnings

#: The environment variable that leaves torchft's output as torchft writes it, when ``1``.
VERBOSE = 'TORCHBEARER_DIST_FT_VERBOSE'
#: The logger that torchft's Python log, its heal server's access lines and broken pipes go to.
LOGGER = 'torchbearer_dist.ft.torchft'
#: torchft's Python loggers: the package's, whose children every module of torchft logs to.
TORCHFT = 'torchft'
#: torch's warning on each heal (``torch.frombuffer`` on the received bytes), ignored: the bytes are not shared.
BUFFER_WARNING = dict(message='The given buffer is not writable', category=UserWarning,
                      module=r'torch\.distributed\._serialization')

logger = logging.getLogger(LOGGER)
logger.addHandler(logging.NullHandler())  # no output of its own, nor Python's last resort (stderr)


def verbose():
    """Whether ``TORCHBEARER_DIST_FT_VERBOSE`` asks for torchft's output as torchft writes it."""
    return os.environ.get(VERBOSE, '').strip() not in ('', '0')


def import_torchft():
    """``import torchft``: the first time, with ``RUST_LOG=warn`` where it is unset (torchft reads it then only),
    unless :func:`verbose`; ``os.environ`` is left as it was."""
    if 'torchft' in sys.modules or verbose() or 'RUST_LOG' in os.environ:
        return importlib.import_module('torchft')
    os.environ['RUST_LOG'] = 'warn'
    try:
        return importlib.import_module('torchft')
    finally:
        os.environ.pop('RUST_LOG', None)


class _Forward(logging.Handler):
    """Hands torchft's records to :data:`LOGGER` (its handlers and its ancestors', where logging is configured)."""

    def emit(self, record):
        logger.handle(record)


class Quiet:
    """torchft's Python output to :data:`LOGGER` and torch's heal warning ignored, from :meth:`open` to
    :meth:`close`; both nest (one replica's life in another's, in one process), neither does anything when
    :func:`verbose`. What it found is put back at the last :meth:`close`."""

    _lock, _depth, _found = threading.Lock(), 0, None

    @classmethod
    def open(cls):
        if verbose():
            return False
        with cls._lock:
            cls._depth += 1
            if cls._depth == 1:
                torchft = logging.getLogger(TORCHFT)
                handler = _Forward()
                cls._found = (torchft.level, torchft.propagate, handler)
                torchft.addHandler(handler)
                torchft.propagate = False
                torchft.setLevel(logging.WARNING)  # its INFO lines stay out even where logging is set to DEBUG
                warnings.filterwarnings('ignore', **BUFFER_WARNING)
                cls._found += (warnings.filters[0],)
        return True

    @classmethod
    def close(cls):
        with cls._lock:
            if cls._depth == 0:
                return
            cls._depth -= 1
            if cls._depth > 0:
                return
            level, propagate, handler, entry = cls._found
            cls._found = None
            torchft = logging.getLogger(TORCHFT)
            torchft.removeHandler(handler)
            torchft.propagate = propagate
            if torchft.level == logging.WARNING:  # not if set since (a replica ending on a signal silences it)
                torchft.setLevel(level)
            with contextlib.suppress(ValueError):
                warnings.filters.remove(entry)


def quiet_heal_server(server):
    """The heal server ``server`` (a ``socketserver`` HTTP server) writes its access lines and the tracebacks of
    requests it lost (a broken pipe: the healing replica went) to :data:`LOGGER`, not stderr; not if :func:`verbose`.
    """
    if verbose():
        return

    class Handler(server.RequestHandlerClass):
        def log_message(self, format, *args):
            logger.info('heal server %s: %s', self.address_string(), format % args)

    def handle_error(request, client_address):
        logger.info('heal server: a request from %s ended in an error (the healing replica went?)',
                    client_address[0] if client_address else '?', exc_info=True)

    server.RequestHandlerClass = Handler  # read at each request: the serving thread may already run
    server.handle_error = handle_error
