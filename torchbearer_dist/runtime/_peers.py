"""Where the other ranks run, and whether a peer of this machine has died.

Each rank publishes an identity at the handshake: host name, boot id, pid namespace, pid and start time. A
peer is "of this machine" when boot id and pid namespace match ours, and dead when its pid is gone, a zombie,
or a process started at another time (reused): one ``/proc/<pid>/stat`` read per local peer.
"""
import os
import socket

from torchbearer_dist.runtime._timing import Timing


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ''


def stat(pid):
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` the state, ``[11]`` and ``[12]`` the CPU
    ticks used, ``[19]`` the start time in ticks), or None when there is no such process."""
    text = _read('/proc/{}/stat'.format(pid))
    return text.rsplit(')', 1)[1].split() if text else None


def _namespace():
    try:
        return os.readlink('/proc/self/ns/pid')
    except OSError:
        return ''


def identity():
    """This process's identity as published to the peers: ``host boot pidns pid start``, five space-free fields."""
    fields = stat(os.getpid())
    return ' '.join([socket.gethostname() or '-', _read('/proc/sys/kernel/random/boot_id') or '-',
                     _namespace().replace(' ', '') or '-', str(os.getpid()), fields[19] if fields else '-'])


def local_peers(store, rank, world_size):
    """``{rank: (pid, start time)}`` of every other rank of this machine (whose pid means the same process
    here), read once from the job's ``store`` after the handshake."""
    peers, mine = {}, identity().split()
    for other in range(world_size):
        if other == rank:
            continue
        try:
            host, boot, namespace, pid, start = store.get('addr/{}'.format(other)).decode().split()
        except Exception:  # not essential: a death is then reported with less detail
            continue
        if boot != '-' and (boot, namespace) == (mine[1], mine[2]):
            peers[other] = (int(pid), start)
    return peers


def dead_local_ranks(peers):
    """Ranks of this machine, ascending, whose process is gone (or a zombie; pid reuse is told by start time),
    of ``peers`` (what :func:`local_peers` returned)."""
    return [other for other, (pid, start) in sorted(peers.items())
            if (now := stat(pid)) is None or now[0] in ('Z', 'X') or now[19] != start]


def probe(host, port):
    """``'ok'``, ``'refused'`` or ``'silent'``: whether the master's store still accepts connections."""
    try:
        with socket.create_connection((host, port), timeout=Timing.PROBE):
            return 'ok'
    except ConnectionRefusedError:
        return 'refused'
    except OSError:
        return 'silent'
