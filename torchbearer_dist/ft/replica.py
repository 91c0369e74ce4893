"""This process as one torchft replica group: its store, its gloo group and its Manager (torchft's public API, but
for what :mod:`~torchbearer_dist.ft._torchft` reads; :class:`~torchbearer_dist.ft.callback.FaultTolerantAllReduce`
drives it through a Trial)."""
import importlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
from torch.distributed import TCPStore

from torchbearer_dist.ft import _events, _quiet, _torchft, _watch
from torchbearer_dist.ft._heal import Refused
from torchbearer_dist.runtime import _peers
from torchbearer_dist.runtime._timing import poll
from torchbearer_dist.runtime.network import route_source
from torchbearer_dist.sync.group import start_sum

#: A quorum may take this many ``timeout``\ s: the others may be stuck up to one ``timeout`` in a collective
#: with a lost peer, and the lighthouse waits for them (its join timeout, at least one ``timeout``).
QUORUM_TIMEOUTS = 3
#: torchft retries a quorum that the lighthouse failed (it went) this many times within the quorum's timeout,
#: about a tenth of ``timeout`` apart: a lighthouse restarted at the same address within ``timeout`` is rejoined.
QUORUM_RETRIES = 30
#: Seconds the main thread gets to take the error of a lost lighthouse where it waits for no quorum (a long
#: step, a validation pass, DiLoCo's local steps); then the watch writes the line and ends the process.
GRACE = 2.0
#: Seconds between quorums while fewer live replicas than this replica's ``min_replicas`` are there.
MIN_REPLICAS_POLL = 0.5
#: Seconds a group's other rank, whose call to rank 0's torchft server failed, waits for rank 0's store to refuse
#: connections: a killed process closes its sockets one by one (the server's may go first), slowly under load.
HEAD_GONE = 1.0
#: How a user installs torchft, in every error that finds it missing.
INSTALL = 'pip install "torchbearer_dist[ft]"'
#: How to start a lighthouse, in the errors that find none.
START = 'python -m torchbearer_dist.ft --min-replicas N'


def require_torchft():
    """The ``torchft`` package, imported (quietly, see :func:`~torchbearer_dist.ft._quiet.import_torchft`); a
    one-line RuntimeError saying how to install it where it is missing."""
    try:
        torchft = _quiet.import_torchft()
        importlib.import_module('torchft.coordination')
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


def not_a_lighthouse(url, observation, what, timeout):
    """The line for something at ``url`` that is not a torchft lighthouse (``observation`` ``'foreign'`` or
    ``'silent'`` of :func:`~torchbearer_dist.ft._watch.probe`, ``what`` it saw), None for anything else."""
    if observation == _watch.FOREIGN:
        return 'something at {} answers but is not a torchft lighthouse ({})'.format(url, what)
    if observation == _watch.SILENT:
        return 'something at {} accepts connections but did not answer as a torchft lighthouse within {:g} s'.format(
            url, timeout)
    return None


def lost_line(url, observation, what, timeout):
    """The line of a lighthouse lost during a run, as its last probe (``observation``, ``what``) found its address."""
    other = not_a_lighthouse(url, observation, what, timeout)
    if other is not None:
        return '{}: the lighthouse was lost; start it there again ({}) and restart every replica'.format(other, START)
    return ('the lighthouse at {} was lost: nothing answered there for {:g} s; start it there again ({}) and '
            'restart every replica (a lighthouse back within {:g} s is rejoined)'.format(url, timeout, START, timeout))


def check_lighthouse(url, timeout):
    """Raise a one-line RuntimeError unless a torchft lighthouse answers at ``url`` within ``timeout`` seconds (it
    may be starting): one that does not answer, or something else there, named."""
    deadline, foreign = time.monotonic() + timeout, 0
    while True:
        observation, what = _watch.probe(url, max(deadline - time.monotonic(), 0.05))
        if observation == _watch.LIGHTHOUSE:
            return
        foreign = foreign + 1 if observation == _watch.FOREIGN else 0
        if foreign == 2 or time.monotonic() >= deadline:  # twice an answer, not a lighthouse's: no need to wait
            break
        time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
    other = not_a_lighthouse(url, observation, what, timeout)
    if other is not None:
        raise RuntimeError('{}; start the lighthouse there ({}) or pass its address'.format(other, START))
    raise RuntimeError('the lighthouse at {} did not answer within {:g} s; start it ({}) or pass its '
                       'address'.format(url, timeout, START))


