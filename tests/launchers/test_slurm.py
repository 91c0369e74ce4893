"""The example under a real SLURM: a one-node cluster on localhost (slurmctld + slurmd) runs ``srun -n 2``.

The cluster (tests/_slurm.py) lives in a temporary directory for the length of the test, with its own ports and
``auth/none``, so no munge daemon and nothing in /etc is needed. Where it cannot be started (no slurm-wlm, not
root, a daemon that refuses this machine), the test skips saying why.
"""
import os
import re

from torchbearer_dist.runtime.launcher import free_port

from _dist import ROOT, python, run_command
from _slurm import REQUIRES, SLURM, one_node

EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
#: Seconds one run of the example may take on a busy 2-core machine.
RUN_TIMEOUT = 150
EPOCH_LINE = re.compile(r'^epoch (\d+)/(\d+): loss ([\d.]+) acc ([\d.]+) val_loss ([\d.]+) val_acc ([\d.]+)$', re.M)

pytestmark = REQUIRES


def test_srun_two_tasks_print_metrics_once(tmp_path):
    with one_node(tmp_path) as cluster:
        cwd = tmp_path / 'run'
        cwd.mkdir()
        command = [SLURM['srun'], '-n', '2', '--overcommit', '--kill-on-bad-exit=1',
                   *python(EXAMPLE, '--download', 'never', '--host', '127.0.0.1', '--port', str(free_port()),
                           '--epochs', '1')]
        result = run_command(command, timeout=RUN_TIMEOUT, env=cluster.env, cwd=str(cwd))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(EPOCH_LINE.findall(result.stdout)) == 1, result.stdout  # once, by rank 0
    assert result.stdout.count('saved the model to') == 1
    assert (cwd / 'mnist_mlp.pt').is_file()
