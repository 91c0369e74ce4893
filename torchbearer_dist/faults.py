"""When a rank fails: tell the others who failed and why, and never hang on Ctrl-C.

gloo reports a dead peer as "Connection reset by peer" or "Connection closed by peer", and a
silent one as "Timed out waiting ...", never naming the rank or its error. Here a failing rank
writes ``rank R failed: Type: message`` to the rendezvous store, then closes its gloo connections
so that the others' collectives break at once rather than at the timeout; they read the line back,
so every rank ends with the same root cause. A peer that died without a word is found by its pid
when it ran on this machine, and a silent one is named after the timeout.
"""
import os
import signal
import socket
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


def publish(store, env, error, cause=None):
    """Record this rank's failure in the store, unless another rank's failure is already there.

    Rank 0 hosts the store: after publishing it waits briefly (at most 3 s) until every other live
    rank has read the cause, so that they can report it.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job
        error (BaseException): what ended this rank
        cause (str): the root cause found by :func:`diagnose`, published instead of ``error`` so that
            the remaining ranks read it at once
    """
    if store is None or env is None or env.world_size == 1:
        return
    line = cause if cause is not None else 'rank {} failed: {}'.format(env.rank, describe(error))
    if env.rank != 0 and _probe(env.host, env.port) != 'ok':  # the store died with rank 0: nothing to tell
        break_collectives()
        return
    try:
        store.set_timeout(_SHORT)
        store.compare_set('error', '', line)
    except Exception:
        pass
    break_collectives()  # after publishing: the peers whose collectives break read the cause at once
    if env.rank == 0:
        deadline = time.monotonic() + (3 if cause is None else 1)
        while time.monotonic() < deadline:
            try:
                if store.add('error_seen', 0) >= env.world_size - 1 - len(_dead_local_ranks()):
                    return
            except Exception:
                return
            time.sleep(0.05)


def open_sockets():
    """This process's sockets, to tell later which ones a call opened (Linux; empty elsewhere).

    Returns:
        dict: ``{file descriptor: socket inode}``
    """
    found = {}
    try:
        fds = os.listdir('/proc/self/fd')
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink('/proc/self/fd/{}'.format(fd))
        except OSError:
            continue
        if target.startswith('socket:['):
            found[int(fd)] = target[len('socket:['):-1]
    return found


_group_sockets = {}


def note_group_sockets(before):
    """Remember the sockets that the default process group opened, to close them on failure.

    Args:
        before (dict): what :func:`open_sockets` returned just before ``init_process_group``
    """
    _group_sockets.clear()
    _group_sockets.update({fd: inode for fd, inode in open_sockets().items() if before.get(fd) != inode})


def forget_group():
    """Drop what :func:`remember_peers` and :func:`note_group_sockets` noted, when the group is torn down."""
    _group_sockets.clear()
    _peers.clear()


def break_collectives():
    """Close this rank's connections of the default process group, so that peers waiting on it fail now.

    ``destroy_process_group`` alone leaves gloo's sockets open while anything still holds the group
    (a pending gradient all-reduce referenced from the traceback), and peers would wait out the
    timeout. The store's connections stay open, so that the peers can read the cause.
    """
    sockets, now = dict(_group_sockets), open_sockets()
    _group_sockets.clear()
    for fd, inode in sockets.items():
        if now.get(fd) != inode:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # gloo aborts if its listener breaks
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def remember_peers(store, env):
    """Note where every rank runs (host name and pid), to tell later which local peers died.

    Called once after the handshake, while the store is sure to answer.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job
    """
    peers = {}
    for other in range(env.world_size):
        if other != env.rank:
            try:
                name, pid = store.get('addr/{}'.format(other)).decode().split()
                peers[other] = (name, int(pid))
            except Exception:  # not essential: diagnose says less
                pass
    _peers.clear()
    _peers.update(peers)


_peers = {}


def _is_dead(pid):
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().rsplit(')', 1)[1].split()[0] in ('Z', 'X')  # an unreaped zombie is dead too
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _dead_local_ranks():
    host = os.uname().nodename
    return [other for other, (name, pid) in sorted(_peers.items()) if name == host and _is_dead(pid)]


def _read_cause(store, wait, deaths=True):
    """Poll the store for ``wait`` s: the published cause, or (with ``deaths``) a line about local peers
    that died without one.

    Returns None when neither appears; raises when the store itself is gone.
    """
    store.set_timeout(_SHORT)
    deadline = time.monotonic() + wait
    while True:
        dead = _dead_local_ranks() if deaths else []
        if store.check(['error']):
            cause = store.get('error').decode()
            store.add('error_seen', 1)
            return cause
        if dead:  # checked before the error key: a rank publishes before it exits
            return ('rank {} died without reporting an error: it was killed (by the OOM killer, or a signal) or '
                    'crashed in native code; see its log and dmesg'.format(', '.join(map(str, dead))))
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _probe(host, port):
    """``'ok'``, ``'refused'`` or ``'silent'``: whether the master's store still accepts connections."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return 'ok'
    except ConnectionRefusedError:
        return 'refused'
    except OSError:
        return 'silent'


def _master_gone(env):
    return ('rank 0 (the master at {}) is gone: its process died or its host became unreachable; see rank 0\'s '
            'log for its error'.format(env.address))


def diagnose(store, env, error):
    """Explain a broken collective by what happened on the other ranks.

    Waits at most about 3 s for a cause published by the failed rank.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job
        error (BaseException): what this rank caught

    Returns:
        str or None: one line naming the failed rank and its error (the root cause), or None when
        ``error`` is this rank's own failure and should propagate unchanged
    """
    if store is None or env is None or env.world_size == 1 or not is_communication_error(error):
        return None
    timed_out = 'timed out' in str(error).lower() or 'timeout' in str(error).lower()
    master = 'ok' if env.rank == 0 else _probe(env.host, env.port)
    if master == 'refused':
        return _master_gone(env)
    if master == 'ok':
        try:
            # After a timeout the peer was silent for that long: whatever it did since is no cause.
            cause = _read_cause(store, 1.0 if timed_out else 3.0, deaths=not timed_out)
            if cause is not None:
                return cause
        except Exception:  # the store stopped answering
            if env.rank != 0 and not timed_out:  # it lives in rank 0, whose sockets were closing
                return _master_gone(env)
    others = [r for r in range(env.world_size) if r != env.rank]
    who = 'rank {}'.format(others[0]) if len(others) == 1 else 'a peer rank'
    if timed_out:
        return ('no answer from {} for {:g} s: its host is down, the network is partitioned, or it is stuck '
                'outside the training loop; check that host, or raise timeout= if a step can take that '
                'long'.format(who, env.timeout.total_seconds()))
    text = str(error).lower()
    if not ('gloo' in text or 'connection' in text or isinstance(error, getattr(dist, 'DistError', ()))):
        return None  # this rank's own error, which only looked like a network one
    return '{} closed its connection without reporting an error: it exited or was killed; see its log'.format(who)


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
                # Breaking the collectives below makes the main thread raise too; its traceback is noise.
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
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
