"""The process group's life: create it, run a block inside it, end a failure cleanly, tear it down.

Nothing here touches signal handlers or the wakeup fd (Ctrl-C handling is opt-in, in
:mod:`torchbearer_dist.runtime.interrupts`), and ``os.environ`` is left as it was found: the interface
chosen for gloo is set only while the group is created.
"""
import atexit
import os
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis, _gloo_sockets, _peers, errors, rendezvous
from torchbearer_dist.runtime._watchdog import LEFT, Watchdog
from torchbearer_dist.runtime.env import current_env, current_store, resolve, set_current, with_rendezvous_timeout

_live = {'watchdog': None, 'gloo': None, 'cause': None, 'store': None, 'client': None, 'connecting': False}
#: Stopped watchdogs whose threads may still be inside a store call; joined at exit.
_stopped = []


def init_process_group(rank=None, world_size=None, host=None, port=None, backend=None, timeout=None,
                       init_method=None, local_rank=None, rendezvous_timeout=None):
    """Join the job: check the arguments, meet the other ranks, and create the default process group.

    Arguments are those of :func:`torchbearer_dist.runtime.env.resolve`; anything not given comes from
    torchrun's or SLURM's environment. Every value is checked before the first network call. A
    helper thread then beats a heartbeat through the store, so that a dead or silent peer ends the
    job within ``rendezvous_timeout`` whatever the collective ``timeout``.

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
        timeout (float or datetime.timedelta): bound in seconds on each collective; by default
            :data:`~torchbearer_dist.DEFAULT_TIMEOUT` (30 minutes, as torch's)
        init_method (str): ``'file:///shared/path'`` to meet through a shared filesystem
        local_rank (int): rank on this machine, selects the GPU
        rendezvous_timeout (float or datetime.timedelta): bound in seconds on meeting the other
            ranks and on a peer's silence; by default 60, and never more than ``timeout``

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
    env = with_rendezvous_timeout(env, rendezvous_timeout, environ)
    if dist.is_initialized():
        raise RuntimeError('a torch.distributed process group is already initialized; call '
                           'torchbearer_dist.destroy_process_group() before initializing another')
    if env.backend == 'nccl':
        torch.cuda.set_device(env.local_rank)
    store, sock = rendezvous._make_store(env, environ)
    store = dist.PrefixStore(rendezvous._namespace(environ), store)
    set_current(env, store, sock)
    try:
        if env.world_size > 1:
            store.set_timeout(env.meet_timeout)
            rendezvous.handshake(store, env)
            _peers.remember(store, env.rank, env.world_size)
            _start_watchdog(env, environ)  # from before gloo connects: a rank lost meanwhile is named
        _live['connecting'] = True
        try:
            _create(env, store, environ)
        finally:
            _live['connecting'] = False
        _live['store'] = None  # connected: from now on the heartbeat wakes collectives, not the store
    except BaseException as error:
        failure = _joining_failed(env, store, error)
        _destroy()
        if failure is not None:
            _quiet_traceback()
            raise failure from error
        if isinstance(error, errors.PeerFailedError):
            _quiet_traceback()
        raise
    return env


def _start_watchdog(env, environ):
    if env.init_method is None:  # the main thread's store connections: only they are woken while gloo connects
        _live['store'] = _gloo_sockets.store_connections(env.host, env.port)
    client = rendezvous.connect_client(env, environ)
    if client is not None:
        _live['client'] = [c for c in _gloo_sockets.store_connections(env.host, env.port) if c not in _live['store']]
        client.set_timeout(timedelta(seconds=min(5.0, env.meet_timeout.total_seconds() / 2)))
        _live['watchdog'] = Watchdog(env, client, lambda cause: _on_watchdog(client, env, cause)).start()


def _joining_failed(env, store, error):
    """After ``error`` ended group creation: the :class:`PeerFailedError` naming the rank at fault, or
    None when ``error`` is this rank's own (then published, so that the peers name this rank).

    The heartbeat runs from before gloo connects: it names a peer that died, froze or was cut off,
    and wakes this rank from gloo's wait (see :func:`_on_watchdog`). When gloo gave up first, its
    words are only a guess: the heartbeat gets two beats and a second more to name the rank.
    """
    if env.world_size == 1 or isinstance(error, (ValueError, errors.PeerFailedError)):
        return None
    if not _diagnosis.is_collective_error(error):
        if not isinstance(error, RuntimeError):  # KeyboardInterrupt, SystemExit: not the rendezvous' own words
            _diagnosis.publish(store, _diagnosis.own_cause(env.rank, error))
            if env.rank == 0:
                _diagnosis.wait_until_read(store, env.world_size)
        return None
    watchdog = _live['watchdog']
    cause, own = _live['cause'], False
    if cause is None:
        deadline = time.monotonic() + (2 * watchdog.interval + 1 if watchdog is not None else 0)
        cause, own = _diagnosis.diagnose(store, env, error)
        while _diagnosis.is_guess(cause) and _live['cause'] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if _live['cause'] is not None:
            cause, own = _live['cause'], False
    if own:
        return None
    if env.rank == 0 and watchdog is not None:
        # the others read the cause through their heartbeat's connection: keep the store up meanwhile
        _diagnosis.publish(watchdog.store, cause)
        _diagnosis.wait_until_read(watchdog.store, env.world_size, skip=cause.rank)
    return errors.PeerFailedError('{} (rank {} stopped)'.format(cause.line(), env.rank), cause.rank, cause.kind,
                                  cause.exc_type or None)


def _create(env, store, environ):
    interface = rendezvous.gloo_interface(env, environ)
    if interface is not None:  # read by gloo while it makes its device, then given back
        environ['GLOO_SOCKET_IFNAME'] = interface
    group_store = dist.PrefixStore('pg', store)
    # gloo's connect waits for every peer as long as the group's timeout: the rendezvous timeout
    # bounds it, and the collective timeout is set once every rank is connected.
    connect_timeout = min(env.timeout, env.meet_timeout)
    try:
        dist.init_process_group(env.backend, store=group_store, rank=env.rank, world_size=env.world_size,
                                timeout=connect_timeout)
        if connect_timeout != env.timeout:
            # the group's own method: torch 2.13 has no dist.set_timeout (2.14's is a wrapper of it)
            dist.group.WORLD.set_timeout(env.timeout)
    except RuntimeError as error:
        if 'connectFullMesh' not in str(error):
            raise
        name = interface or environ.get('GLOO_SOCKET_IFNAME')
        where = 'interface {!r}'.format(name) if name else 'the interface its host name resolves to'
        raise RuntimeError('gloo on rank {} could not connect to the other ranks through {} ({}); set '
                           'GLOO_SOCKET_IFNAME to the interface of this machine that reaches the other '
                           'machines'.format(env.rank, where, _diagnosis.describe(error))) from None
    finally:
        if interface is not None:
            environ.pop('GLOO_SOCKET_IFNAME', None)
    if env.backend == 'gloo' and env.world_size > 1:
        _live['gloo'] = _gloo_sockets.endpoints(group_store, dist.group.WORLD.group_name, env.rank, env.world_size)


def _on_watchdog(client, env, cause):
    """From the watchdog thread: publish what it found (or read what another rank published), then
    wake this rank's main thread."""
    if cause is not None:
        _live['cause'] = cause  # the main thread reports it even if the store is out of reach
        if cause.rank != 0:
            _diagnosis.publish(client, cause)
    else:
        try:  # read now, while rank 0 still waits for its readers: its store may be gone when the main thread asks
            _live['cause'] = _diagnosis.read_cause(client, deaths=False)
        except Exception:
            pass
    interrupt_collectives(env)
    if _live['connecting'] and _live['store']:  # gloo is still connecting, maybe waiting inside a store call
        _gloo_sockets.shut_down_connections(_live['store'])
        _end_a_stuck_connect(env)


