"""Two real hosts (issue 3, part 3): rank 0 and rank 1 of the example in two network namespaces.

The namespaces are joined by a veth pair; each has its own address in a private /24 that exists only
inside them. The hostname resolves to 127.0.0.1 in both, so gloo would pick loopback and fail; the
package must pick the interface that routes to the master by itself: GLOO_SOCKET_IFNAME stays unset.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from _dist import ROOT, child_env, kill_session
from _netns import TwoHosts

EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')

# The example saves the model on rank 0 only; here every rank saves its own copy, to compare them.
RUN_EXAMPLE = ("import os, runpy, sys, torchbearer_dist; torchbearer_dist.is_main_process = lambda: True; "
               "sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
               "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture
def hosts():
    with TwoHosts() as two:
        yield two


def _env():
    env = child_env(TORCH_CPP_LOG_LEVEL='ERROR')
    for name in ('GLOO_SOCKET_IFNAME', 'MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        env.pop(name, None)
    return env


@pytest.mark.slow
@pytest.mark.netns
def test_example_on_two_hosts_ends_with_identical_parameters(hosts, tmp_path):
    saves = [str(tmp_path / 'rank{}.pt'.format(rank)) for rank in range(2)]
    processes = []
    try:
        for rank in range(2):
            argv = [sys.executable, '-c', RUN_EXAMPLE, EXAMPLE, '--world-size', '2', '--rank', str(rank),
                    '--host', hosts.address(0), '--port', '29500', '--timeout', '30', '--epochs', '1',
                    '--batch-size', '64', '--download', 'never', '--data', str(tmp_path / 'data'),
                    '--save', saves[rank]]
            processes.append(subprocess.Popen(hosts.command(rank, argv), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, start_new_session=True, env=_env(),
                                              cwd=ROOT))
        deadline = time.monotonic() + 240
        outputs = [process.communicate(timeout=max(1, deadline - time.monotonic())) for process in processes]
    finally:
        for process in processes:
            kill_session(process.pid)
            process.wait()
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, 'rank failed: {}\n{}'.format(out, err)
    assert 'epoch 1/1' in outputs[0][0], outputs[0][0]
    first, second = (torch.load(path, weights_only=True) for path in saves)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), 'rank 0 and rank 1 differ in {}'.format(name)
