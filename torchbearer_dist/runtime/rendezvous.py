"""Meeting the other processes: the rendezvous store and a handshake.

The store is created here rather than by :func:`torch.distributed.init_process_group` so that:

- rank 0 binds the socket itself, on the master address only (torch listens on every interface), and a
  taken port fails at once, naming the port;
- a rank > 0 gives up after the rendezvous timeout (later when the port's program accepts connections and
  never answers: ``Timing.listener``; torch alone waits forever there);
- a handshake catches two processes claiming one rank, ranks that disagree on the world size, and a stale
  job on the same port.
"""
import errno
import functools
import os
import socket
import threading
import time
import uuid

import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis, _peers
from torchbearer_dist.runtime._timing import Timing, poll
from torchbearer_dist.runtime.errors import PeerFailedError


def _lookup(host, port, fix):
    try:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RuntimeError('cannot resolve the master address {}:{} ({}); {}'.format(host, port, e.strerror, fix)) \
            from None


def _bind_master(host, port):
    family, kind, proto, _, sockaddr = _lookup(host, port, 'pass --host as an address of the machine that runs '
                                                            'rank 0')
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RuntimeError('port {} on {} is already in use (another job, or a stale process from an earlier '
                               'run); pass a free --port or stop the process holding it'.format(port, host)) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise RuntimeError('{} is not an address of this machine, but rank 0 listens there; run rank 0 '
                               'on the --host machine, or pass that machine\'s own address'.format(host)) from None
        raise RuntimeError('cannot listen on {}:{}: {}'.format(host, port, e.strerror)) from None
    return sock


def _connect(host, port, timeout):
    """Connect to the master's store, bounded by ``timeout`` even against a silent listener: a plain TCP connection
    is retried first (Ctrl-C or the deadline then leaves no thread inside TCPStore's constructor, which aborts
    the interpreter's exit), then the client is made in a helper thread, which torch does not bound there."""
    _lookup(host, port, 'check --host: it should name the machine that runs rank 0')
    seconds = timeout.total_seconds()
    started = time.monotonic()

    def unreachable(why):
        return RuntimeError('cannot reach the master at {}:{} within {:g} s ({}); check that rank 0 is running '
                            'there, that --host and --port match it, and that no firewall is in the way'.format(
                                host, port, seconds, why))

    while True:
        try:
            left = started + seconds - time.monotonic()
            with socket.create_connection((host, port), timeout=max(Timing.CHILDREN_POLL, min(Timing.PROBE, left))):
                break
        except OSError as error:
            if time.monotonic() - started >= seconds:
                raise unreachable(error.strerror or str(error) or type(error).__name__) from None
            time.sleep(Timing.CHILDREN_POLL)
    result, done = {}, threading.Event()

    def connect():
        try:
            result['store'] = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        except Exception as e:  # handed to the caller's thread
            result['error'] = e
        finally:
            done.set()

    thread = threading.Thread(target=connect, name='torchbearer_dist-connect', daemon=True)
    thread.start()
    try:
        # An Event, not join(): a join interrupted by Ctrl-C marks a running thread stopped (CPython 3.11,
        # bpo-45274's fix).
        done.wait(max(0.0, started + Timing(seconds).listener - time.monotonic()))
    except BaseException:  # Ctrl-C: the master accepted, so a store answers within moments, or never
        done.wait(Timing.PROBE)
        raise
    if 'store' in result:
        return result['store']
    if not done.is_set() and _peers.probe(host, port) == 'ok':  # the proof needed to blame another program
        raise RuntimeError('the master at {}:{} accepted the connection but did not answer as a torch.distributed '
                           'store within {:g} s: another program holds that port; check --host and --port'.format(
                               host, port, seconds))
    raise unreachable(str(result['error']).splitlines()[0] if done.is_set() else 'nothing listens there') from None


def _namespace(environ):
    """Key prefix of this job in the store: one per torchrun attempt, so restarts skip stale keys."""
    run_id = environ.get('TORCHELASTIC_RUN_ID')
    return 'tbd/' if run_id is None else 'tbd/{}/{}/'.format(run_id, environ.get('TORCHELASTIC_RESTART_COUNT', '0'))


