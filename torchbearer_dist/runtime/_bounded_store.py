"""(private) The job's store as the handshake of a rank > 0 uses it: each call bounded by the rendezvous timeout.

Kept out of rendezvous.py because it is a fault mechanism of its own: a helper thread that shuts this
process's store connections (found through ``_gloo_sockets``) when the master stops answering.
"""
import threading
import time

from torchbearer_dist.runtime import _diagnosis, _gloo_sockets
from torchbearer_dist.runtime.errors import PeerFailedError


class Bounded:
    """The job's store as the handshake of a rank > 0 uses it: each call bounded by the rendezvous timeout.

    A master whose process is stopped (Ctrl-Z, ``kill -STOP``) or whose host froze still has its kernel
    accept and buffer what is sent, and never answers: torch's client then retries its read past its own
    timeout (measured, torch 2.14: a ``check`` on a SIGSTOPped master blocked for over 100 s with a 3 s
    timeout), and the peers of a rank 0 stopped inside the handshake waited in ``_wait`` without end. A
    helper thread shuts this process's connections to the store down once one call has run for
    ``seconds``, which fails that call at once; the store is then taken for silent, and every later call,
    the fault path's reads and publishes of a cause included, fails at once without touching it, with a
    :class:`PeerFailedError` naming rank 0, as the heartbeat names a silent master after the handshake.
    """

    def __init__(self, store, env, seconds):
        self.store, self.env, self.seconds = store, env, seconds
        self.connections = _gloo_sockets.store_connections(env.host, env.port)
        self.since, self.silent = None, False
        self._done = threading.Event()
        threading.Thread(target=self._watch, name='torchbearer_dist-rendezvous', daemon=True).start()

    def _watch(self):  # no torch call here: nothing left inside one at exit
        while not self._done.wait(0.1):
            since = self.since
            if since is not None and time.monotonic() - since > self.seconds:
                self.silent = True
                _gloo_sockets.shut_down_connections(self.connections)
                return

    def close(self):
        """Stop the helper thread; the store is the caller's again, unbounded."""
        self._done.set()

    def failure(self):
        """The :class:`PeerFailedError` of a silent master, for the rank ``self.env.rank``."""
        return PeerFailedError.from_cause(_diagnosis.master_silent(self.env, self.seconds), self.env.rank)

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def bounded(*args, **kwargs):
            if self.silent:
                raise self.failure()
            self.since = time.monotonic()
            try:
                return method(*args, **kwargs)
            except Exception:
                if self.silent:
                    raise self.failure() from None
                raise
            finally:
                self.since = None
        return bounded


def bounded(store, env):
    """``store`` bounded as :class:`Bounded` says, where it is a TCP store that another process holds."""
    if env.rank == 0 or env.world_size == 1 or env.init_method is not None:
        return None
    return Bounded(store, env, env.meet_timeout.total_seconds())
