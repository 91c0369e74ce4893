"""The fault-tolerant mode on a GPU (issue 43, item 3): replicas whose Trial trains on CUDA, one killed and healed.

Three replicas of tests/ft/_replica.py train on ``cuda:0`` (all on the one GPU a lent machine has): their gradient
buckets live in device memory and torchft's gloo group carries them from there. Replica 1 is killed with SIGKILL
and started again: it heals a CUDA model from the others (torchft's HTTP transport sends the CUDA tensors, our heal
loads them into its model and optimizer) and the three end with the same weights, bit for bit, and the same
metrics (:func:`_replicas.kill_one_and_heal`).

Marked ``gpu``: it skips without CUDA, saying so (``TORCHBEARER_DIST_TEST_GPU=1`` makes that skip a failure, see
conftest.py); ``benchmarks/gpu_session.sh`` runs it on a lent machine. ``TORCHBEARER_DIST_TEST_DEVICE=cpu`` runs
the same body on the CPU (marked ``slow`` then), to check it without a GPU, as tests/e2e/test_gpu.py does.
"""
import pytest

from _dist import LOAD_SLACK, ON_GPU, ONE_DEVICE

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import kill_one_and_heal  # noqa: E402

#: torchft's bounds on a lost replica (test_fault_tolerant.py's): the heartbeat timeout and a collective's.
LOST_BOUND = 2 + 10


@pytest.mark.timeout(300)
@pytest.mark.parametrize('device', [pytest.param('cuda:0' if ON_GPU else 'cpu', marks=ONE_DEVICE)])
def test_replicas_on_the_gpu_heal_a_killed_one_and_end_bit_identical(replicas, device):
    stall = kill_one_and_heal(replicas, LOST_BOUND + LOAD_SLACK, '--device', device)
    print('on {}: the survivors went on {:.1f} s after the kill'.format(device, stall))