def _make_store(env, environ):
    """``(store, listening socket or None)``: in memory for one process, a file, the torchrun agent's, or ours."""
    if env.world_size == 1:
        return dist.HashStore(), None
    if env.init_method is not None:
        return dist.FileStore(env.init_method[len('file://'):], env.world_size), None
    if environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
        return _connect(env.host, env.port, env.meet_timeout), None
    if env.rank == 0:
        sock = _bind_master(env.host, env.port)
        try:
            store = dist.TCPStore(env.host, env.port, env.world_size, True, env.meet_timeout,
                                  wait_for_workers=False, master_listen_fd=sock.fileno())
        except Exception:
            sock.close()
            raise
        return store, sock
    return _connect(env.host, env.port, env.meet_timeout), None


def connect_client(env, environ):
    """One more connection to the job's store, namespaced like the first: the watchdog's own (None for a
    file or in-memory store)."""
    if env.world_size == 1 or env.init_method is not None:
        return None
    store = dist.TCPStore(env.host, env.port, None, False, env.meet_timeout, wait_for_workers=False)
    return dist.PrefixStore(_namespace(environ), store)


def _wait(store, keys, timeout, what, rank=None):
    """Wait for ``keys``: RuntimeError saying ``what`` after ``timeout``; a PeerFailedError naming a rank that
    published its failure meanwhile (e.g. Ctrl-C on it); the store's error when it went away."""
    if poll(lambda: store.check(keys) or store.check(['error']), timeout.total_seconds()) and store.check(keys):
        return
    if store.check(['error']):
        raise PeerFailedError.from_cause(_diagnosis.read_cause(store, reader=rank), rank)
    raise RuntimeError('{} within {:g} s; start every process of the job, with the same --host and '
                       '--port'.format(what, timeout.total_seconds()))


def handshake(store, env):
    """Claim this rank, publish where it runs, and check that every rank agrees on the world size.

    A master that stops answering meanwhile (torch's client then retries a read past its own timeout) is named
    by the heartbeat, which shuts this rank's store connections down, failing the call it blocks in.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job

    Raises:
        RuntimeError: the rank is taken, or a rank did not join within the rendezvous timeout
        ValueError: ranks disagree on the world size
        PeerFailedError: another rank failed meanwhile
    """
    claim = '{} pid {} world_size {} {}'.format(socket.gethostname(), os.getpid(), env.world_size,
                                                  uuid.uuid4().hex[:8])
    held = store.compare_set('rank/{}'.format(env.rank), '', claim).decode()
    if held != claim:
        raise RuntimeError('rank {} is already taken by another process ({}) at {}: give each process a distinct '
                           '--rank, or stop the stale job using that port'.format(
                               env.rank, held.rsplit(' ', 1)[0], env.address))
    store.add('hb/{}'.format(env.rank), 1)  # the watchdog's heartbeat counter exists before anyone reads it
    # where it runs before its world size, which the others wait for: a rank that has its world size has its
    # address, and the others never block reading it (a rank stopped between the two sets, e.g. by Ctrl-C,
    # held its peers for the whole rendezvous timeout in that read, which no published cause ends)
    store.set('addr/{}'.format(env.rank), _peers.identity())
    store.set('world_size/{}'.format(env.rank), str(env.world_size))
    for other in range(env.world_size):
        if other == env.rank:
            continue
        _wait(store, ['world_size/{}'.format(other)], env.meet_timeout,
              'rank {} of {} did not join at {}'.format(other, env.world_size, env.address), env.rank)
        theirs = int(store.get('world_size/{}'.format(other)))
        if theirs != env.world_size:
            store.set('checked/{}'.format(env.rank), 'mismatch')
            if env.rank == 0:  # the store dies with rank 0: let the other side read rank 0's value first
                poll(functools.partial(store.check, ['checked/{}'.format(other)]), Timing.READERS)
            raise ValueError('world size mismatch: this process (rank {}) has world_size={} but rank {} has '
                             'world_size={}; start every process with the same --world-size'.format(
                                 env.rank, env.world_size, other, theirs))
    store.set('checked/{}'.format(env.rank), 'ok')


def wait_until_connected(store, env):
    """Wait until every rank is connected (torch's barrier, on the new group): gloo's connect returns on one
    rank while a peer may still complete its side, and a rank that then left at once failed that peer
    ("Connection closed by peer": 3 in 90 two-rank launches, 0 in 90 with this wait)."""
    dist.barrier()
