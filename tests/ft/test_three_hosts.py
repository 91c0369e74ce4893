"""The fault-tolerant mode on three network-namespace hosts (benchmarks/netns.py): kill -9 of one, the others go on,
the restarted one heals bit-identical. The lighthouse runs on host 0, replica i on host i."""
import os
import subprocess
import sys

import pytest

from _dist import LOAD_SLACK, ROOT, child_env, kill_session, python

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import netns  # noqa: E402
from _replicas import Replicas, kill_one_and_heal  # noqa: E402

#: As on loopback (test_fault_tolerant.LOST_BOUND): heartbeat 2 s, a collective's 10 s.
LOST_BOUND = 2 + 10


@pytest.fixture
def hosts():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Hosts(3) as made:
        yield made


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(360)
def test_kill_one_of_three_hosts_the_others_go_on_and_it_heals_bit_identical(hosts, tmp_path):
    server = subprocess.Popen(hosts.command(0, python('-m', 'torchbearer_dist.ft', '--bind', '0.0.0.0:29510',
                                                      '--join-timeout', '15', '--heartbeat-timeout', '2')),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                              env=child_env(RUST_LOG='warn'))
    replicas = Replicas(tmp_path, '{}:29510'.format(hosts.address(0)), hosts=hosts)
    try:
        assert server.stdout.readline().startswith('lighthouse at ')  # it listens
        stall = kill_one_and_heal(replicas, LOST_BOUND + LOAD_SLACK)
        print('survivors went on {:.1f} s after the kill'.format(stall))
    finally:
        replicas.kill_all()
        kill_session(server.pid)
        server.wait()
