"""When a rank fails: tell the others who failed and why, and never hang on Ctrl-C.

gloo reports a dead peer as "Connection reset by peer" or "Connection closed by peer", and a
silent one as "Timed out waiting ...", never naming the rank or its error. Here a failing rank
writes ``rank R failed: Type: message`` to the rendezvous store before it exits, and the others
read it back when their collective breaks, so every rank ends with the same root cause.
"""
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_SHORT = timedelta(seconds=2)
_COMM_MARKERS = ('connection reset', 'connection closed', 'connection refused', 'timed out', 'timeout',
                 'broken pipe', 'connectfullmesh', 'socket', 'closed by peer', 'read error', 'write error',
                 'nccl', 'aborted', 'rank that exhausted', 'not connected')


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank failed first; the message names that rank and its error."""


def describe(error):
    """One line for an exception: ``Type: first line of its message``.

    Args:
        error (BaseException): the exception

    Returns:
        str: e.g. ``'ValueError: bad batch'``
    """
    text = str(error).strip().splitlines()
    return '{}: {}'.format(type(error).__name__, text[0]) if text else type(error).__name__


def is_communication_error(error):
    """Whether ``error`` looks like a broken or timed-out collective rather than the rank's own bug."""
    if isinstance(error, PeerFailedError):
        return False
    if isinstance(error, getattr(dist, 'DistError', ())):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _COMM_MARKERS)


def publish(store, env, error):
    """Record this rank's failure in the store, unless another rank's failure is already there.

    Rank 0 hosts the store: after publishing it waits briefly (at most 3 s) until every other rank has
    read the cause, so that they can report it.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job
        error (BaseException): what ended this rank
    """
    if store is None or env is None or env.world_size == 1:
        return
    line = 'rank {} failed: {}'.format(env.rank, describe(error))
    try:
        store.set_timeout(_SHORT)
        store.compare_set('error', '', line)
    except Exception:  # the store died with rank 0: nothing to tell
        return
    if env.rank == 0:
        if dist.is_initialized():  # break the peers' pending collectives so they look now
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                if store.add('error_seen', 0) >= env.world_size - 1:
                    return
            except Exception:
                return
            time.sleep(0.05)


def _dead_local_ranks(store, env):
    host = os.uname().nodename
    dead = []
    for other in range(env.world_size):
        if other == env.rank:
            continue
        try:
            name, pid = store.get('addr/{}'.format(other)).decode().split()
        except Exception:
            continue
        if name != host:
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            dead.append(other)
        except PermissionError:
            pass
    return dead


def diagnose(store, env, error):
    """Explain a broken collective by what happened on the other ranks.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job
        error (BaseException): what this rank caught

    Returns:
        str or None: one line naming the failed rank and its error, or None when ``error`` is this
        rank's own failure and should propagate unchanged
    """
    if store is None or env is None or env.world_size == 1 or not is_communication_error(error):
        return None
    me = 'rank {} stopped'.format(env.rank)
    timed_out = 'timed out' in str(error).lower() or 'timeout' in str(error).lower()
    try:
        store.set_timeout(timedelta(seconds=3))
        store.wait(['error'])
        cause = store.get('error').decode()
        store.add('error_seen', 1)
        return '{} ({})'.format(cause, me)
    except Exception as e:
        lost = 'timeout' not in str(e).lower() and 'timed out' not in str(e).lower()
        if env.rank != 0 and lost:
            return ('rank 0 (the master at {}) is gone: its process died or its host became unreachable '
                    '({})'.format(env.address, me))
    dead = _dead_local_ranks(store, env)
    if dead:
        return 'rank {} died without reporting an error (killed, or crashed in native code) ({})'.format(
            ', '.join(map(str, dead)), me)
    others = [r for r in range(env.world_size) if r != env.rank]
    who = 'rank {}'.format(others[0]) if len(others) == 1 else 'a peer rank'
    if timed_out:
        return ('no answer from {} for {:g} s: its host is down, the network is partitioned, or it is stuck '
                'outside the training loop ({})'.format(who, env.timeout.total_seconds(), me))
    return '{} closed its connection without reporting an error: it exited or was killed ({}): {}'.format(
        who, me, describe(error))


_watch = {'fd': None, 'previous': None}


def watch_interrupts(grace=2.0):
    """Make Ctrl-C work while the main thread is blocked inside a gloo collective.

    Python runs signal handlers only between bytecodes, so a rank waiting in a collective ignores
    SIGINT until the wait ends (up to the timeout). A helper thread sees the signal through
    :func:`signal.set_wakeup_fd`; if the main thread has not unwound ``grace`` seconds later, it
    publishes the interrupt and exits the process with status 130, which closes every socket.

    Args:
        grace (float): seconds the main thread gets to handle KeyboardInterrupt itself
    """
    if threading.current_thread() is not threading.main_thread() or _watch['fd'] is not None:
        return
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        return
    _watch.update(fd=(read_fd, write_fd), previous=previous)

    def wait_for_interrupt():
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                time.sleep(grace)
                if _watch['fd'] != (read_fd, write_fd):
                    return
                from torchbearer_dist import rendezvous
                env, store = rendezvous.current_env(), rendezvous.current_store()
                rank = '?' if env is None else env.rank
                sys.stderr.write('torchbearer_dist: rank {} interrupted inside a collective; exiting\n'.format(rank))
                sys.stderr.flush()
                try:
                    publish(store, env, KeyboardInterrupt('interrupted (SIGINT)'))
                finally:
                    os._exit(130)

    threading.Thread(target=wait_for_interrupt, name='torchbearer_dist-interrupt', daemon=True).start()


def unwatch_interrupts():
    """Undo :func:`watch_interrupts`."""
    if _watch['fd'] is None:
        return
    read_fd, write_fd = _watch['fd']
    _watch['fd'] = None
    try:
        signal.set_wakeup_fd(_watch['previous'] if _watch['previous'] is not None else -1)
    except ValueError:
        pass
    os.close(write_fd)
    os.close(read_fd)
