"""The process group's life: create it, run a block inside it, end a failure cleanly, tear it down.

Everything that lives as long as a group, its store, its listening socket, its heartbeat, gloo's
connections and the cause the heartbeat found, belongs to one :class:`_LiveGroup`, made by
:func:`init_process_group` and ended by :func:`destroy_process_group` (or by the block of
:func:`process_group`) and kept in ``env._live``, where :func:`~torchbearer_dist.runtime.env.current_env`
reads it. Why a rank stopped is decided here (what the block raised, what the heartbeat found) with
:mod:`._diagnosis` (the cause, published through the store) and :mod:`._watchdog` (the heartbeat).

A guest in the program: importing this module registers no exit handler, installs no signal handler
and leaves ``sys.excepthook`` alone (Ctrl-C and pre-emption handling are opt-in, in
:mod:`torchbearer_dist.runtime.interrupts`; the one-line form of an uncaught
:class:`~torchbearer_dist.PeerFailedError` is :func:`~torchbearer_dist.quiet_peer_failures`). A live
group registers one exit handler, which tears it down if the program left it up and never exits the
process or changes its status; it is unregistered when the group ends. ``os.environ`` is left as it
was found: the interface chosen for gloo is set only while the group is created.
"""
import atexit
import os
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis, _gloo_sockets, _peers, errors, network, rendezvous
from torchbearer_dist.runtime import env as env_module
from torchbearer_dist.runtime._verdict import LEFT
from torchbearer_dist.runtime._watchdog import Watchdog
from torchbearer_dist.runtime.env import resolve, with_rendezvous_timeout


def _import_torch_nn_first():
    """Import :mod:`torch.distributed.nn` while no process group exists, so that nothing holds one after it ends.

    ``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` in its signatures when first
    imported, and torch imports it with ``torch._dynamo`` when a process builds its first optimizer.
    Imported while a group is up, its default arguments keep that group alive for the rest of the
    process: ``destroy_process_group`` then leaves gloo's worker threads running into interpreter
    finalization, where a worker that drops a finished collective aborts the process after training
    ended ("terminate called without an active exception", exit -6; measured in a core file: the
    worker, in ``ProcessGroupGloo::AsyncWork``'s destructor, asked for the GIL of a finalizing
    interpreter). Imported before any group exists, the defaults are None and the group ends when it
    is destroyed. Called once, at import: a group that is already up then is left as torch leaves it.
    """
    if 'torch.distributed.nn' not in sys.modules and not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401


_import_torch_nn_first()


