"""This process as one torchft replica group: its store, its gloo group and its Manager (torchft's public API only;
:class:`~torchbearer_dist.ft.callback.FaultTolerantAllReduce` drives it through a Trial)."""
import logging
import os
import socket
from datetime import timedelta
from urllib.parse import urlparse

from torch.distributed import TCPStore

from torchbearer_dist.runtime.network import route_source

#: A quorum may take this many ``timeout``\ s: the others may be stuck up to one ``timeout`` in a collective
#: with a lost peer, and the lighthouse waits for them (its join timeout, at least one ``timeout``).
QUORUM_TIMEOUTS = 3
#: How a user installs torchft, in every error that finds it missing.
INSTALL = 'pip install "torchbearer_dist[ft]"'


def require_torchft():
    """The ``torchft`` package, imported; a one-line RuntimeError saying how to install it where it is missing."""
    try:
        import torchft
        import torchft.coordination  # noqa: F401
    except ImportError as e:
        raise RuntimeError('the fault-tolerant mode needs torchft, which is not importable ({}); install it with '
                           '{}'.format(e, INSTALL)) from None
    return torchft


def lighthouse_address(lighthouse):
    """``lighthouse`` (``host:port``, a URL, or None/True: ``$TORCHFT_LIGHTHOUSE``) as ``http://host:port``; a
    ValueError where none is given or it has no port."""
    if lighthouse in (None, True):
        lighthouse = os.environ.get('TORCHFT_LIGHTHOUSE')
        if not lighthouse:
            raise ValueError('fault_tolerant=True needs the lighthouse address: pass fault_tolerant="HOST:PORT" or '
                             'set TORCHFT_LIGHTHOUSE (start one with python -m torchbearer_dist.ft)')
    if not isinstance(lighthouse, str):
        raise ValueError('the lighthouse should be an address "HOST:PORT", but given {!r}'.format(lighthouse))
    url = lighthouse if '://' in lighthouse else 'http://' + lighthouse
    try:
        port = urlparse(url).port
    except ValueError:
        port = None
    if port is None or not urlparse(url).hostname:
        raise ValueError('the lighthouse should be an address "HOST:PORT", but given {!r}'.format(lighthouse))
    return url


def check_lighthouse(url, timeout):
    """Raise a one-line RuntimeError unless the lighthouse at ``url`` answers within ``timeout`` seconds."""
    from torchft.coordination import LighthouseClient
    try:
        LighthouseClient(url, connect_timeout=timedelta(seconds=timeout))  # connects, or raises
    except Exception:  # torchft raises RuntimeError with a Rust transport chain of several lines
        raise RuntimeError('the lighthouse at {} did not answer within {:g} s; start it (python -m torchbearer_dist.ft '
                           '--min-replicas N) or pass its address'.format(url, timeout)) from None


def _transport(host, timeout):
    """torchft's HTTP checkpoint transport, advertising ``host`` where torchft advertises the host name (which
    may resolve to another address, as in a network namespace or behind NAT)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self):
            url = urlparse(super().address())
            return url._replace(netloc='{}:{}'.format(host, url.port)).geturl()

    return Transport(timeout=timeout, num_chunks=0)


class Replica:
    """This process as a replica group of one: a TCPStore, a torchft gloo group and a ``torchft.Manager``.

    The Manager averages through the group over the replicas of each quorum, and serves this replica's
    state (``state_dict()``) to replicas that heal from it, or loads a healthy one's (``load_state_dict``).

    Args:
        lighthouse (str): the lighthouse's URL
        replica_id (str): this replica's name, the same when it restarts
        load_state_dict (callable): loads what ``state_dict`` returned, when this replica heals
        state_dict (callable): this replica's state, sent to a replica that heals from it
        min_replicas (int): fewer live replicas than this and the others wait (up to ``timeout``)
        timeout (float): seconds for a collective and a heal; a quorum may take three times as long
        host (str): the address other replicas reach this one at (default: the one on the route to the lighthouse)

    Raises:
        RuntimeError: torchft is missing, or the lighthouse does not answer within ``timeout``
    """

    def __init__(self, lighthouse, replica_id, load_state_dict, state_dict, min_replicas=1, timeout=60.0, host=None):
        torchft = require_torchft()
        self.lighthouse, self.replica_id = lighthouse, replica_id
        check_lighthouse(lighthouse, timeout)
        parsed = urlparse(lighthouse)
        self.host = host or route_source(parsed.hostname, parsed.port) or socket.gethostname()
        logging.getLogger('torchft').setLevel(logging.WARNING)
        # The replica group's own store: one process per group, so this process is its master.
        limit = timedelta(seconds=timeout)
        self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=limit)
        self.group = torchft.ProcessGroupGloo(timeout=limit)
        self.manager = torchft.Manager(
            pg=self.group, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_replicas,
            use_async_quorum=False, timeout=limit, quorum_timeout=QUORUM_TIMEOUTS * limit, connect_timeout=limit,
            rank=0, world_size=1, store_addr=self.host, store_port=self._store.port, lighthouse_addr=lighthouse,
            replica_id=replica_id, hostname=self.host, checkpoint_transport=_transport(self.host, limit))
        self.timeout, self.min_replicas = timeout, min_replicas

    def start_quorum(self, shrink_only=False):
        """Join the next quorum (healing here if behind); ``shrink_only``: of the last one's replicas only.

        Raises:
            RuntimeError: no quorum within the timeout: the lighthouse no longer answers (named), or too few replicas

        .. warning:: A synchronization point with the lighthouse and the other live replicas.
        """
        try:
            self.manager.start_quorum(shrink_only=shrink_only)
        except Exception as e:
            if isinstance(e, RuntimeError) and str(e).startswith('this replica cannot heal'):
                raise  # the heal's own one-line error (_heal.restore), raised on this replica only
            check_lighthouse(self.lighthouse, min(self.timeout, 5.0))
            raise RuntimeError('no quorum within {:g} s at the lighthouse {}: fewer live replicas than the minimum '
                               '(its --min-replicas, or min_replicas={} here); start more replicas or lower the '
                               'minimum ({})'.format(QUORUM_TIMEOUTS * self.timeout, self.lighthouse, self.min_replicas,
                                                     (str(e).splitlines() or [type(e).__name__])[0][:120])) from None

    def shutdown(self):
        """Stop the Manager's server, its checkpoint server and the group; idempotent."""
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=False)
            self.group.shutdown()
