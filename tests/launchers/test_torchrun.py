"""Ranks started by torchrun join through its environment and its agent's store."""
import os

import pytest
import torch

from _dist import ROOT, TORCHRUN, run_command

WORKER = os.path.join(ROOT, 'tests', 'scripts', 'torchrun_worker.py')

pytestmark = pytest.mark.slow


def _params(out, rank):
    return torch.load(os.path.join(out, 'rank{}.pt'.format(rank)), weights_only=True)


def _assert_identical_replicas(out):
    zero, one = _params(out, 0), _params(out, 1)
    assert zero.keys() == one.keys()
    for name in zero:
        assert torch.equal(zero[name], one[name]), name


def test_torchrun_ranks_train_identical_replicas(tmp_path):
    result = run_command([*TORCHRUN, '--nproc-per-node', '2', '--standalone', WORKER, str(tmp_path)], timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('source=torchrun') == 2
    _assert_identical_replicas(str(tmp_path))


def test_torchrun_restart_does_not_trip_over_the_previous_attempts_keys(tmp_path):
    """--max-restarts reuses the agent's store; a per-attempt key prefix keeps the new attempt clean."""
    result = run_command([*TORCHRUN, '--nproc-per-node', '2', '--standalone', '--max-restarts', '1', WORKER,
                          str(tmp_path), '--fail-first-attempt'], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'rank 1 failed: ValueError: rank 1 fails on the first attempt' in result.stderr
    _assert_identical_replicas(str(tmp_path))