def _end_a_stuck_connect(env, grace=2.0):
    """Last resort, from the watchdog thread: end this process when gloo's connect does not return.

    Gloo connecting to a peer whose host went silent retries for about five times its timeout, and
    nothing from outside interrupts that native call. The main thread is then inside
    :func:`torch.distributed.init_process_group`, with no user code running yet: say the cause in
    one line and exit with status 1, as the uncaught error would have.
    """
    deadline = time.monotonic() + grace
    while _live['connecting'] and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _live['connecting']:
        return
    cause = _live['cause']
    line = cause.line() if cause is not None else 'another rank failed while the ranks were connecting'
    sys.stderr.write('torchbearer_dist: error: {} (rank {} stopped while gloo was connecting)\n'.format(
        line, env.rank))
    sys.stderr.flush()
    os._exit(1)


def interrupt_collectives(env):
    """Make this rank's pending and future collectives fail now, so that its main thread unwinds."""
    if env.backend == 'gloo':
        _gloo_sockets.shut_down(_live['gloo'], env.rank)
    elif dist.is_initialized():
        try:
            dist.group.WORLD.abort()  # nccl: aborts the communicators, as its own watchdog does
        except Exception:
            pass


def _stop_peers(env):
    """Make the peers' collectives fail now: destroy the group, and shut down what something still holds.

    ``destroy_process_group`` closes gloo's connections only when nothing else holds the group; a
    pending gradient all-reduce referenced from a traceback keeps them open (measured: see
    :mod:`torchbearer_dist.runtime._gloo_sockets`).
    """
    held = _gloo_sockets.connections(_live['gloo'], env.rank) if env.backend == 'gloo' else []
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass
    if held and _gloo_sockets.connections(_live['gloo'], env.rank):
        _gloo_sockets.shut_down(_live['gloo'], env.rank)