def _transport(host, timeout):
    """torchft's HTTP checkpoint transport, advertising ``host`` where torchft advertises the host name (which
    may resolve to another address, as in a network namespace or behind NAT); its output quiet (see ``_quiet``)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self):
            url = urlparse(super().address())
            return url._replace(netloc='{}:{}'.format(host, url.port)).geturl()

    transport = Transport(timeout=timeout, num_chunks=0)
    _quiet.quiet_heal_server(_torchft.heal_server(transport))
    return transport


#: The longest host name or address a replica group's rank 0 sends its other ranks, in bytes (DNS names: 253).
ADDRESS_BYTES = 256


def _share_address(address, group):
    """Rank 0's ``(host, port)`` (None elsewhere) on every rank of ``group`` (a DistGroup), as tensors: a collective
    of the package never unpickles what a peer sends. On the group's device (a GPU under nccl)."""
    wire = torch.zeros(ADDRESS_BYTES + 1, dtype=torch.int64, device=group.device())
    if address is not None:
        name = address[0].encode()[:ADDRESS_BYTES]
        wire[:len(name)] = torch.tensor(list(name), dtype=torch.int64)
        wire[-1] = address[1]
    group.broadcast(wire).wait()
    name = [byte for byte in wire[:-1].tolist() if byte]
    return bytes(name).decode(), int(wire[-1])


