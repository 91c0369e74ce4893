"""The process group's life: create it, run a block inside it, end a failure cleanly, tear it down.

Nothing here touches signal handlers or the wakeup fd (Ctrl-C handling is opt-in, in
:mod:`torchbearer_dist.runtime.interrupts`), and ``os.environ`` is left as it was found: the interface
chosen for gloo is set only while the group is created. The group's heartbeat, and every way it is
left and torn down, are in :mod:`torchbearer_dist.runtime._teardown`.
"""
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis, _gloo_sockets, _peers, _teardown, errors, network, rendezvous
from torchbearer_dist.runtime.env import current_store, resolve, set_current, with_rendezvous_timeout


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
            _teardown.start_watchdog(env, environ)  # from before gloo connects: a rank lost meanwhile is named
        _teardown.live['connecting'] = True
        try:
            _create(env, store, environ)
        finally:
            _teardown.live['connecting'] = False
        _teardown.live['store'] = None  # connected: from now on the heartbeat wakes collectives, not the store
        if env.world_size > 1:
            rendezvous.wait_until_connected(store, env)
    except BaseException as error:
        failure = _joining_failed(env, store, error)
        _teardown.destroy()
        if failure is not None:
            errors._quiet_traceback()
            raise failure from error
        if isinstance(error, errors.PeerFailedError):
            errors._quiet_traceback()
        raise
    return env


def _joining_failed(env, store, error):
    """After ``error`` ended group creation: the :class:`PeerFailedError` naming the rank at fault, or
    None when ``error`` is this rank's own (then published, so that the peers name this rank).

    The heartbeat runs from before gloo connects: it names a peer that died, froze or was cut off,
    and wakes this rank from gloo's wait (see ``_teardown._on_watchdog``). When gloo gave up first, its
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
    watchdog = _teardown.live['watchdog']
    cause, own = _teardown.live['cause'], False
    if cause is None:
        deadline = time.monotonic() + (2 * watchdog.interval + 1 if watchdog is not None else 0)
        cause, own = _diagnosis.diagnose(store, env, error)
        while _diagnosis.is_guess(cause) and _teardown.live['cause'] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if _teardown.live['cause'] is not None:
            cause, own = _teardown.live['cause'], False
    if own:
        return None
    if env.rank == 0 and watchdog is not None:
        # the others read the cause through their heartbeat's connection: keep the store up meanwhile
        _diagnosis.publish(watchdog.store, cause)
        _diagnosis.wait_until_read(watchdog.store, env.world_size, skip=cause.rank)
    return errors.PeerFailedError('{} (rank {} stopped)'.format(cause.line(), env.rank), cause.rank, cause.kind,
                                  cause.exc_type or None)


def _create(env, store, environ):
    interface = network.gloo_interface(env, environ)
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
        _teardown.live['gloo'] = _gloo_sockets.endpoints(group_store, dist.group.WORLD.group_name, env.rank,
                                                         env.world_size)


def destroy_process_group():
    """Tear down the default process group, if any; safe to call twice or after a failure.

    Rank 0, whose process holds the job's store, first waits until the other ranks have left too,
    so that none of them takes the store's end for rank 0's failure; a rank that falls silent
    meanwhile ends the wait within the rendezvous timeout, and is named to the others.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.destroy_process_group()  # nothing to do outside a process group
    """
    _teardown.leave()
    _teardown.destroy()


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
        watchdog = _teardown.live['watchdog']
        # a peer that gave up on this rank while it did not run, seen before its watch thread runs again
        frozen = watchdog.frozen_cause() if watchdog and _diagnosis.is_collective_error(error) else None
        _teardown.stop_watchdog()
        cause, own = _teardown.live['cause'] or frozen, False
        if cause is None:
            cause, own = _diagnosis.diagnose(store, env, error)
        if env.rank == 0 or cause.rank != 0 or cause.kind == _diagnosis.LOCAL:  # else the store is out of reach
            _diagnosis.publish(store, cause)
        _teardown.stop_peers(env)
        if env.rank == 0:
            _diagnosis.wait_until_read(store, env.world_size, skip=cause.rank)
        _teardown.destroy()
        if not own:
            errors._quiet_traceback()
            raise errors.PeerFailedError('{} (rank {} stopped)'.format(cause.line(), env.rank), cause.rank,
                                         cause.kind, cause.exc_type or None) from error
        raise
    else:
        cause = _teardown.leave()
        if cause is not None:  # this rank's block ended well, but a peer fell silent before leaving
            _teardown.stop_watchdog()
            _teardown.destroy()
            errors._quiet_traceback()
            raise errors.PeerFailedError('{} (rank {} stopped)'.format(cause.line(), env.rank), cause.rank,
                                         cause.kind, cause.exc_type or None)
    finally:
        _teardown.destroy()