def _stop_watchdog():
    watchdog, _live['watchdog'] = _live['watchdog'], None
    if watchdog is not None:
        watchdog.stop(wait=0)
        # a store call to a frozen or cut-off master would block its thread, and this process's exit
        # (see _tear_down_at_exit), for the client's whole timeout: make it fail now
        _gloo_sockets.shut_down_connections(_live['client'] or [])
        _live['client'] = None
        watchdog.stop()
        _stopped[:] = [w for w in _stopped + [watchdog] if w.running()]


@atexit.register
def _tear_down_at_exit():
    """Leave no torch thread running into interpreter finalization, so that the process exits 0.

    A thread that asks for the GIL once the interpreter finalizes aborts the process: "terminate
    called without an active exception", exit code 134. Two can: gloo's worker dropping a finished
    all-reduce (measured, interleaved: 5 of 80 processes of a two-rank script that ends right after
    an ``all_reduce`` without destroying its group, 0 of 80 with this handler) and our heartbeat
    returning from a store call. Exit handlers run before that point: destroy a group the script
    left up, which joins gloo's threads, and wait for every stopped heartbeat.
    """
    if current_env() is not None or _live['watchdog'] is not None:
        _leave(wait=False)  # no wait for the peers: an uncaught error may be on its way out
        _destroy()
    while _stopped:
        _stopped.pop().join()


def destroy_process_group():
    """Tear down the default process group, if any; safe to call twice or after a failure.

    Rank 0, whose process holds the job's store, first waits until the other ranks have left too,
    so that none of them takes the store's end for rank 0's failure; a rank that falls silent
    meanwhile ends the wait within the rendezvous timeout, and is named to the others.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.destroy_process_group()  # nothing to do outside a process group
    """
    _leave()
    _destroy()


def _leave(wait=True):
    """A clean end of this rank: mark it left, and on rank 0 wait for the others (see above).

    Returns:
        Cause or None: why the wait ended early, a peer's failure or silence
    """
    env, store, watchdog = current_env(), current_store(), _live['watchdog']
    if env is None or watchdog is None or env.world_size == 1 or _live['cause'] is not None:
        return None
    try:
        store.set_timeout(timedelta(seconds=1))  # a frozen master would hold this rank for the whole timeout
        store.add('hb/{}'.format(env.rank), LEFT)
    except Exception:  # the store is gone or frozen: nobody is left to wait for
        return None
    keys = ['hb/{}'.format(r) for r in range(1, env.world_size)]
    while wait and env.rank == 0 and _live['cause'] is None and watchdog.running():
        try:  # rank 0 holds the store: reading it from here is quick
            if all(int(value) >= LEFT for value in store.multi_get(keys)):
                break
        except Exception:
            break
        time.sleep(0.05)
    return _live['cause']