class Replica:
    """This process as a replica group of one (or as one rank of a replica group of several): a TCPStore, a torchft
    gloo group and a ``torchft.Manager``.

    The group (``group``) carries the sums over the replicas of each quorum, which the Manager sets up at each new
    quorum (:class:`~torchbearer_dist.sync.group.QuorumGroup` starts them on it); the Manager decides each step
    and serves this replica's state (``state_dict()``) to replicas that heal from it, or loads a healthy one's
    (``load_state_dict``).

    A thread watches the lighthouse (:mod:`~torchbearer_dist.ft._watch`): where no probe has found it for
    ``timeout``, the main thread's quorum ends at once in a one-line RuntimeError that says so (or that something
    else answers at its address); where the main thread waits for no quorum then, the watch writes that line
    :data:`GRACE` seconds later and ends the process with status 1. A lighthouse restarted at the same address
    within ``timeout`` is rejoined (torchft retries the quorum it failed), with one line saying so. While the
    replica lives, torchft's tracebacks, its heal server's access lines and torch's heal warning go to the logger
    ``torchbearer_dist.ft.torchft`` (``TORCHBEARER_DIST_FT_VERBOSE=1``: as torchft writes them; see ``_quiet``).

    Args:
        lighthouse (str): the lighthouse's URL
        replica_id (str): this replica's name, the same when it restarts
        load_state_dict (callable): loads what ``state_dict`` returned, when this replica heals
        state_dict (callable): this replica's state, sent to a replica that heals from it
        min_replicas (int): fewer live replicas than this and the others wait (up to ``timeout``)
        timeout (float): seconds for a collective and a heal; a quorum may take three times as long
        host (str): the address other replicas reach this one at (default: the one on the route to the lighthouse)
        group (DistGroup): the replica group's ranks, where it has several (None: this process alone). Its rank 0
            holds the group's store and the Manager's server, which talks to the lighthouse for the group; every
            rank's Manager averages with the same rank of the other groups
        deferred (bool): quorums that :meth:`start_quorum` may leave in flight (torchft's asynchronous quorum),
            every replica of a job alike: a replica that heals in a quorum counts for nothing in its step (it
            sends zeros, the others average over the rest), the quorums of a training run with ``every_step``

    Raises:
        RuntimeError: torchft is missing, or no torchft lighthouse answers within ``timeout`` (something else there
            named)
    """

    def __init__(self, lighthouse, replica_id, load_state_dict, state_dict, min_replicas=1, timeout=60.0, host=None,
                 group=None, deferred=False):
        torchft = require_torchft()
        self.lighthouse, self.replica_id = lighthouse, replica_id
        self.timeout, self.min_replicas, self.deferred = timeout, min_replicas, deferred
        self._asked = None  # the quorum in flight: (shrink_only, heal, when asked), until finish_quorum() took it
        self.manager, self._watch = None, None
        check_lighthouse(lighthouse, timeout)
        parsed = urlparse(lighthouse)
        self.host = host or route_source(parsed.hostname, parsed.port) or socket.gethostname()
        self._quiet = _quiet.Quiet.open()
        try:
            # The replica group's own store, new with each start of the group, held by its rank 0: its other ranks
            # learn its address through their process group (the launcher's store outlives a restart of the group,
            # where they could read the last incarnation's Manager address).
            limit = timedelta(seconds=timeout)
            rank, size = (0, 1) if group is None else (group.rank(), group.size())
            self._store = None
            if rank == 0:
                self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=limit)
            address = (self.host, self._store.port) if self._store is not None else None
            if size > 1:
                address = _share_address(address, group)
            self.group_rank, self._group_store = rank, address
            self.group = torchft.ProcessGroupGloo(timeout=limit)
            self.manager = torchft.Manager(
                pg=self.group, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_replicas,
                use_async_quorum=deferred, timeout=limit, quorum_timeout=QUORUM_TIMEOUTS * limit, connect_timeout=limit,
                rank=rank, world_size=size, store_addr=address[0], store_port=address[1], lighthouse_addr=lighthouse,
                replica_id=replica_id, hostname=self.host, checkpoint_transport=_transport(self.host, limit),
                quorum_retries=QUORUM_RETRIES)
        except BaseException:
            self._close_quiet()
            raise
        # The watch's verdict, taken by the main thread (it raised it), and whether that thread waits for a quorum.
        self._failure, self._taken, self._in_quorum = None, threading.Event(), False
        self._watch = _watch.Watch(lighthouse, timeout, self._on_watch)

    def start_quorum(self, shrink_only=False, heal=True, wait=True, load=True):
        """Join the next quorum (healing here if behind); ``shrink_only``: of the last one's replicas only;
        ``heal=False``: nothing healed nor sent, the replicas at the quorum's highest step take part (``evaluate()``
        and ``predict()``, whose fresh Managers are all at step 0). ``wait=False`` (a ``deferred`` replica): the
        quorum forms while this thread goes on; :meth:`finish_quorum` takes it, and torchft loads a heal staged in
        it at ``should_commit()``. ``load=False``: a heal staged in a quorum waited for here is loaded there too
        (inside a step, whose backward may still hold the weights).

        Raises:
            RuntimeError: the lighthouse was lost, or something else answers at its address (named, within
                ``timeout``); no quorum within the timeout: too few replicas, or torchft lost it to a restart of
                the lighthouse

        .. warning:: A synchronization point with the lighthouse and the other live replicas.
        """
        self._raise_failure()
        self._asked = (shrink_only, heal, time.monotonic())
        self._ask(shrink_only, heal)
        if wait:
            self.finish_quorum(load=load)

    def _ask(self, shrink_only, heal):
        deadline = self._asked[2] + QUORUM_TIMEOUTS * self.timeout
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        self._in_quorum = not self.deferred  # torchft's synchronous start waits for the quorum inside
        try:
            self.manager.start_quorum(allow_heal=heal, shrink_only=shrink_only, timeout=left)
        except Exception as e:
            self._quorum_failed(e, self._asked[2])
        finally:
            self._in_quorum = False

    def finish_quorum(self, load=False):
        """Wait for the quorum in flight, and for one of at least ``min_replicas`` live replicas (taking new ones
        meanwhile); ``load``: a heal staged in it is loaded now (before the step's forward), not at
        ``should_commit()``. Nothing where no quorum is in flight.

        Raises:
            RuntimeError: as :meth:`start_quorum`
        """
        if self._asked is None:
            return
        self._raise_failure()
        shrink_only, heal_allowed, started = self._asked
        self._asked = None
        deadline = started + QUORUM_TIMEOUTS * self.timeout
        self._in_quorum = True
        try:
            while True:  # the lighthouse's minimum may be lower than this replica's: its quorums come again
                live = self.manager.num_participants()  # waits for the quorum in flight
                if load:
                    _torchft.load_heal(self.manager)
                if live >= self.min_replicas:
                    break
                if time.monotonic() >= deadline:
                    raise RuntimeError('{} live replica{} in the last quorum'.format(live, 's' * (live != 1)))
                time.sleep(min(MIN_REPLICAS_POLL, max(deadline - time.monotonic(), 0)))
                left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                self.manager.start_quorum(allow_heal=heal_allowed, shrink_only=shrink_only, timeout=left)
        except Exception as e:
            self._quorum_failed(e, started)
        finally:
            self._in_quorum = False
        self._raise_failure()  # a verdict that came as the quorum ended: the same on every replica
        event = self._watch.observe(time.monotonic(), _watch.LIGHTHOUSE, 'a quorum')  # it formed one: it lives
        if event is not None:
            self._on_watch(event)

    def _quorum_failed(self, error, started):
        """Raise the line for a quorum asked for at ``started`` that failed: the heal's own refusal as it is, else
        why no quorum came."""
        if isinstance(error, Refused):
            raise error  # the heal's own one-line error (_heal.restore), raised on this replica only
        self._asked = None
        self._raise_failure()
        raise RuntimeError(self._no_quorum(started, error)) from None

    def vote_sum(self, tensor):
        """Sum ``tensor`` in place over every replica of the quorum, those that heal in it too (torchft's own
        all-reduce leaves their values out of a deferred quorum's step): ``(rank, size)`` of this replica among
        them come from :meth:`members`. False where it failed (torchft then drops the step).
        """
        return start_sum(self.group, self.manager, tensor).wait()

    def members(self):
        """``(rank, size)``: this replica's place among every replica of the quorum, those that heal in it too;
        ``(None, 0)`` where torchft could not set up the quorum's group (it fails the step)."""
        return _torchft.members(self.group)

    def _raise_failure(self):
        if self._failure is not None:
            self._taken.set()
            raise self._failure

    def _no_quorum(self, started, error):
        """Why no quorum came: what answers at the lighthouse's address now, whether it went during the quorum."""
        observation, what = _watch.probe(self.lighthouse, min(self.timeout, 5.0))
        if observation != _watch.LIGHTHOUSE:
            return lost_line(self.lighthouse, observation, what, self.timeout)
        lost = self.lost_group_head()
        if lost is not None:
            return lost
        head = 'no quorum within {:g} s at the lighthouse {}: '.format(QUORUM_TIMEOUTS * self.timeout, self.lighthouse)
        gap = self._watch.verdict.gap
        if gap is not None and gap[1] >= started:
            return head + ('it did not answer for {:.1f} s during the quorum and answers again (restarted?), but '
                           'torchft lost the quorum; restart every replica'.format(gap[1] - gap[0]))
        return head + ('fewer live replicas than the minimum (its --min-replicas, or min_replicas={} here); start '
                       'more replicas or lower the minimum ({})'.format(
                           self.min_replicas, (str(error).splitlines() or [type(error).__name__])[0][:120]))

    def should_commit(self):
        """torchft's decision for the step (``Manager.should_commit``, which the group's rank 0 takes for all its
        ranks): True where every live replica may step. A group whose rank 0 is gone raises the line that says so.

        Raises:
            RuntimeError: this replica group's rank 0 is gone (see :meth:`lost_group_head`), or torchft's error
        """
        try:
            return self.manager.should_commit()
        except Exception:
            lost = self.lost_group_head()
            if lost is not None:
                raise RuntimeError(lost) from None
            raise

    def lost_group_head(self):
        """The line for a replica group whose rank 0, which holds the group's store and torchft server (every other
        rank's quorum and commit go through it), is gone: its store refuses connections (within :data:`HEAD_GONE`).
        None on rank 0, in a replica of one process, or while rank 0's store answers."""
        if not self.group_rank:
            return None
        if not poll(lambda: _peers.probe(*self._group_store) == 'refused', HEAD_GONE):
            return None
        return ('rank 0 of replica group {}, which holds its store and torchft server, is gone: rank {} stops with its '
                'group (its launcher starts the group again, and it heals from the live replicas)'.format(
                    self.replica_id, self.group_rank))

    def _on_watch(self, event):
        """On the watch's thread: the lighthouse back (a line), or lost (the main thread's quorum ends in the line)."""
        if event[0] == 'back':
            if not self.group_rank:  # one line per replica group
                _events.say('replica {} found the lighthouse at {} again after {:.1f} s without an answer '
                            '(restarted?); training goes on'.format(self.replica_id, self.lighthouse, event[1]))
            return
        _, observation, what, _ = event
        self._failure = RuntimeError(lost_line(self.lighthouse, observation, what, self.timeout))
        end = time.monotonic() + GRACE
        while not self._taken.wait(0.05) and time.monotonic() < end:
            manager = self.manager
            if manager is None:
                return  # shut down: the run ended meanwhile
            if self._in_quorum:
                _torchft.wake_quorum_wait(manager)
        if self._taken.is_set() or self.manager is None:
            return
        # The main thread waits for no quorum (it trains, validates, or is stuck in native code): end it here.
        sys.stdout.flush()
        sys.stderr.write('torchbearer_dist: error: {} (replica {} ends here: its main thread did not come to a '
                         'quorum within {:g} s)\n'.format(self._failure, self.replica_id, GRACE))
        sys.stderr.flush()
        os._exit(1)

    def _close_quiet(self):
        if self._quiet:
            self._quiet = False
            _quiet.Quiet.close()

    def shutdown(self):
        """Stop the watch, the Manager's server, its checkpoint server and the group; idempotent."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=False)
            self.group.shutdown()
        self._close_quiet()
