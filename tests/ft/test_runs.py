"""Every run() of a Trial in the fault-tolerant mode joins the replicas, not only its first.

torchbearer leaves the last pass's loader in the Trial's state, which is how the mode tells evaluate() and
predict() (no quorum) from run(): before, a second run() was taken for one of them and trained alone, every
replica its own model, at exit 0.
"""
import pytest

from _dist import STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import train_together  # noqa: E402


@pytest.mark.timeout(180)
def test_a_second_run_trains_with_the_replicas_to_the_same_weights(tmp_path):
    args = ('--epochs', '1', '--then-epochs', '2', '--samples', '400')
    replicas = train_together(tmp_path, [args, args], STARTUP + 120)
    assert replicas.done(0)[0] == replicas.done(1)[0], replicas.describe()  # bit-identical after both runs
    assert replicas.done(0)[3] == replicas.done(1)[3], replicas.describe()  # the same global metrics
    for i in range(2):
        assert 'EPOCHS 2 RESTARTS 0' in replicas.out(i), replicas.describe()
        assert replicas.steps(i) == 2 * 20, replicas.describe()  # 20 steps an epoch, two epochs in all
