"""Canary: the c10d store key and gloo address layout that ``runtime/_live.py`` reads are still there.

Fails on the pinned torch if a torch upgrade moved them; the package then warns once at run time
(``_live.LOST``) that a silent peer ends a job only at the process group's timeout.
"""
import os
import shutil
import sys
import warnings

import pytest

from torchbearer_dist.runtime import _live

from _dist import run_command

_SCRIPT = r'''
import datetime, os, socket, struct, warnings
import torch.distributed as dist
from torchbearer_dist.runtime import _live
warnings.simplefilter('error')  # a LOST warning fails the run
probe = socket.socket(); probe.bind(('127.0.0.1', 0)); port = probe.getsockname()[1]; probe.close()
store = dist.TCPStore('127.0.0.1', port, 1, True, timeout=datetime.timedelta(seconds=20))
dist.init_process_group('gloo', store=store, rank=0, world_size=1)
raw = store.get('{}//cpu//0/0'.format(dist.group.WORLD.group_name))  # the key itself, before any parsing
found = _live.endpoints(store, dist.group.WORLD.group_name, 0, 1)
listening = [local for fd, inode, local, remote in _live._sockets() if remote is None]
print('KEY', len(raw), 'HOST', raw[8:8 + struct.unpack_from('<Q', raw)[0]], 'FOUND', found, 'LISTENING', listening,
      flush=True)
assert found is not None and found[0] in listening, (found, listening)
dist.destroy_process_group()
'''

_UNSHARE = shutil.which('unshare')


def _host_names():
    """The machine's own host name, and two more whose lengths put gloo's address at other offsets."""
    names = [pytest.param(None, id='own-host-name')]
    reason = None
    if _UNSHARE is None:
        reason = 'needs unshare (util-linux) to run under another host name'
    elif os.geteuid() != 0:
        reason = 'needs root to run under another host name (unshare --uts)'
    for name in ('node1', 'gpu-node-0017.cluster.example.org'):
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        names.append(pytest.param(name, id=name, marks=marks))
    return names


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='the fallback reads /proc/self/fd: Linux only')
@pytest.mark.parametrize('host_name', _host_names())
def test_gloo_publishes_its_listening_address_where_the_fallback_reads_it(host_name):
    # The address follows the host name, so its offset depends on the host name's length: an odd
    # length once hid it from a reader that assumed an even offset (srun on nodes named node1, node2).
    command = [sys.executable, '-c', _SCRIPT]
    if host_name is not None:
        command = [_UNSHARE, '--uts', 'sh', '-c', 'hostname "$0" && exec "$@"', host_name] + command
    done = run_command(command)  # a hang fails at the deadline; a loaded machine's slowness does not
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'FOUND [(' in done.stdout
    if host_name is not None:
        assert "HOST b'{}'".format(host_name) in done.stdout, done.stdout


def test_a_layout_not_found_warns_once_naming_the_lost_guarantee():
    class _NoKeys:
        def get(self, key):
            raise KeyError(key)

    import torch

    from torchbearer_dist import _once
    _once._given.discard(_live.LOST.format(torch.__version__))  # once per process: start afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert _live.endpoints(_NoKeys(), '0', 0, 2) is None
        assert _live.endpoints(_NoKeys(), '0', 1, 2) is None
    lost = [w for w in caught if 'wakes only at the process group' in str(w.message)]
    if sys.platform.startswith('linux'):
        assert len(lost) == 1 and issubclass(lost[0].category, RuntimeWarning)
    else:
        assert lost == []
