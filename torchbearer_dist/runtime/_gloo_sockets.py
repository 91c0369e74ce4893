"""The fallback that wakes ranks blocked in a gloo collective: shut down gloo's own connections.

No public torch call does this for gloo (``python benchmarks/peer_wakeup.py``, torch 2.14.1): after a peer's
``abort()``, ``shutdown()`` or ``destroy_process_group()`` (where a Work object still holds the group) a rank
blocked in an all_reduce waits the whole timeout, and no call from a helper thread wakes its main thread.

A socket of this process is gloo's exactly when its local address is this rank's gloo listening address, or
its remote address another rank's, as gloo publishes them in the store (:func:`published`); on any mismatch,
or off Linux, this does nothing. That layout is private to c10d and gloo: where it is not found,
:func:`endpoints` warns once (:data:`LOST`), and ``tests/runtime/test_private_gloo.py`` fails.
"""
import os
import socket
import struct
import sys

import torch

from torchbearer_dist._once import warn_once

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