class _LiveGroup:
    """The one live process group of this process, and everything that lives as long as it.

    Made by :func:`init_process_group` and ended by :meth:`end`; nothing else holds live state. Its
    heartbeat's thread calls back into it (:meth:`_on_watchdog`), and the Ctrl-C watcher of
    :mod:`~torchbearer_dist.runtime.interrupts` wakes it (:meth:`interrupt_collectives`).

    Attributes:
        env (DistEnv): this process's place in the job
        store (torch.distributed.Store): the job's store, namespaced to this job
        socket (socket.socket or None): rank 0's listening socket of the store
        peers (dict): the ranks of this machine, ``{rank: (pid, start time)}`` (see :mod:`._peers`)
        watchdog (Watchdog or None): the heartbeat, while it runs
        cause (Cause or None): what the heartbeat found, or read from another rank
        gloo (list or None): every rank's gloo listening address (see :mod:`._gloo_sockets`)
        connecting (bool): whether gloo is connecting the ranks now
        main_connections (list): the main thread's store connections, woken while gloo connects
        heartbeat_connections (list): the heartbeat's own store connections
        stopped (list): stopped heartbeats whose threads may still be inside a store call
        excepthooks (tuple or None): the program's ``sys.excepthook`` and the one
            :func:`torch.distributed.init_process_group` put in its place (it prefixes ``[rankN]:``)
    """

    def __init__(self, env, store, sock):
        self.env, self.store, self.socket = env, store, sock
        self.peers, self.watchdog, self.cause, self.gloo, self.connecting = {}, None, None, None, False
        self.main_connections, self.heartbeat_connections, self.stopped = [], [], []
        self.excepthooks, self.ended = None, False
        atexit.register(self._at_exit)

    def start_watchdog(self, environ):
        """Start this rank's heartbeat, over a store connection of its own, once the ranks have met."""
        env = self.env
        self.peers = _peers.local_peers(self.store, env.rank, env.world_size)
        if env.init_method is None:  # the main thread's store connections: only they are woken while gloo connects
            self.main_connections = _gloo_sockets.store_connections(env.host, env.port)
        client = rendezvous.connect_client(env, environ)
        if client is not None:
            self.heartbeat_connections = [c for c in _gloo_sockets.store_connections(env.host, env.port)
                                          if c not in self.main_connections]
            client.set_timeout(timedelta(seconds=min(5.0, env.meet_timeout.total_seconds() / 2)))
            self.watchdog = Watchdog(env, client, lambda cause, store_answers: self._on_watchdog(
                client, cause, store_answers), dead_ranks=lambda: _peers.dead_local_ranks(self.peers)).start()

    def _on_watchdog(self, client, cause, store_answers):
        """From the heartbeat's thread: publish what it found where the store still answers (or read what
        another rank published), then wake this rank's main thread."""
        if cause is not None:
            self.cause = cause  # the main thread reports it even if the store is out of reach
            if store_answers:  # rank 0 too then learns the cause, rather than guessing one from a closed connection
                _diagnosis.publish(client, cause)
        else:
            try:  # read now, while rank 0 still waits for its readers: its store may be gone when the main thread asks
                self.cause = _diagnosis.read_cause(client, deaths=False, reader=self.env.rank)
            except Exception:
                pass
        self.interrupt_collectives()
        if self.connecting and self.main_connections:  # gloo is still connecting, maybe inside a store call
            _gloo_sockets.shut_down_connections(self.main_connections)
            self._end_a_stuck_connect()

    def _end_a_stuck_connect(self, grace=2.0):
        """Last resort, from the heartbeat's thread: end this process when gloo's connect does not return.

        Gloo connecting to a peer whose host went silent retries for about five times its timeout, and
        nothing from outside interrupts that native call. The main thread has first been woken (its
        store connections shut down, which ends a connect waiting in the store) and given ``grace``
        seconds to return; only if it is still inside :func:`torch.distributed.init_process_group`, with
        no user code running yet, does this say the cause in one line and exit with status 1, as the
        uncaught error would have (``os._exit``: exit handlers do not run).
        """
        deadline = time.monotonic() + grace
        while self.connecting and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.connecting:
            return
        line = self.cause.line() if self.cause is not None else 'another rank failed while the ranks were connecting'
        sys.stderr.write('torchbearer_dist: error: {} (rank {} stopped while gloo was connecting)\n'.format(
            line, self.env.rank))
        sys.stderr.flush()
        os._exit(1)

    def interrupt_collectives(self):
        """Make this rank's pending and future collectives fail now, so that its main thread unwinds."""
        if self.env.backend == 'gloo':
            _gloo_sockets.shut_down(self.gloo, self.env.rank)
        elif dist.is_initialized():
            try:
                dist.group.WORLD.abort()  # nccl: aborts the communicators, as its own watchdog does
            except Exception:
                pass

    def stop_peers(self):
        """Make the peers' collectives fail now: destroy the group, and shut down what something still holds.

        ``destroy_process_group`` closes gloo's connections only when nothing else holds the group; a
        pending gradient all-reduce referenced from a traceback keeps them open (measured: see
        :mod:`torchbearer_dist.runtime._gloo_sockets`).
        """
        held = _gloo_sockets.connections(self.gloo, self.env.rank) if self.env.backend == 'gloo' else []
        _destroy_torch_group()
        if held and _gloo_sockets.connections(self.gloo, self.env.rank):
            _gloo_sockets.shut_down(self.gloo, self.env.rank)

    def stop_watchdog(self):
        """Stop this rank's heartbeat now; one still inside a store call is joined at exit."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop(wait=0)
            # a store call to a frozen or cut-off master would block its thread, and this process's exit
            # (see _at_exit), for the client's whole timeout: make it fail now
            _gloo_sockets.shut_down_connections(self.heartbeat_connections)
            self.heartbeat_connections = []
            watchdog.stop()
            self.stopped = [w for w in self.stopped + [watchdog] if w.running()]

    def leave(self, wait=True):
        """A clean end of this rank: mark it left, and on rank 0 wait for the others (see
        :func:`destroy_process_group`).

        Returns:
            Cause or None: why the wait ended early, a peer's failure or silence
        """
        env, store, watchdog = self.env, self.store, self.watchdog
        if watchdog is None or env.world_size == 1 or self.cause is not None:
            return None
        try:
            store.set_timeout(timedelta(seconds=1))  # a frozen master would hold this rank for the whole timeout
            store.add('hb/{}'.format(env.rank), LEFT)
        except Exception:  # the store is gone or frozen: nobody is left to wait for
            return None
        keys = ['hb/{}'.format(r) for r in range(1, env.world_size)]
        while wait and env.rank == 0 and self.cause is None and watchdog.running():
            try:  # rank 0 holds the store: reading it from here is quick
                if all(int(value) >= LEFT for value in store.multi_get(keys)):
                    break
            except Exception:
                break
            time.sleep(0.05)
        return self.cause

    def end(self, at_exit=False):
        """Tear the group down as far as torch allows and forget it; safe twice, or after a failure."""
        if not self.ended:  # once: a later group of this process is not this one's to destroy
            self.ended = True
            self.stop_watchdog()
            _destroy_torch_group()
            self.gloo, self.cause, self.main_connections, self.peers = None, None, [], {}
            if self.excepthooks is not None and sys.excepthook is self.excepthooks[1]:  # torch never gives it back
                sys.excepthook = self.excepthooks[0]
            if self.socket is not None:
                self.socket.close()
        if env_module._live is self:
            env_module._live = None
        if not at_exit and not self.stopped:
            atexit.unregister(self._at_exit)

    def _at_exit(self):
        """Leave no torch thread running into interpreter finalization, so that the process exits 0.

        A thread that asks for the GIL once the interpreter finalizes aborts the process: "terminate
        called without an active exception", exit code 134. Two can: gloo's worker dropping a finished
        all-reduce (measured, interleaved: 5 of 80 processes of a two-rank script that ends right after
        an ``all_reduce`` without destroying its group, 0 of 80 with this handler) and our heartbeat
        returning from a store call. Exit handlers run before that point: end a group the program left
        up, which joins gloo's threads (once nothing else holds the group: see
        :func:`_import_torch_nn_first`), and wait for every stopped heartbeat. Registered while the group
        lives (or a stopped heartbeat's thread does); it never exits the process nor sets its status.
        """
        if env_module._live is self:
            self.leave(wait=False)  # no wait for the peers: an uncaught error may be on its way out
            self.end(at_exit=True)
        while self.stopped:
            self.stopped.pop().join()


def _destroy_torch_group():
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass


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
    live = env_module._live = _LiveGroup(env, store, sock)
    try:
        if env.world_size > 1:
            store.set_timeout(env.meet_timeout)
            rendezvous.handshake(store, env)
            live.start_watchdog(environ)  # from before gloo connects: a rank lost meanwhile is named
        live.connecting = True
        try:
            _create(live, environ)
        finally:
            live.connecting = False
        live.main_connections = []  # connected: from now on the heartbeat wakes collectives, not the store
        if env.world_size > 1:
            rendezvous.wait_until_connected(store, env)
    except BaseException as error:
        failure = _joining_failed(live, error)
        live.end()
        if failure is not None:
            raise failure from error
        raise
    return env


def _joining_failed(live, error):
    """After ``error`` ended group creation: the :class:`PeerFailedError` naming the rank at fault, or
    None when ``error`` is this rank's own (then published, so that the peers name this rank).

    The heartbeat runs from before gloo connects: it names a peer that died, froze or was cut off,
    and wakes this rank from gloo's wait (see :meth:`_LiveGroup._on_watchdog`). When gloo gave up first, its
    words are only a guess: the heartbeat gets two beats and a second more to name the rank.
    """
    env, store = live.env, live.store
    if env.world_size == 1 or isinstance(error, ValueError):
        return None
    if isinstance(error, errors.PeerFailedError):  # a peer's published cause, read in the rendezvous
        if env.rank == 0:  # the store ends with this process: let the others read that cause first
            _diagnosis.wait_until_read(store, env.world_size, skip=error.rank)
        return None
    if not _diagnosis.is_collective_error(error):
        # KeyboardInterrupt, SystemExit; a RuntimeError is the rendezvous' own words, which each rank says for
        # itself (a duplicate rank must not end the job it tried to join), except on rank 0, whose store ends
        # with it: the others then read why (a rank that did not join) instead of finding the store gone
        if not isinstance(error, RuntimeError) or env.rank == 0:
            _diagnosis.publish(store, _diagnosis.own_cause(env.rank, error))
            if env.rank == 0:
                _diagnosis.wait_until_read(store, env.world_size)
        return None
    watchdog = live.watchdog
    cause, own = live.cause, False
    if cause is None:
        deadline = time.monotonic() + (2 * watchdog.interval + 1 if watchdog is not None else 0)
        cause, own = _diagnosis.diagnose(store, env, error, watchdog.silence() if watchdog is not None else None)
        while _diagnosis.is_guess(cause) and live.cause is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if live.cause is not None:
            cause, own = live.cause, False
    if own:
        return None
    if env.rank == 0 and watchdog is not None:
        # the others read the cause through their heartbeat's connection: keep the store up meanwhile
        _diagnosis.publish(watchdog.store, cause)
        _diagnosis.wait_until_read(watchdog.store, env.world_size, skip=cause.rank)
    return errors.PeerFailedError.from_cause(cause, env.rank)


def _create(live, environ):
    env, store = live.env, live.store
    interface = network.gloo_interface(env, environ)
    if interface is not None:  # read by gloo while it makes its device, then given back
        environ['GLOO_SOCKET_IFNAME'] = interface
    group_store = dist.PrefixStore('pg', store)
    # gloo's connect waits for every peer as long as the group's timeout: the rendezvous timeout
    # bounds it, and the collective timeout is set once every rank is connected.
    connect_timeout = min(env.timeout, env.meet_timeout)
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
        # gloo's own connect failed: a plain RuntimeError (the store's and torch's own are DistErrors) out
        # of this connect, while the heartbeat found no peer at fault. Known by where it was raised and
        # what the heartbeat saw, not by gloo's words.
        if type(error) is not RuntimeError or live.cause is not None or env.backend != 'gloo':
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
        live.gloo = _gloo_sockets.endpoints(group_store, dist.group.WORLD.group_name, env.rank,
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
    live = env_module._live
    if live is None:  # a torch group made outside this package, if any
        _destroy_torch_group()
    else:
        live.leave()
        live.end()


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
    live = env_module._live
    store = live.store
    try:
        yield env
    except errors.Preempted:
        raise  # every rank stops at the same step once the checkpoint is written: an agreed end, not a fault
    except BaseException as error:
        if env.world_size == 1:
            raise
        watchdog = live.watchdog
        # a peer that gave up on this rank while it did not run, seen before its watch thread runs again
        frozen = watchdog.frozen_cause() if watchdog and _diagnosis.is_collective_error(error) else None
        silence = watchdog.silence() if watchdog is not None else None
        live.stop_watchdog()
        cause, own = live.cause or frozen, False
        if cause is None:
            cause, own = _diagnosis.diagnose(store, env, error, silence)
        if env.rank == 0 or cause.rank != 0 or cause.kind == _diagnosis.LOCAL:  # else the store is out of reach
            _diagnosis.publish(store, cause)
        live.stop_peers()
        if env.rank == 0:
            _diagnosis.wait_until_read(store, env.world_size, skip=cause.rank)
        if not own:
            raise errors.PeerFailedError.from_cause(cause, env.rank) from error
        raise
    else:
        cause = live.leave()
        if cause is not None:  # this rank's block ended well, but a peer fell silent before leaving
            raise errors.PeerFailedError.from_cause(cause, env.rank)
    finally:
        live.end()
