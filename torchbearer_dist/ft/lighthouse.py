"""The lighthouse: torchft's quorum server, started from Python or with one command on one machine.

.. code-block:: text

    python -m torchbearer_dist.ft --min-replicas 1 --bind 0.0.0.0:29510
    torchft_lighthouse --min_replicas 1 --bind 0.0.0.0:29510     # torchft's own command, the same server

torchft's Rust log is at WARN here unless ``RUST_LOG`` (or ``TORCHBEARER_DIST_FT_VERBOSE=1``, torchft's
default: INFO, lines for every quorum) says otherwise. The replicas watch the lighthouse through the dashboard it
serves at ``/`` (``http://HOST:29510/``, torchft's): one that has not answered for their ``timeout`` is lost,
one restarted at the same address within it is rejoined.
"""
import argparse
import signal
import sys
import threading

from torchbearer_dist.ft.replica import require_torchft

#: The lighthouse's port unless told otherwise (torchft's default).
DEFAULT_PORT = 29510
#: Where the lighthouse listens unless told otherwise: every interface, torchft's port.
DEFAULT_BIND = '0.0.0.0:{}'.format(DEFAULT_PORT)


class Lighthouse:
    """A torchft lighthouse running in this process (a Rust server on its own threads), until :meth:`shutdown`.

    Example: ::

        >>> from torchbearer_dist.ft import Lighthouse
        >>> with Lighthouse(bind='127.0.0.1:0') as lighthouse:   # doctest: +SKIP
        ...     print(lighthouse.address)
        http://127.0.0.1:41237

    Args:
        bind (str): ``HOST:PORT`` to listen on (port 0: any free port)
        min_replicas (int): the fewest live replicas that make a quorum
        join_timeout (float): seconds a quorum waits for a live (heartbeating) replica that has not asked yet; at
            least the replicas' ``timeout``, so that one stuck that long with a lost peer is not left out of a
            quorum a starting replica forms meanwhile (two quorums training apart)
        heartbeat_timeout (float): seconds without a heartbeat after which a replica counts as lost

    Raises:
        ValueError: a bad option
        RuntimeError: torchft is missing, or ``bind`` cannot be bound
    """

    def __init__(self, bind=DEFAULT_BIND, min_replicas=1, join_timeout=60.0, heartbeat_timeout=5.0):
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError('min_replicas should be an integer >= 1, but given {!r}'.format(min_replicas))
        for name, value in (('join_timeout', join_timeout), ('heartbeat_timeout', heartbeat_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError('{} should be a positive number of seconds, but given {!r}'.format(name, value))
        require_torchft()
        from torchft.coordination import LighthouseServer
        try:
            self._server = LighthouseServer(bind=bind, min_replicas=min_replicas,
                                            join_timeout_ms=int(join_timeout * 1000),
                                            heartbeat_timeout_ms=int(heartbeat_timeout * 1000))
        except Exception as e:
            raise RuntimeError('the lighthouse cannot listen on {} ({}); pass another --bind'.format(
                bind, str(e).splitlines()[0] if str(e) else type(e).__name__)) from None
        self.address = self._server.address()

    def shutdown(self):
        """Stop serving; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def main(argv=None):
    """``python -m torchbearer_dist.ft``: serve until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(description='Run the lighthouse of a fault-tolerant torchbearer_dist job.')
    parser.add_argument('--bind', type=str, default=DEFAULT_BIND, help='HOST:PORT to listen on')
    parser.add_argument('--min-replicas', type=int, default=1, help='fewest live replicas that train')
    parser.add_argument('--join-timeout', type=float, default=60.0,
                        help="seconds a quorum waits for a live replica (at least the replicas' timeout)")
    parser.add_argument('--heartbeat-timeout', type=float, default=5.0,
                        help='seconds of silence after which a replica is lost')
    args = parser.parse_args(argv)
    try:
        lighthouse = Lighthouse(args.bind, args.min_replicas, args.join_timeout, args.heartbeat_timeout)
    except (ValueError, RuntimeError) as e:
        print('error: {}'.format(e), file=sys.stderr)
        return 2
    print('lighthouse at {} (min {} replicas); replicas take --lighthouse {}'.format(
        lighthouse.address, args.min_replicas, lighthouse.address), flush=True)
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    done.wait()
    lighthouse.shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
