"""(private) The live process group: everything that lives as long as it, and the one applier of this rank's stop.

Every fact that can end this rank comes here as an :class:`~torchbearer_dist.runtime._decision.Event`: the
heartbeat's verdict from its thread (:meth:`LiveGroup._on_watchdog`), a Ctrl-C the main thread did not take
from the watcher (:meth:`LiveGroup.interrupted`), what the main thread caught (:meth:`LiveGroup.failed`).
:meth:`LiveGroup._apply` folds it (:func:`~torchbearer_dist.runtime._decision.fold`, which decides everything)
and takes the actions: publish, wake, stop the peers, read the store, wait for the readers, raise the one line;
the answers of reads and waits are folded in turn. Here is only sensing and doing, never a choice of cause.

Waking ranks blocked in a gloo collective: shut down gloo's own connections. No public torch call does this for
gloo (``python benchmarks/peer_wakeup.py``, torch 2.14.1): after a peer's ``abort()``, ``shutdown()`` or
``destroy_process_group()`` (where a Work object still holds the group) a rank blocked in an all_reduce waits
the whole timeout, and no call from a helper thread wakes its main thread.

A socket of this process is gloo's exactly when its local address is this rank's gloo listening address, or
its remote address another rank's, as gloo publishes them in the store (:func:`published`); on any mismatch,
or off Linux, this does nothing. That layout is private to c10d and gloo: where it is not found,
:func:`endpoints` warns once (:data:`LOST`), and ``tests/runtime/test_private_gloo.py`` fails.
"""
import atexit
import os
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchbearer_dist._once import warn_once
from torchbearer_dist.runtime import _decision, _diagnosis, _peers, rendezvous
from torchbearer_dist.runtime import env as env_module
from torchbearer_dist.runtime._decision import LEAVE, LEFT, Event, State
from torchbearer_dist.runtime._timing import Timing, poll
from torchbearer_dist.runtime._watchdog import Watchdog
from torchbearer_dist.runtime.errors import PeerFailedError


