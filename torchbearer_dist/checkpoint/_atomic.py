"""Files replaced atomically on a filesystem that several hosts may share.

A file is written to a temporary in the same directory, flushed, fsynced and renamed over the old
one, so a crash at any point leaves either the previous file or the new one, never a torn one. The
temporary is named for the host and the process that writes it, so that a later writer can tell a
dead writer's leftover from a live writer's work even when the directory is shared (NFS, Lustre).
"""
import os
import socket

import torch


def _started(pid):
    """The start time of process ``pid`` (clock ticks since boot), or None if there is no such process."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().rsplit(')', 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _host():
    """This machine: its host name and boot id (containers may share a host name, never a kernel's boot id)."""
    try:
        with open('/proc/sys/kernel/random/boot_id') as f:
            boot = f.read().strip().replace('-', '')[:12]
    except OSError:
        boot = 'noboot'
    return '{}-{}'.format(socket.gethostname(), boot)


def _temporary(path):
    """``PATH.tmp.HOST-BOOT.PID.START``: a name that says which process on which machine writes it."""
    return '{}.tmp.{}.{}.{}'.format(path, _host(), os.getpid(), _started('self') or 0)


def remove_stale_temporaries(path):
    """Remove temporaries of ``path`` left by dead writers on this host.

    The directory may be shared by several hosts (NFS, Lustre), where a local process id says nothing
    about a file written elsewhere: only temporaries named for this machine (host name and boot id) are
    judged, and their writer counts as dead only if no process has that id or the one that has it
    started at another time (the id was reused). Temporaries of other machines are left alone.
    """
    directory, name = os.path.split(os.path.abspath(path))
    prefix = '{}.tmp.{}.'.format(name, _host())
    for entry in os.listdir(directory):
        pid, _, started = entry[len(prefix):].partition('.')
        if not entry.startswith(prefix) or not pid.isdigit() or not started.isdigit():
            continue
        if _started(pid) != started:
            try:
                os.remove(os.path.join(directory, entry))
            except OSError:
                pass


def write(payload, path):
    """Write ``payload`` to ``path`` atomically: temporary file, fsync, rename, fsync of the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = _temporary(path)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, 'wb') as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def keep_previous(path, keep):
    """Before ``path`` is replaced, keep its last ``keep - 1`` versions as ``path.1`` (newest) ... ``path.{keep-1}``.

    Each step is atomic and ``path`` itself is never missing: older copies move up by rename, and
    ``path.1`` becomes a hard link to the current file (a copy where links are not supported), whose
    directory entry the next :func:`write` then replaces.
    """
    if keep <= 1 or not os.path.isfile(path):
        return
    for i in range(keep - 2, 0, -1):
        older = '{}.{}'.format(path, i)
        if os.path.isfile(older):
            os.replace(older, '{}.{}'.format(path, i + 1))
    remove_stale_temporaries(path + '.1')
    temporary = _temporary(path + '.1')
    try:
        os.link(path, temporary)
    except OSError:
        import shutil
        shutil.copyfile(path, temporary)
    os.replace(temporary, path + '.1')
