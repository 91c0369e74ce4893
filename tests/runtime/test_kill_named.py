"""A rank of three SIGKILLed on another host is named (issue 34, "a kill not named").

Two network-namespace hosts: rank 0 on the first, ranks 1 and 2 on the second; each rank also runs in a pid
namespace of its own (``unshare --pid``), as on machines of their own: no rank sees another's process, so the
process table cannot tell who died. gloo's "Connection closed by peer" names no rank in a job of three, and
the survivors used to say only "a peer rank closed its connection ...". Rank 0 reads every rank's beat and
names the one whose beat stopped; rank 2 reports rank 0's cause.
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from _dist import LOAD_SLACK, ROOT, child_env, children
from _fault_rank import HERE, RENDEZVOUS_TIMEOUT, TIMEOUT
from _faults import BEAT, _error_lines, _kill_all, _wait_all, _wait_for_line
from _netns import TwoHosts

UNSHARE = shutil.which('unshare')
#: Rank 0 names the rank Timing.named after its failure (three beats and a second); rank 2's heartbeat reads
#: that cause within two beats and a second: from the kill, on a loaded machine.
BOUND = (3 * BEAT + 1) + (2 * BEAT + 1) + LOAD_SLACK


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(UNSHARE is None, reason='needs unshare (util-linux) for a pid namespace per rank')
def test_a_rank_of_three_killed_on_another_host_is_named_by_the_survivors():
    with TwoHosts() as hosts:
        env = child_env(TORCH_CPP_LOG_LEVEL='FATAL')
        env.pop('GLOO_SOCKET_IFNAME', None)
        ranks = []
        try:
            for rank, host in enumerate([0, 1, 1]):
                command = hosts.command(host, [
                    UNSHARE, '--pid', '--fork', '--mount-proc', '--kill-child', sys.executable, HERE, '--rank',
                    str(rank), '--world-size', '3', '--host', hosts.address(0), '--port', '29500', '--timeout',
                    str(TIMEOUT), '--rendezvous-timeout', str(RENDEZVOUS_TIMEOUT), '--epochs', '50',
                    '--step-delay', '0.02'])
                ranks.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              start_new_session=True, env=env, cwd=ROOT))
            for process in ranks:
                _wait_for_line(process, 'ready', timeout=90)
            victim = children(ranks[1].pid)  # unshare's child: the rank itself, killed as the OOM killer would
            assert len(victim) == 1, victim
            os.kill(victim[0], signal.SIGKILL)
            said = {}
            elapsed, results = _wait_all(ranks, BOUND + 20, said)
            print('rank 1 killed: errors after {} s, all ended in {:.2f} s'.format(
                ['{:.2f}'.format(said.get(p, float('nan'))) for p in ranks], elapsed))
            assert results[1][0] != 0, results[1]  # unshare's status for its killed child
            for rank in (0, 2):
                rc, err = results[rank]
                assert rc == 1, err
                assert _error_lines(err) == [
                    'error: rank 1 closed its connection without reporting an error: it exited or was killed; see '
                    'its log (rank {} stopped)'.format(rank)], err
            assert max(said[ranks[0]], said[ranks[2]]) < BOUND
        finally:
            _kill_all(ranks)
