"""Meeting the other processes: the rendezvous store, a handshake, and the process group's life.

The store is created here rather than by :func:`torch.distributed.init_process_group` so that:

- rank 0 binds the socket itself, on the master address only (torch listens on every interface),
  and a taken port fails at once, naming the port;
- a rank > 0 gives up after ``timeout`` even when the master port is held by a program that
  accepts connections and never answers (torch alone waits forever there);
- a handshake through the store catches, before training, two processes claiming one rank,
  processes that disagree on the world size, and a stale job on the same port.
"""
import errno
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager

import torch
import torch.distributed as dist

from torchbearer_dist import faults
from torchbearer_dist.env import is_loopback, resolve, route_interface

_current = {'env': None, 'store': None, 'socket': None}


def current_env():
    """The :class:`~torchbearer_dist.env.DistEnv` of the live process group, or None outside one."""
    return _current['env']


def current_store():
    """The job's rendezvous store (namespaced to this job), or None outside a process group."""
    return _current['store']


def _port_holder(port):
    """`` (held by pid N: command)`` for the process listening on TCP ``port`` here, or ``''``."""
    inodes = set()
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == '0A' and int(fields[1].rsplit(':', 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add('socket:[{}]'.format(fields[9]))
    if not inodes:
        return ''
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            fds = os.listdir('/proc/{}/fd'.format(pid))
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink('/proc/{}/fd/{}'.format(pid, fd)) in inodes:
                    with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
                        command = f.read().replace(b'\0', b' ').decode(errors='replace').strip()
                    return ' (held by pid {}: {})'.format(pid, command[:80])
            except OSError:
                continue
    return ''


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
            raise RuntimeError('port {} on {} is already in use{} (another job, or a stale process from an '
                               'earlier run); pass a free --port or stop the process holding it'.format(
                                   port, host, _port_holder(port))) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise RuntimeError('{} is not an address of this machine, but rank 0 listens there; run rank 0 '
                               'on the --host machine, or pass that machine\'s own address'.format(host)) from None
        raise RuntimeError('cannot listen on {}:{}: {}'.format(host, port, e.strerror)) from None
    return sock


def _connect(host, port, timeout):
    """Connect to the master's store, bounded by ``timeout`` even against a silent listener."""
    _lookup(host, port, 'check --host: it should name the machine that runs rank 0')
    result = {}

    def connect():
        try:
            result['store'] = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        except Exception as e:  # handed to the caller's thread
            result['error'] = e

    thread = threading.Thread(target=connect, name='torchbearer_dist-connect', daemon=True)
    thread.start()
    # The client retries for about timeout; a silent listener never returns at all.
    thread.join(timeout.total_seconds() * 1.5 + 5)
    if 'store' in result:
        return result['store']
    seconds = timeout.total_seconds()
    if thread.is_alive():
        raise RuntimeError('the master at {}:{} accepted the connection but did not answer as a torch.distributed '
                           'store within {:g} s: another program holds that port; check --host and --port'.format(
                               host, port, seconds))
    raise RuntimeError('cannot reach the master at {}:{} within {:g} s ({}); check that rank 0 is running there, '
                       'that --host and --port match it, and that no firewall is in the way'.format(
                           host, port, seconds, str(result['error']).splitlines()[0])) from None


def _namespace(environ):
    """Key prefix of this job in the store: one per torchrun attempt, so restarts skip stale keys."""
    run_id = environ.get('TORCHELASTIC_RUN_ID')
    if run_id is None:
        return 'tbd/'
    return 'tbd/{}/{}/'.format(run_id, environ.get('TORCHELASTIC_RESTART_COUNT', '0'))


def _make_store(env, environ):
    if env.world_size == 1:
        return dist.HashStore(), None
    if env.init_method is not None:
        path = env.init_method[len('file://'):]
        return dist.FileStore(path, env.world_size), None
    if environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
        return _connect(env.host, env.port, env.timeout), None
    if env.rank == 0:
        sock = _bind_master(env.host, env.port)
        try:
            store = dist.TCPStore(env.host, env.port, env.world_size, True, env.timeout,
                                  wait_for_workers=False, master_listen_fd=sock.fileno())
        except Exception:
            sock.close()
            raise
        return store, sock
    return _connect(env.host, env.port, env.timeout), None


def _wait(store, keys, timeout, what):
    try:
        store.wait(keys, timeout)
    except Exception:
        raise RuntimeError('{} within {:g} s; start every process of the job, with the same --host and '
                           '--port'.format(what, timeout.total_seconds())) from None


def _handshake(store, env):
    """Claim this rank and check that every rank agrees on the world size."""
    claim = '{} pid {} world_size {} {}'.format(socket.gethostname(), os.getpid(), env.world_size,
                                                  uuid.uuid4().hex[:8])
    held = store.compare_set('rank/{}'.format(env.rank), '', claim).decode()
    if held != claim:
        raise RuntimeError('rank {} is already taken by another process ({}) at {}: give each process a distinct '
                           '--rank, or stop the stale job using that port'.format(
                               env.rank, held.rsplit(' ', 1)[0], env.address))
    store.set('world_size/{}'.format(env.rank), str(env.world_size))
    store.set('addr/{}'.format(env.rank), '{} {}'.format(socket.gethostname(), os.getpid()))
    for other in range(env.world_size):
        if other == env.rank:
            continue
        _wait(store, ['world_size/{}'.format(other)], env.timeout,
              'rank {} of {} did not join at {}'.format(other, env.world_size, env.address))
        theirs = int(store.get('world_size/{}'.format(other)))
        if theirs != env.world_size:
            store.set('checked/{}'.format(env.rank), 'mismatch')
            if env.rank == 0:  # the store dies with rank 0: let the other side read rank 0's value first
                _poll(store, 'checked/{}'.format(other), 3.0)
            raise ValueError('world size mismatch: this process (rank {}) has world_size={} but rank {} has '
                             'world_size={}; start every process with the same --world-size'.format(
                                 env.rank, env.world_size, other, theirs))
    store.set('checked/{}'.format(env.rank), 'ok')


def _poll(store, key, seconds):
    """Wait up to ``seconds`` for ``key``; quietly, unlike ``store.wait`` whose timeout logs a C++ warning."""
    deadline = time.monotonic() + seconds
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _set_gloo_interface(env, environ):
    if 'GLOO_SOCKET_IFNAME' in environ or env.world_size == 1:
        return
    name = 'lo' if is_loopback(env.host) else route_interface(env.host, env.port)
    if name is not None:
        environ['GLOO_SOCKET_IFNAME'] = name


def init_process_group(rank=None, world_size=None, host=None, port=None, backend=None, timeout=None,
                       init_method=None, local_rank=None):
    """Join the job: check the arguments, meet the other ranks, and create the default process group.

    Arguments are those of :func:`torchbearer_dist.env.resolve`; anything not given comes from
    torchrun's or SLURM's environment. Every value is checked before the first network call.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> env = tbd.init_process_group(rank=0, world_size=1)
        >>> env.rank, env.world_size
        (0, 1)
        >>> tbd.destroy_process_group()

    Args:
        rank (int): global rank of this process
        world_size (int): number of processes
        host (str): address of the machine that runs rank 0
        port (int): port of the rendezvous store
        backend (str): ``'gloo'`` (the default) or ``'nccl'``
        timeout (float or datetime.timedelta): bound in seconds for rendezvous and collectives
        init_method (str): ``'file:///shared/path'`` to meet through a shared filesystem
        local_rank (int): rank on this machine, selects the GPU

    Returns:
        DistEnv: this process's rank, world size, address and backend

    Raises:
        ValueError: a bad argument, or ranks that disagree on the world size
        RuntimeError: a taken port, an unreachable master, a duplicate rank or a missing peer

    .. warning:: A synchronization point: it returns once every rank has joined.
    """
    environ = os.environ
    env = resolve(rank=rank, world_size=world_size, host=host, port=port, backend=backend, timeout=timeout,
                  init_method=init_method, local_rank=local_rank, environ=environ)
    if dist.is_initialized():
        raise RuntimeError('a torch.distributed process group is already initialized; call '
                           'torchbearer_dist.destroy_process_group() before initializing another')
    if env.backend == 'gloo':
        _set_gloo_interface(env, environ)
    if env.backend == 'nccl':
        torch.cuda.set_device(env.local_rank)
    store, sock = _make_store(env, environ)
    store = dist.PrefixStore(_namespace(environ), store)
    _current.update(env=env, store=store, socket=sock)
    try:
        if env.world_size > 1:
            store.set_timeout(env.timeout)
            _handshake(store, env)
            faults.remember_peers(store, env)
        sockets = faults.open_sockets()
        try:
            dist.init_process_group(env.backend, store=dist.PrefixStore('pg', store), rank=env.rank,
                                    world_size=env.world_size, timeout=env.timeout)
        except RuntimeError as error:
            if 'connectFullMesh' not in str(error):
                raise
            name = environ.get('GLOO_SOCKET_IFNAME')
            where = 'interface {!r}'.format(name) if name else 'the interface its host name resolves to'
            raise RuntimeError('gloo on rank {} could not connect to the other ranks through {} ({}); set '
                               'GLOO_SOCKET_IFNAME to the interface of this machine that reaches the other '
                               'machines'.format(env.rank, where, faults.describe(error))) from None
        if env.backend == 'gloo' and env.world_size > 1:
            faults.note_group_sockets(sockets)
    except BaseException:
        _release()
        raise
    faults.watch_interrupts()
    return env


def _release():
    faults.forget_group()
    if _current['socket'] is not None:
        _current['socket'].close()
    _current.update(env=None, store=None, socket=None)


def destroy_process_group():
    """Tear down the default process group, if any; safe to call twice or after a failure.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.destroy_process_group()  # nothing to do outside a process group
    """
    faults.unwatch_interrupts()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass
    _release()


@contextmanager
def process_group(rank=None, world_size=None, host=None, port=None, backend=None, timeout=None,
                  init_method=None, local_rank=None):
    """Run a block inside the job's process group, and always tear it down.

    When the block raises, the error is published to the other ranks through the store and this
    rank's gloo connections are closed, so that each of them stops within seconds with one line
    naming this rank and its error. When a peer failed first, the block's own error (a broken
    connection, a timeout) is replaced by :class:`~torchbearer_dist.PeerFailedError` naming the
    root cause, e.g. ``rank 1 failed: ValueError: bad batch (rank 0 stopped)``; a peer that died
    without a word, or stopped answering, is named too.

    Example:

        .. code-block:: python

            with torchbearer_dist.process_group(rank=args.rank, world_size=2, host=args.host):
                trial.run(epochs=5)

    Args:
        rank, world_size, host, port, backend, timeout, init_method, local_rank: as for
            :func:`init_process_group`

    Yields:
        DistEnv: this process's place in the job

    Raises:
        PeerFailedError: another rank failed first; the message names it and its error
    """
    env = init_process_group(rank=rank, world_size=world_size, host=host, port=port, backend=backend,
                             timeout=timeout, init_method=init_method, local_rank=local_rank)
    store = _current['store']
    try:
        yield env
    except BaseException as error:
        cause = faults.diagnose(store, env, error)
        faults.publish(store, env, error, cause=cause)
        destroy_process_group()
        if cause is not None:
            raise faults.PeerFailedError('{} (rank {} stopped)'.format(cause, env.rank)) from error
        raise
    finally:
        destroy_process_group()

