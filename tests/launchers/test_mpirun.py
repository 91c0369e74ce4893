"""The example under OpenMPI's mpirun: two ranks on loopback, the rank read from OMPI_COMM_WORLD_*."""
import os
import re
import shutil

import pytest
import torch

from torchbearer_dist.runtime.launcher import free_port

from _dist import ROOT, child_env, python, run_command

MPIRUN = shutil.which('mpirun')
EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
#: Seconds one run of the example may take on a busy 2-core machine.
RUN_TIMEOUT = 150
EPOCH_LINE = re.compile(r'^epoch (\d+)/(\d+): loss ([\d.]+) acc ([\d.]+) val_loss ([\d.]+) val_acc ([\d.]+)$', re.M)


def example(*args):
    return python(EXAMPLE, '--download', 'never', *args)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MPIRUN is None, reason='mpirun is not installed (Debian: apt-get install -y '
                                                        'openmpi-bin)')]


def _mpirun_env():
    env = child_env()
    # OpenMPI refuses root without these; CI runs as root. Harmless for other users.
    env.update(OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1')
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'SLURM_PROCID', 'SLURM_NTASKS'):
        env.pop(name, None)
    return env


def test_mpirun_two_ranks_print_metrics_once_and_match_the_one_command_run(tmp_path):
    port = free_port()
    (tmp_path / 'mpi').mkdir()
    (tmp_path / 'one').mkdir()
    args = ('--epochs', '1', '--threads', '1')
    # --oversubscribe: two ranks also on a machine with one core; the example is started as the README says.
    command = [MPIRUN, '--oversubscribe', '-np', '2', *example('--host', '127.0.0.1', '--port', str(port), *args)]
    result = run_command(command, timeout=RUN_TIMEOUT, env=_mpirun_env(), cwd=str(tmp_path / 'mpi'))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert EXAMPLE in command
    epochs = EPOCH_LINE.findall(result.stdout)
    assert len(epochs) == 1, result.stdout  # printed once, by rank 0, not once per rank
    assert result.stdout.count('saved the model to') == 1

    reference = run_command(example(*args), timeout=RUN_TIMEOUT, cwd=str(tmp_path / 'one'))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert epochs == EPOCH_LINE.findall(reference.stdout)  # the same global metrics as the one-command run
    got, expected = torch.load(tmp_path / 'mpi' / 'mnist_mlp.pt'), torch.load(tmp_path / 'one' / 'mnist_mlp.pt')
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert 'Traceback' not in result.stderr