def _destroy():
    _stop_watchdog()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass
    _live.update(gloo=None, cause=None, store=None)
    _peers.forget()
    set_current()


@contextmanager
def process_group(rank=None, world_size=None, host=None, port=None, backend=None, timeout=None,
                  init_method=None, local_rank=None, rendezvous_timeout=None):
    """Run a block inside the job's process group, and always tear it down.

    When the block raises, its cause is published to the other ranks through the store (this rank,
    the exception type, and whether it was this rank's own error, a dead peer or the network), and
    the group is torn down so that the others stop within seconds with one line naming this rank
    and its error. When a peer failed first, the block's own error (a broken connection, a timeout)
    is replaced by :class:`~torchbearer_dist.PeerFailedError` naming the root cause, e.g.
    ``rank 1 failed: ValueError: bad batch (rank 0 stopped)``.

    Example:

        .. code-block:: python

            with torchbearer_dist.process_group(rank=args.rank, world_size=2, host=args.host):
                trial.run(epochs=5)

    Args:
        rank, world_size, host, port, backend, timeout, init_method, local_rank, rendezvous_timeout: as
            for :func:`init_process_group`

    Yields:
        DistEnv: this process's place in the job

    Raises:
        PeerFailedError: another rank failed first; the message names it and its error
    """
    env = init_process_group(rank=rank, world_size=world_size, host=host, port=port, backend=backend,
                             timeout=timeout, init_method=init_method, local_rank=local_rank,
                             rendezvous_timeout=rendezvous_timeout)
    store = current_store()
    try:
        yield env
    except errors.Preempted:
        raise  # every rank stops at the same step once the checkpoint is written: an agreed end, not a fault
    except BaseException as error:
        if env.world_size == 1:
            raise
        _stop_watchdog()
        cause, own = (_live['cause'], False) if _live['cause'] is not None else _diagnosis.diagnose(store, env, error)
        if env.rank == 0 or cause.rank != 0 or cause.kind == _diagnosis.LOCAL:  # else the store is out of reach
            _diagnosis.publish(store, cause)
        _stop_peers(env)
        if env.rank == 0:
            _diagnosis.wait_until_read(store, env.world_size, skip=cause.rank)
        _destroy()
        if not own:
            _quiet_traceback()
            raise errors.PeerFailedError('{} (rank {} stopped)'.format(cause.line(), env.rank), cause.rank,
                                         cause.kind, cause.exc_type or None) from error
        raise
    else:
        cause = _leave()
        if cause is not None:  # this rank's block ended well, but a peer fell silent before leaving
            _stop_watchdog()
            _destroy()
            _quiet_traceback()
            raise errors.PeerFailedError('{} (rank {} stopped)'.format(cause.line(), env.rank), cause.rank,
                                         cause.kind, cause.exc_type or None)
    finally:
        _destroy()


#: Set to ``1`` to see the whole traceback of a :class:`~torchbearer_dist.PeerFailedError` nobody caught.
TRACEBACK_VARIABLE = 'TORCHBEARER_DIST_TRACEBACK'


def _quiet_traceback():
    """Make an uncaught :class:`~torchbearer_dist.PeerFailedError` print its one line, not a traceback.

    Its traceback shows only where this rank was when a peer failed (40 to 60 lines of torchbearer
    and torch); the line names the rank at fault and its error. Every other exception, the user's
    own included, reaches the previous ``sys.excepthook`` untouched; ``TORCHBEARER_DIST_TRACEBACK=1``
    shows the whole traceback.
    """
    if getattr(sys.excepthook, '_torchbearer_dist', False):
        return
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if issubclass(kind, errors.PeerFailedError) and os.environ.get(TRACEBACK_VARIABLE) != '1':
            sys.stderr.write('{}: {} (set {}=1 for the traceback)\n'.format(kind.__name__, value,
                                                                           TRACEBACK_VARIABLE))
            sys.stderr.flush()
            return
        previous(kind, value, traceback)

    excepthook._torchbearer_dist = True
    sys.excepthook = excepthook
