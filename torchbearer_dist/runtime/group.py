"""The process group's life: create it, run a block inside it, end a failure cleanly, tear it down.

Everything that lives as long as a group belongs to one :class:`~torchbearer_dist.runtime._live.LiveGroup`,
kept in ``env._live``. A guest in the program: importing this installs no handler of any kind; a live group
registers one exit handler, which tears it down if the program left it up, never exits the process or changes
its status, and is unregistered when the group ends. The interface chosen for gloo is in ``os.environ`` only
while the group is created.
"""
import os
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis, network, rendezvous
from torchbearer_dist.runtime import env as env_module
from torchbearer_dist.runtime._decision import JOIN, LEAVE, RUN
from torchbearer_dist.runtime._live import LiveGroup, destroy_torch_group, endpoints
from torchbearer_dist.runtime.env import resolve, with_rendezvous_timeout
from torchbearer_dist.runtime.errors import GlooConnectError


def _import_torch_nn_first():
    """Import :mod:`torch.distributed.nn` while no process group exists, so that nothing holds one after it ends.

    Its ``functional`` evaluates ``group=group.WORLD`` in its signatures when first imported (torch imports it
    with ``torch._dynamo`` at a process's first optimizer). Imported while a group is up, those defaults keep
    the group alive: gloo's worker threads then run into interpreter finalization, where one that drops a
    finished collective aborts the process after training ended (exit -6, seen in a core file).
    """
    if 'torch.distributed.nn' not in sys.modules and not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401


_import_torch_nn_first()


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
    if env_module._live is not None:  # its torch group was destroyed behind its back: end the rest of it
        env_module._live.end()
    if env.backend == 'nccl':
        torch.cuda.set_device(env.local_rank)
    store, sock = rendezvous._make_store(env, environ)
    store = dist.PrefixStore(rendezvous._namespace(environ), store)
    live = env_module._live = LiveGroup(env, store, sock)
    try:
        live.joining = True  # until every rank is connected, the heartbeat wakes the main thread from the store
        try:
            if env.world_size > 1:
                store.set_timeout(env.meet_timeout)
                live.start_watchdog(environ)  # from before the handshake: a master that stops answering ends it
                rendezvous.handshake(store, env)
                live.watch_peers()  # and from before gloo connects: a rank lost meanwhile is named
            live.connecting = True
            _create(live, environ)
        finally:
            live.joining = live.connecting = False
        live.main_connections = []  # connected: from now on the heartbeat wakes collectives, not the store
        if env.world_size > 1:
            rendezvous.wait_until_connected(store, env)
    except BaseException as error:
        failure = live.failed(error, JOIN)
        live.end()
        if failure is not None:
            raise failure from error
        raise
    return env


def _create(live, environ):
    env, store = live.env, live.store
    interface = network.gloo_interface(env, environ)
    if interface is not None:  # read by gloo while it makes its device, then given back
        environ['GLOO_SOCKET_IFNAME'] = interface
    group_store = dist.PrefixStore('pg', store)
    # gloo's connect waits for every peer as long as the group's timeout: the rendezvous timeout
    # bounds it, and the collective timeout is set once every rank is connected.
    connect_timeout = timedelta(seconds=live.timing.gloo_connect)
    hook = sys.excepthook
    try:
        dist.init_process_group(env.backend, store=group_store, rank=env.rank, world_size=env.world_size,
                                timeout=connect_timeout)
        if sys.excepthook is not hook:  # torch's, which prefixes the rank: the program's again once the group ends
            live.excepthooks = (hook, sys.excepthook)
        if connect_timeout != env.timeout:
            # the group's own method: torch 2.13 has no dist.set_timeout (2.14's is a wrapper of it)
            dist.group.WORLD.set_timeout(env.timeout)
    except RuntimeError as error:
        # gloo's own connect failed: a plain RuntimeError (the store's and torch's own are DistErrors) out of
        # this connect, known by where it was raised, not by gloo's words; the fold names a peer the heartbeat
        # found at fault instead
        if type(error) is not RuntimeError or env.backend != 'gloo':
            raise
        name = interface or environ.get('GLOO_SOCKET_IFNAME')
        where = 'interface {!r}'.format(name) if name else 'the interface its host name resolves to'
        raise GlooConnectError('gloo on rank {} could not connect to the other ranks through {} ({}); set '
                               'GLOO_SOCKET_IFNAME to the interface of this machine that reaches the other '
                               'machines'.format(env.rank, where, _diagnosis.describe(error))) from None
    finally:
        if interface is not None:
            environ.pop('GLOO_SOCKET_IFNAME', None)
    if env.backend == 'gloo' and env.world_size > 1:
        live.gloo = endpoints(group_store, dist.group.WORLD.group_name, env.rank, env.world_size)


def destroy_process_group():
    """Tear down the default process group, if any; safe to call twice or after a failure.

    Rank 0, whose process holds the job's store, first waits until the other ranks have left too,
    so that none of them takes the store's end for rank 0's failure; a rank that falls silent
    meanwhile ends the wait within the rendezvous timeout, and is named to the others.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.destroy_process_group()  # nothing to do outside a process group
    """
    live = env_module._live
    if live is None:  # a torch group made outside this package, if any
        destroy_torch_group()
    else:
        live.leave()
        live.end()


@contextmanager
def process_group(rank=None, world_size=None, host=None, port=None, backend=None, timeout=None,
                  init_method=None, local_rank=None, rendezvous_timeout=None):
    """Run a block inside the job's process group, and always tear it down.

    When the block raises, its cause is published to the other ranks through the store and the group is
    torn down, so that the others stop within seconds with one line naming this rank and its error. When a
    peer failed first, the block's own error (a broken connection, a timeout) is replaced by
    :class:`~torchbearer_dist.PeerFailedError` naming the root cause, e.g.
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
    live = env_module._live
    try:
        yield env
    except BaseException as error:
        failure = live.failed(error, RUN)
        if failure is not None:
            raise failure from error
        raise
    else:
        failure = live.failed(None, LEAVE)
        if failure is not None:
            raise failure
    finally:
        live.end()
