"""How a live process group ends: its heartbeat, waking this rank when a peer fails, and the teardown.

Private to :mod:`~torchbearer_dist.runtime.group`, which creates the group and reacts to the block it
runs. The live group's state, the heartbeat started with it, what the heartbeat's thread does when it
finds a failure, and every way the group is left (cleanly, after a failure, at exit) are here.
"""
import atexit
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

# rendezvous registers its exit handler at import: imported first, it runs after _tear_down_at_exit
from torchbearer_dist.runtime import _diagnosis, _gloo_sockets, _peers, rendezvous
from torchbearer_dist.runtime._watchdog import LEFT, Watchdog
from torchbearer_dist.runtime.env import current_env, current_store, set_current


def import_torch_nn_first():
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


import_torch_nn_first()

#: The live group's heartbeat and its store connection, gloo's connections, the cause the heartbeat
#: found, the store connections to wake while gloo connects, and whether it is connecting.
live = {'watchdog': None, 'gloo': None, 'cause': None, 'store': None, 'client': None, 'connecting': False}
#: Stopped watchdogs whose threads may still be inside a store call; joined at exit.
_stopped = []


def start_watchdog(env, environ):
    """Start this rank's heartbeat, over a store connection of its own, once the ranks have met."""
    if env.init_method is None:  # the main thread's store connections: only they are woken while gloo connects
        live['store'] = _gloo_sockets.store_connections(env.host, env.port)
    client = rendezvous.connect_client(env, environ)
    if client is not None:
        live['client'] = [c for c in _gloo_sockets.store_connections(env.host, env.port) if c not in live['store']]
        client.set_timeout(timedelta(seconds=min(5.0, env.meet_timeout.total_seconds() / 2)))
        live['watchdog'] = Watchdog(env, client, lambda cause, store_answers: _on_watchdog(
            client, env, cause, store_answers)).start()


def _on_watchdog(client, env, cause, store_answers):
    """From the watchdog thread: publish what it found where the store still answers (or read what
    another rank published), then wake this rank's main thread."""
    if cause is not None:
        live['cause'] = cause  # the main thread reports it even if the store is out of reach
        if store_answers:  # rank 0 too then learns the cause, rather than guessing one from a closed connection
            _diagnosis.publish(client, cause)
    else:
        try:  # read now, while rank 0 still waits for its readers: its store may be gone when the main thread asks
            live['cause'] = _diagnosis.read_cause(client, deaths=False)
        except Exception:
            pass
    interrupt_collectives(env)
    if live['connecting'] and live['store']:  # gloo is still connecting, maybe waiting inside a store call
        _gloo_sockets.shut_down_connections(live['store'])
        _end_a_stuck_connect(env)


def _end_a_stuck_connect(env, grace=2.0):
    """Last resort, from the watchdog thread: end this process when gloo's connect does not return.

    Gloo connecting to a peer whose host went silent retries for about five times its timeout, and
    nothing from outside interrupts that native call. The main thread is then inside
    :func:`torch.distributed.init_process_group`, with no user code running yet: say the cause in
    one line and exit with status 1, as the uncaught error would have.
    """
    deadline = time.monotonic() + grace
    while live['connecting'] and time.monotonic() < deadline:
        time.sleep(0.05)
    if not live['connecting']:
        return
    cause = live['cause']
    line = cause.line() if cause is not None else 'another rank failed while the ranks were connecting'
    sys.stderr.write('torchbearer_dist: error: {} (rank {} stopped while gloo was connecting)\n'.format(
        line, env.rank))
    sys.stderr.flush()
    os._exit(1)


def interrupt_collectives(env):
    """Make this rank's pending and future collectives fail now, so that its main thread unwinds."""
    if env.backend == 'gloo':
        _gloo_sockets.shut_down(live['gloo'], env.rank)
    elif dist.is_initialized():
        try:
            dist.group.WORLD.abort()  # nccl: aborts the communicators, as its own watchdog does
        except Exception:
            pass


def stop_peers(env):
    """Make the peers' collectives fail now: destroy the group, and shut down what something still holds.

    ``destroy_process_group`` closes gloo's connections only when nothing else holds the group; a
    pending gradient all-reduce referenced from a traceback keeps them open (measured: see
    :mod:`torchbearer_dist.runtime._gloo_sockets`).
    """
    held = _gloo_sockets.connections(live['gloo'], env.rank) if env.backend == 'gloo' else []
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass
    if held and _gloo_sockets.connections(live['gloo'], env.rank):
        _gloo_sockets.shut_down(live['gloo'], env.rank)


def stop_watchdog():
    """Stop this rank's heartbeat now; one still inside a store call is joined at exit."""
    watchdog, live['watchdog'] = live['watchdog'], None
    if watchdog is not None:
        watchdog.stop(wait=0)
        # a store call to a frozen or cut-off master would block its thread, and this process's exit
        # (see _tear_down_at_exit), for the client's whole timeout: make it fail now
        _gloo_sockets.shut_down_connections(live['client'] or [])
        live['client'] = None
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
    left up, which joins gloo's threads (once nothing else holds the group: see
    :func:`import_torch_nn_first`), and wait for every stopped heartbeat.
    """
    if current_env() is not None or live['watchdog'] is not None:
        leave(wait=False)  # no wait for the peers: an uncaught error may be on its way out
        destroy()
    while _stopped:
        _stopped.pop().join()


def leave(wait=True):
    """A clean end of this rank: mark it left, and on rank 0 wait for the others (see
    :func:`~torchbearer_dist.runtime.group.destroy_process_group`).

    Returns:
        Cause or None: why the wait ended early, a peer's failure or silence
    """
    env, store, watchdog = current_env(), current_store(), live['watchdog']
    if env is None or watchdog is None or env.world_size == 1 or live['cause'] is not None:
        return None
    try:
        store.set_timeout(timedelta(seconds=1))  # a frozen master would hold this rank for the whole timeout
        store.add('hb/{}'.format(env.rank), LEFT)
    except Exception:  # the store is gone or frozen: nobody is left to wait for
        return None
    keys = ['hb/{}'.format(r) for r in range(1, env.world_size)]
    while wait and env.rank == 0 and live['cause'] is None and watchdog.running():
        try:  # rank 0 holds the store: reading it from here is quick
            if all(int(value) >= LEFT for value in store.multi_get(keys)):
                break
        except Exception:
            break
        time.sleep(0.05)
    return live['cause']


def destroy():
    """Tear the group down as far as torch allows and forget it; safe twice, or after a failure."""
    stop_watchdog()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down as far as torch allows
            pass
    live.update(gloo=None, cause=None, store=None)
    _peers.forget()
    set_current()