class LiveGroup:
    """The one live process group of this process, kept in ``env._live``: made by
    :func:`~torchbearer_dist.runtime.group.init_process_group`, ended by :meth:`end`; nothing else holds live
    state. Its heartbeat's thread (:meth:`_on_watchdog`) and the Ctrl-C watcher (:meth:`interrupted`) call it;
    what this rank knows of its stop is one :class:`~torchbearer_dist.runtime._decision.State`, folded under a lock."""

    def __init__(self, env, store, sock):
        self.env, self.store, self.timing = env, store, Timing.of(env)
        self.socket = sock  # rank 0's listening socket of the store
        self.peers = {}  # the ranks of this machine, {rank: (pid, start time)} (see _peers)
        self.watchdog, self.client = None, None  # the heartbeat, while it runs, and its store connection
        self.state, self._lock = State(env, timing=self.timing), threading.Lock()
        self.gloo = None  # every rank's gloo listening address (see endpoints)
        self.joining = self.connecting = False  # the ranks are meeting (handshake to connected); gloo connects
        self.main_connections = []  # the main thread's store connections, woken while joining
        self.heartbeat_connections = []  # the heartbeat's own
        self.stopped = []  # stopped heartbeats whose threads may still be inside a store call
        self.excepthooks = None  # the program's sys.excepthook, and torch's that prefixes [rankN]: in its place
        self.ended = False
        atexit.register(self._at_exit)

    def start_watchdog(self, environ):
        """Start this rank's heartbeat, over a store connection of its own, before the handshake, so that a master
        that stops answering ends it; the others' beats are watched once all have joined (:meth:`watch_peers`)."""
        env = self.env
        if env.init_method is None:  # the main thread's store connections: only they are woken while joining
            self.main_connections = store_connections(env.host, env.port)
        client = rendezvous.connect_client(env, environ)
        if client is not None:
            self.heartbeat_connections = [c for c in store_connections(env.host, env.port)
                                          if c not in self.main_connections]
            client.set_timeout(timedelta(seconds=self.timing.heartbeat_call))
            self.client = client
            self.watchdog = Watchdog(env, client, self._on_watchdog, peers=False,
                                     dead_ranks=lambda: _peers.dead_local_ranks(self.peers)).start()

    def watch_peers(self):
        """Every rank has joined: watch their beats, and which of them run on this machine."""
        self.peers = _peers.local_peers(self.store, self.env.rank, self.env.world_size)
        if self.watchdog is not None:
            self.watchdog.watch_peers()

    def _on_watchdog(self, cause, store_answers):
        """From the heartbeat's thread: its verdict, the ``cause`` found, or None when another rank's is in the
        store, read now (while rank 0 still waits for its readers: its store may go)."""
        published = self._read(False, self.client).published if cause is None else None
        self._apply(self._event(_decision.FOUND, cause=cause, store_answers=store_answers, published=published))

    def interrupted(self):
        """From the Ctrl-C watcher: the main thread did not take a Ctrl-C in time."""
        self._apply(self._event(_decision.INTERRUPTED))

    def failed(self, error, phase):
        """This rank's main thread stops with ``error``, what group creation (``JOIN``) or the program's block
        (``RUN``) raised, or None (``LEAVE``: the block ended well, see :meth:`leave`). Returns the PeerFailedError
        to raise, naming the rank at fault, or None to raise ``error``."""
        if phase == LEAVE:
            return self._apply(self._event(_decision.ENDED, cause=self.leave()))
        return self._apply(self._event(_decision.CAUGHT, error=error, phase=phase))

    def _event(self, kind, **fields):
        """An :class:`~._decision.Event` now, with the heartbeat's memory."""
        return Event(kind, time.monotonic(), getattr(self.watchdog, 'memory', None), **fields)  # read once

    def _apply(self, event):
        """The one applier: fold ``event`` and take the actions :func:`~._decision.fold` answers, in order, folding
        the answer of a read or a wait in turn. Returns the error a RAISE action names (None: the one caught)."""
        failure = None
        while event is not None:
            with self._lock:
                self.state, actions = _decision.fold(self.state, event)
            event = None
            for action, *args in actions:
                if action == _decision.PUBLISH:
                    _diagnosis.publish(self.client if args[1] else self.store, args[0])
                elif action == _decision.WAKE:  # and, with args[0] while the ranks meet, a store call (gloo's connect)
                    self.interrupt_collectives()
                    if args[0] and self.joining and self.main_connections:
                        shut_down(self.main_connections)
                        self._end_a_stuck_connect()
                elif action == _decision.STOP_PEERS:
                    self.stop_peers()
                elif action == _decision.WAIT:
                    time.sleep(Timing.POLL)
                    event = self._event(_decision.TICK)
                elif action == _decision.READ:
                    event = self._read(args[0], self.store)
                elif action == _decision.READERS:
                    try:  # the store gone: nobody is left to read the cause
                        read = not args[0] or (self.client if args[1] else self.store).check(list(args[0]))
                    except Exception:
                        read = True
                    event = self._event(_decision.TOLD, read=read)
                else:  # RAISE
                    failure = args[0] and PeerFailedError.from_cause(args[0], self.env.rank)
        return failure

    def _read(self, probe, store):
        """What the master's port (where ``probe``: the ``store`` is asked only where it accepts, since a store call
        to a silent host could block past any timeout) and the store say, as a ``TOLD`` event."""
        env, published, failed = self.env, None, False
        master = _peers.probe(env.host, env.port) if probe else 'ok'
        if master == 'ok':
            try:
                published = _diagnosis.read_cause(store, reader=env.rank)
            except Exception:
                failed = True
        return self._event(_decision.TOLD, master=master, published=published, store_failed=failed)

    def _end_a_stuck_connect(self):
        """Last resort, from the heartbeat's thread: gloo connecting to a silent host retries for about five
        times its timeout, and nothing interrupts that native call. Woken first (its store connections shut), a
        main thread still inside it ``Timing.CONNECT_GRACE`` later, with no user code running yet, is ended: the
        cause in one line and status 1, as the uncaught error would have (``os._exit``: no exit handlers)."""
        if poll(lambda: not self.connecting, Timing.CONNECT_GRACE):
            return
        cause = self.state.heartbeat
        line = cause.line() if cause is not None else 'another rank failed while the ranks were connecting'
        sys.stderr.write('torchbearer_dist: error: {} (rank {} stopped while gloo was connecting)\n'.format(
            line, self.env.rank))
        sys.stderr.flush()
        os._exit(1)

    def interrupt_collectives(self):
        """Make this rank's pending and future collectives fail now, so that its main thread unwinds."""
        if self.env.backend == 'gloo':
            shut_down(connections(self.gloo, self.env.rank))
        elif dist.is_initialized():
            try:
                dist.group.WORLD.abort()  # nccl: aborts the communicators, as its own watchdog does
            except Exception:
                pass

    def stop_peers(self):
        """Make the peers' collectives fail now: destroy the group, and shut down gloo's connections where
        something still holds it (a pending all-reduce referenced from a traceback: see this module's docstring)."""
        held = self.env.backend == 'gloo' and connections(self.gloo, self.env.rank)
        destroy_torch_group()
        if held:  # those still open now
            shut_down(connections(self.gloo, self.env.rank))

    def stop_watchdog(self):
        """Stop this rank's heartbeat now; one still inside a store call is joined at exit."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop(wait=0)  # its store call to a frozen master would block this process's exit: fail it now
            shut_down(self.heartbeat_connections)
            self.heartbeat_connections = []
            watchdog.stop()
            self.stopped = [w for w in self.stopped + [watchdog] if w.running()]

    def leave(self, wait=True):
        """A clean end of this rank: mark it left, and on rank 0 wait for the others; the cause that ended
        the wait early (a peer's failure or silence), or None."""
        env, store, watchdog = self.env, self.store, self.watchdog
        if watchdog is None or env.world_size == 1 or self.state.heartbeat is not None:
            return None
        try:  # a frozen master would hold this rank for the whole timeout
            store.set_timeout(timedelta(seconds=Timing.LEAVE_CALL))
            store.add('hb/{}'.format(env.rank), LEFT)
        except Exception:  # the store is gone or frozen: nobody is left to wait for
            return None
        keys = ['hb/{}'.format(r) for r in range(1, env.world_size)]
        while wait and env.rank == 0 and self.state.heartbeat is None and watchdog.running():
            try:  # rank 0 holds the store: reading it from here is quick
                if all(int(value) >= LEFT for value in store.multi_get(keys)):
                    break
            except Exception:
                break
            time.sleep(Timing.POLL)
        return self.state.heartbeat

    def end(self, at_exit=False):
        """Tear the group down as far as torch allows and forget it; safe twice, or after a failure."""
        if not self.ended:  # once: a later group of this process is not this one's to destroy
            self.ended = True
            self.stop_watchdog()
            destroy_torch_group()
            self.gloo, self.state, self.main_connections, self.peers = None, State(self.env, timing=self.timing), [], {}
            if self.excepthooks is not None and sys.excepthook is self.excepthooks[1]:  # torch never gives it back
                sys.excepthook = self.excepthooks[0]
            if self.socket is not None:
                self.socket.close()
        if env_module._live is self:
            env_module._live = None
        if not at_exit and not self.stopped:
            atexit.unregister(self._at_exit)

    def _at_exit(self):
        """Leave no torch thread running into interpreter finalization, where one that asks for the GIL aborts the
        process (exit 134): gloo's worker dropping a finished all-reduce (5 of 80 two-rank scripts that end
        without destroying their group, 0 of 80 with this) or our heartbeat returning from a store call. Ends a
        group the program left up, waits for every stopped heartbeat; never exits the process nor sets its status."""
        if env_module._live is self:
            self.leave(wait=False)  # no wait for the peers: an uncaught error may be on its way out
            self.end(at_exit=True)
        while self.stopped:
            self.stopped.pop().join()


def destroy_torch_group():
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass


_AF_INET, _AF_INET6 = 2, 10

LOST = ('torchbearer_dist: gloo\'s listening addresses were not found in the c10d store (key '
        '"<group>//cpu//0/<rank>", a host name and a sockaddr, each after its length) in this torch {}; a rank '
        'blocked in a gloo collective now wakes only at the process group\'s timeout, not within seconds of a peer '
        'falling silent')


def _sockaddr(value, offset):
    """``(ip, port)`` of the ``sockaddr`` at ``offset`` of gloo's serialized address (24 bytes there, as
    :func:`published` checked), or None."""
    family = struct.unpack_from('<H', value, offset)[0]
    port = struct.unpack_from('>H', value, offset + 2)[0]
    if family == _AF_INET:
        return socket.inet_ntop(socket.AF_INET, value[offset + 4:offset + 8]), port
    if family == _AF_INET6:
        return _plain(socket.inet_ntop(socket.AF_INET6, value[offset + 8:offset + 24])), port
    return None


def _plain(ip):
    return ip[len('::ffff:'):] if ip.startswith('::ffff:') and '.' in ip else ip


def _sockets():
    """``[(fd, inode, local (ip, port), remote (ip, port) or None when listening)]`` for this process's TCP
    sockets, asked of each socket (``/proc/net/tcp`` can skip rows while other sockets come and go)."""
    found = []
    try:
        fds = sorted(int(fd) for fd in os.listdir('/proc/self/fd'))
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink('/proc/self/fd/{}'.format(fd))
            if not target.startswith('socket:['):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            local = _plain(sock.getsockname()[0]), sock.getsockname()[1]
            inode = int(target[len('socket:['):-1])
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.append((fd, inode, local, None))
            else:
                remote = sock.getpeername()  # OSError when not connected: left out
                found.append((fd, inode, local, (_plain(remote[0]), remote[1])))
        except OSError:
            continue
        finally:
            sock.close()
    return found


def endpoints(store, group_name, rank, world_size):
    """Every rank's gloo listening address ``(ip, port)``, read from the group's ``store`` right after the group
    ``group_name`` was made; None when they cannot be read or do not match this process's listening socket."""
    try:
        values = [store.get('{}//cpu//0/{}'.format(group_name, other)) for other in range(world_size)]
    except Exception:
        return _lost()
    found = [published(value) for value in values]
    listening = set(local for _, _, local, remote in _sockets() if remote is None)
    if None in found or found[rank] not in listening:
        return _lost()
    return found


def published(value):
    """``(ip, port)`` of the listening address in one rank's ``value`` of ``<group>//cpu//0/<rank>``, or None.

    gloo writes the host name and then the address (a ``sockaddr`` first), each after its length as an 8-byte
    little-endian integer: the address has no fixed offset (byte 18 after a host named ``vm``, 21 after ``node1``).
    """
    value = bytes(value)
    if len(value) < 8:
        return None
    name = struct.unpack_from('<Q', value, 0)[0]
    if name > 1024 or len(value) < 8 + name + 8:
        return None
    address = struct.unpack_from('<Q', value, 8 + name)[0]
    if address < 24 or len(value) < 8 + name + 8 + address:
        return None
    return _sockaddr(value, 8 + name + 8)


def _lost():
    if sys.platform.startswith('linux'):  # elsewhere this module never had a way to the sockets
        warn_once(LOST.format(torch.__version__))
    return None


def connections(addresses, rank):
    """``[(fd, socket inode)]`` of this process's gloo connections (never its listening socket), given
    ``addresses``, what :func:`endpoints` returned, and this ``rank``."""
    if not addresses:
        return []
    peers = set(a for r, a in enumerate(addresses) if r != rank)
    return [(fd, inode) for fd, inode, local, remote in _sockets()
            if remote is not None and (local == addresses[rank] or remote in peers)]


def store_connections(host, port):
    """``[(fd, socket inode)]`` of this process's connections to the store at ``host:port``: shut down, they fail
    a store call that nothing else interrupts (gloo waiting for its peers' addresses, the handshake)."""
    try:
        addresses = set(_plain(info[4][0]) for info in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
    except OSError:
        return []
    return [(fd, inode) for fd, inode, _, remote in _sockets()
            if remote is not None and remote[1] == port and remote[0] in addresses]


def shut_down(pairs):
    """Shut down the sockets ``pairs`` (from :func:`connections` or :func:`store_connections`) still name: every
    call on them fails now."""
    for fd, inode in pairs:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if os.fstat(sock.fileno()).st_ino != inode:  # closed and reused since it was listed
                continue
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()
