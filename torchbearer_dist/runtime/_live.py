"""(private) The live process group: everything that lives as long as it, and how this rank stops.

When this rank stops, :class:`LiveGroup` gathers the facts (what the main thread caught, what the heartbeat
found, what the store and the process table say), asks :func:`~torchbearer_dist.runtime._decision.decide` and
acts on the answer: publish, stop the peers, wait for the readers, raise.
"""
import atexit
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist

from torchbearer_dist.runtime import _decision, _diagnosis, _gloo_sockets, _peers, rendezvous
from torchbearer_dist.runtime import env as env_module
from torchbearer_dist.runtime._decision import COLLECTIVE, HEARTBEAT, INTERRUPT, LEAVE, RUN, Facts, classify, decide
from torchbearer_dist.runtime._timing import Timing, poll
from torchbearer_dist.runtime._verdict import LEFT
from torchbearer_dist.runtime._watchdog import Watchdog
from torchbearer_dist.runtime.errors import PeerFailedError


class LiveGroup:
    """The one live process group of this process, kept in ``env._live``: made by
    :func:`~torchbearer_dist.runtime.group.init_process_group`, ended by :meth:`end`; nothing else holds live
    state. Its heartbeat's thread (:meth:`_on_watchdog`) and the Ctrl-C watcher (:meth:`interrupted`) call it."""

    def __init__(self, env, store, sock):
        self.env, self.store, self.timing = env, store, Timing.of(env)
        self.socket = sock  # rank 0's listening socket of the store
        self.peers = {}  # the ranks of this machine, {rank: (pid, start time)} (see _peers)
        self.watchdog = None  # the heartbeat, while it runs
        self.cause = None  # what the heartbeat found, or read from another rank
        self.gloo = None  # every rank's gloo listening address (see _gloo_sockets)
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
            self.main_connections = _gloo_sockets.store_connections(env.host, env.port)
        client = rendezvous.connect_client(env, environ)
        if client is not None:
            self.heartbeat_connections = [c for c in _gloo_sockets.store_connections(env.host, env.port)
                                          if c not in self.main_connections]
            client.set_timeout(timedelta(seconds=self.timing.heartbeat_call))
            self.watchdog = Watchdog(env, client, lambda cause, store_answers: self._on_watchdog(
                client, cause, store_answers), dead_ranks=lambda: _peers.dead_local_ranks(self.peers),
                peers=False).start()

    def watch_peers(self):
        """Every rank has joined: watch their beats, and which of them run on this machine."""
        self.peers = _peers.local_peers(self.store, self.env.rank, self.env.world_size)
        if self.watchdog is not None:
            self.watchdog.watch_peers()

    def _on_watchdog(self, client, cause, store_answers):
        """From the heartbeat's thread: act on what it found (see :func:`decide`), then wake the main thread."""
        watchdog = self.watchdog  # a published guess that this rank was lost may be its own pause, just ended
        frozen = watchdog.frozen_cause() if watchdog is not None and cause is None else None
        facts = Facts(self.env, HEARTBEAT, heartbeat=cause, store_answers=store_answers, frozen=frozen)
        decision = decide(facts, self.timing)
        if decision.read is not None:  # read now, while rank 0 still waits for its readers: its store may go
            try:
                published, _ = _diagnosis.read_cause(client, decision.read, decision.deaths, reader=self.env.rank)
            except Exception:
                published = None
            decision = decide(replace(facts, gathered=True, published=published), self.timing)
        self.cause = decision.cause  # the main thread reports it even if the store is out of reach
        if decision.publish:  # rank 0 too then learns the cause, rather than guessing one from a closed connection
            _diagnosis.publish(client, decision.cause)
        if decision.wake:
            self.interrupt_collectives()
        if decision.wake and self.joining and self.main_connections:  # the handshake or gloo's connect: maybe in
            _gloo_sockets.shut_down(self.main_connections)  # a store call, which this ends
            self._end_a_stuck_connect()

    def interrupted(self):
        """From the Ctrl-C watcher: the main thread did not take a Ctrl-C in time; ask :func:`decide` and act."""
        decision = decide(Facts(self.env, INTERRUPT), self.timing)
        if decision.publish:
            _diagnosis.publish(self.store, decision.cause)
        if decision.wake:
            self.interrupt_collectives()

    def failed(self, error, phase):
        """This rank's main thread stops with ``error``, what group creation (``JOIN``) or the program's block
        (``RUN``) raised, or None (``LEAVE``): gather the facts, ask :func:`decide`, act on its answer. Returns
        the PeerFailedError to raise, naming the rank at fault, or None to raise ``error``."""
        env, watchdog, timing = self.env, self.watchdog, self.timing
        if phase == LEAVE:
            decision = decide(Facts(env, LEAVE, heartbeat=self.leave()), timing)
            return None if decision.own else PeerFailedError.from_cause(decision.cause, env.rank)
        kind = classify(error, phase)
        own = _diagnosis.own_cause(env.rank, error) if kind != COLLECTIVE else None
        # a peer that gave up on this rank while it did not run, seen before its watch thread runs again
        frozen = watchdog.frozen_cause() if watchdog and phase == RUN and kind == COLLECTIVE else None
        silence = max(watchdog.silences().values(), default=None) if watchdog is not None else None
        facts = Facts(env, phase, kind, own, getattr(error, 'rank', None), frozen=frozen, watching=watchdog
                      is not None, timed_out=_decision.timed_out(error, silence, timing.limit),
                      failed_at=time.monotonic())
        stopped = False
        while True:  # the heartbeat runs meanwhile: its verdict, and which peer's beat stopped, are facts too
            facts = replace(facts, heartbeat=self.cause, now=time.monotonic(),
                            silences=watchdog.silences() if watchdog is not None else {})
            decision = decide(facts, timing)
            if decision.read is not None:
                facts = replace(facts, gathered=True, **self._gather(decision))
            elif decision.until is not None:
                if decision.stop_peers and not stopped:  # once: their collectives fail, rank 0 decides too
                    self.stop_peers()
                    stopped = True
                time.sleep(Timing.POLL)
            else:
                break
        # at the join, the main thread's store connections may have been shut to wake gloo: the heartbeat's serves
        store = self.watchdog.store if phase != RUN and kind == COLLECTIVE and self.watchdog else self.store
        if decision.publish:
            _diagnosis.publish(store, decision.cause)
        if phase == RUN:
            self.stop_watchdog()
        if decision.stop_peers:
            self.stop_peers()
        if decision.readers:
            _diagnosis.wait_until_read(store, env.world_size, skip=decision.skip)
        return None if decision.own else PeerFailedError.from_cause(decision.cause, env.rank)

    def _gather(self, decision):
        """What the master's port and the store say, as :class:`Facts` fields: the store is polled only
        where the port still accepts (a store call to a silent host could block past any timeout)."""
        env = self.env
        found = {'master': 'ok' if env.rank == 0 else _peers.probe(env.host, env.port)}
        if found['master'] == 'ok':
            try:
                found['published'], dead = _diagnosis.read_cause(self.store, decision.read, decision.deaths,
                                                                  reader=env.rank)
                found['dead'] = tuple(dead)
            except Exception:
                found['store_failed'] = True
        return found

    def _end_a_stuck_connect(self):
        """Last resort, from the heartbeat's thread: gloo connecting to a silent host retries for about five
        times its timeout, and nothing interrupts that native call. Woken first (its store connections shut), a
        main thread still inside it ``Timing.CONNECT_GRACE`` later, with no user code running yet, is ended: the
        cause in one line and status 1, as the uncaught error would have (``os._exit``: no exit handlers)."""
        if poll(lambda: not self.connecting, Timing.CONNECT_GRACE):
            return
        line = self.cause.line() if self.cause is not None else 'another rank failed while the ranks were connecting'
        sys.stderr.write('torchbearer_dist: error: {} (rank {} stopped while gloo was connecting)\n'.format(
            line, self.env.rank))
        sys.stderr.flush()
        os._exit(1)

    def interrupt_collectives(self):
        """Make this rank's pending and future collectives fail now, so that its main thread unwinds."""
        if self.env.backend == 'gloo':
            _gloo_sockets.shut_down(_gloo_sockets.connections(self.gloo, self.env.rank))
        elif dist.is_initialized():
            try:
                dist.group.WORLD.abort()  # nccl: aborts the communicators, as its own watchdog does
            except Exception:
                pass

    def stop_peers(self):
        """Make the peers' collectives fail now: destroy the group, and shut down gloo's connections where
        something still holds it (a pending all-reduce referenced from a traceback: see :mod:`._gloo_sockets`)."""
        held = self.env.backend == 'gloo' and _gloo_sockets.connections(self.gloo, self.env.rank)
        destroy_torch_group()
        if held:  # those still open now
            _gloo_sockets.shut_down(_gloo_sockets.connections(self.gloo, self.env.rank))

    def stop_watchdog(self):
        """Stop this rank's heartbeat now; one still inside a store call is joined at exit."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop(wait=0)  # its store call to a frozen master would block this process's exit: fail it now
            _gloo_sockets.shut_down(self.heartbeat_connections)
            self.heartbeat_connections = []
            watchdog.stop()
            self.stopped = [w for w in self.stopped + [watchdog] if w.running()]

    def leave(self, wait=True):
        """A clean end of this rank: mark it left, and on rank 0 wait for the others; the cause that ended
        the wait early (a peer's failure or silence), or None."""
        env, store, watchdog = self.env, self.store, self.watchdog
        if watchdog is None or env.world_size == 1 or self.cause is not None:
            return None
        try:  # a frozen master would hold this rank for the whole timeout
            store.set_timeout(timedelta(seconds=Timing.LEAVE_CALL))
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
            time.sleep(Timing.POLL)
        return self.cause

    def end(self, at_exit=False):
        """Tear the group down as far as torch allows and forget it; safe twice, or after a failure."""
        if not self.ended:  # once: a later group of this process is not this one's to destroy
            self.ended = True
            self.stop_watchdog()
            destroy_torch_group()
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
