"""A fault ends in one line that names it, and never in an abort of the package's own making (issue 17).

Library use: ranks run a user's own script (``process_group`` or ``init_process_group``, no
handler of ours), started by hand, each in its own session, killed by pgid at the end.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, child_env, free_port, kill_session

#: A user's script: rank 1 raises its own error inside the block.
USER_SCRIPT = """
import sys
import torch, torch.distributed as dist
import torchbearer_dist
torchbearer_dist.quiet_peer_failures()  # the one-line form of an uncaught PeerFailedError: opt-in
rank, port = int(sys.argv[1]), int(sys.argv[2])
with torchbearer_dist.process_group(rank=rank, world_size=2, host='127.0.0.1', port=port, timeout=60,
                                    rendezvous_timeout=5):
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        raise ValueError('boom on rank 1')
    dist.all_reduce(torch.ones(1))
"""
#: Rank 1 of a job whose master never comes: it stays inside TCPStore's constructor.
CONNECTING_SCRIPT = """
import sys
import torchbearer_dist
print('connecting', flush=True)
torchbearer_dist.init_process_group(rank=1, world_size=2, host='127.0.0.1', port=int(sys.argv[1]),
                                    rendezvous_timeout=30)
"""


def _run_pair(script, extra_env):
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=child_env(TORCH_CPP_LOG_LEVEL='FATAL', **extra_env)) for r in range(2)]
    try:
        return [p.communicate(timeout=STARTUP + 30) + (p.returncode,) for p in ranks]
    finally:
        for p in ranks:
            kill_session(p.pid)


@pytest.mark.slow
@pytest.mark.parametrize('full', [False, True], ids=['one-line', 'TORCHBEARER_DIST_TRACEBACK=1'])
def test_peer_failure_in_a_users_script_prints_one_line_and_the_users_error_propagates(tmp_path, full):
    script = tmp_path / 'user.py'
    script.write_text(USER_SCRIPT)
    (_, err0, rc0), (_, err1, rc1) = _run_pair(script, {'TORCHBEARER_DIST_TRACEBACK': '1'} if full else {})
    # rank 1's own error reaches Python's hook untouched: its whole traceback
    assert rc1 == 1 and 'Traceback' in err1 and err1.strip().endswith('ValueError: boom on rank 1'), err1
    assert rc0 == 1, err0
    line = 'PeerFailedError: rank 1 failed: ValueError: boom on rank 1 (rank 0 stopped)'
    if full:
        assert 'Traceback' in err0 and err0.strip().splitlines()[-1].endswith(line), err0
    else:
        assert err0.strip().splitlines() == [line + ' (set TORCHBEARER_DIST_TRACEBACK=1 for the traceback)'], err0


@pytest.mark.slow
def test_ctrl_c_while_connecting_exits_as_python_does_never_an_abort(tmp_path):
    """Ctrl-C while the master is not up yet: no torch thread is left inside TCPStore's constructor to abort
    the process (-6) at exit, and the exit status is Python's own for an uncaught KeyboardInterrupt (killed
    by SIGINT, which a shell shows as 130), not one an exit handler of the package chose."""
    script = tmp_path / 'connecting.py'
    script.write_text(CONNECTING_SCRIPT)
    for _ in range(3):
        process = subprocess.Popen([sys.executable, str(script), str(free_port())], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True,
                                   env=child_env(TORCH_CPP_LOG_LEVEL='FATAL'))
        try:
            assert process.stdout.readline() == 'connecting\n'
            time.sleep(1.0)  # retrying the connection
            started = time.monotonic()
            os.kill(process.pid, signal.SIGINT)
            _, err = process.communicate(timeout=20)
            elapsed = time.monotonic() - started
        finally:
            kill_session(process.pid)
        assert process.returncode == -signal.SIGINT, (process.returncode, err)
        assert 'terminate called' not in err and 'KeyboardInterrupt' in err, err
        # KeyboardInterrupt within one retry (0.1 s apart), then the interpreter's exit; never the rendezvous
        # timeout (30 s) of the retries
        assert elapsed < 1 + LOAD_SLACK < 30, elapsed
