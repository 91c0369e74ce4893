"""evaluate() and predict() after run() in the fault-tolerant mode: over the live replicas, as in the fail-fast mode.

Each replica evaluates and predicts its shard of a test set; the figures are reduced and the predictions gathered
over the quorum of the replicas that call them (no heal: each holds the weights its run ended with), so every
replica reports what one process evaluating the whole set with those weights reports.
"""
import pytest
import torch

from _dist import STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

import _replica  # noqa: E402
from _replicas import Replicas, train_together  # noqa: E402


def _reference(final, test_samples, hidden=32):
    """What one process with ``final``'s weights reports on the whole test set: its loss, accuracy, predictions."""
    model = _replica.model(0, hidden)
    model.load_state_dict(final)
    x, y = _replica.dataset(test_samples, seed=1).tensors
    with torch.no_grad():
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y, reduction='sum').item() / len(y)
    return loss, (out.argmax(1) == y).double().mean().item(), out


@pytest.mark.timeout(240)
@pytest.mark.parametrize('test_samples', [301])  # a shard padded by the sampler: its repeat counts once
def test_evaluate_and_predict_after_run_cover_every_replicas_shard(tmp_path, test_samples):
    args = [('--epochs', '1', '--samples', '400', '--evaluate', str(test_samples), '--record', str(tmp_path / str(r)))
            for r in range(2)]
    replicas = train_together(tmp_path, args, STARTUP + 150)
    records = [torch.load(str(tmp_path / str(r)), weights_only=False) for r in range(2)]
    assert replicas.done(0)[0] == replicas.done(1)[0], replicas.describe()  # the same weights, bit for bit
    assert records[0]['evaluated'] == records[1]['evaluated'], replicas.describe()  # the same figures
    loss, acc, out = _reference(records[0]['final'], test_samples)
    figures = records[0]['evaluated']
    print('evaluated:', figures, 'one process on the whole set: loss {:.6f} acc {:.6f}'.format(loss, acc))
    assert figures['test_loss'] == pytest.approx(loss, rel=1e-5) and figures['test_acc'] == pytest.approx(acc, abs=1e-6)
    for record in records:  # every replica: the whole set's predictions, in dataset order, each sample once
        assert record['predictions'].shape == out.shape, record['predictions'].shape
        torch.testing.assert_close(record['predictions'], out, rtol=1e-5, atol=1e-6)
    assert torch.equal(records[0]['predictions'], records[1]['predictions'])


@pytest.mark.timeout(240)
def test_a_replica_that_evaluates_alone_waits_for_the_others_then_says_so(tmp_path):
    # Both train together; replica 1 then ends without evaluating. Replica 0 waits its timeout (10 s) for the
    # other replica that ended the run, then evaluates and predicts over itself, saying so in one line each.
    from torchbearer_dist.ft import Lighthouse
    test_samples = 300
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=2.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            common = ('--replicas', '2', '--epochs', '1', '--samples', '400', '--min-replicas', '2')
            replicas.start(0, *common, '--evaluate', str(test_samples), '--record', str(tmp_path / 'r0'))
            replicas.start(1, *common, '--record', str(tmp_path / 'r1'))  # the same callbacks as replica 0's
            replicas.wait_for(lambda: all(replicas.process(i).poll() is not None for i in range(2)), STARTUP + 120)
            assert [replicas.process(i).returncode for i in range(2)] == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    lines = [line for line in replicas.err(0).splitlines() if ' over 1 of the 2 ' in line]
    assert lines == ['torchbearer_dist: replica r0 {}s over 1 of the 2 replicas that ended the last run: the others '
                     'did not join within 10 s (lost, or not calling {}())'.format(what, what)
                     for what in ('evaluate', 'predict')], replicas.describe()
    record = torch.load(str(tmp_path / 'r0'), weights_only=False)
    _, _, out = _reference(record['final'], test_samples)
    y = _replica.dataset(test_samples, seed=1).tensors[1]
    shard = out[0::2]  # replica 0's shard (a DistributedSampler of 2, no shuffle): its own figures
    own_loss = torch.nn.functional.cross_entropy(shard, y[0::2]).item()
    assert record['evaluated']['test_loss'] == pytest.approx(own_loss, rel=1e-5), (record['evaluated'], own_loss)


@pytest.mark.timeout(240)
def test_evaluate_beside_a_replica_still_training_refuses_in_one_line(tmp_path):
    # Replica 0's run ends after one epoch, replica 1's goes on for two more: replica 0's evaluate() finds it in its
    # quorum, training, and stops in one line; replica 1 trains on to its end.
    from torchbearer_dist.ft import Lighthouse
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=2.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            common = ('--replicas', '2', '--samples', '400', '--sleep', '0.05')
            replicas.start(0, *common, '--epochs', '1', '--evaluate', '300', '--min-replicas', '2')
            # Replica 1 starts once replica 0 asks for its first quorum (waiting for two): the two train epoch 0
            # together. Started at once, a loaded machine let replica 1 train alone past replica 0's one epoch
            # before replica 0 joined, a run other than the one this test is about.
            replicas.wait_for(lambda: 'READY' in replicas.out(0), STARTUP + 60, starting=[0])
            replicas.start(1, *common, '--epochs', '3')  # it trains on alone once replica 0 leaves
            replicas.wait_for(lambda: all(replicas.process(i).poll() is not None for i in range(2)), STARTUP + 150)
        finally:
            replicas.kill_all()
    assert replicas.process(0).returncode == 1, replicas.describe()
    assert replicas.err(0).splitlines()[-1] == (
        "error: this replica cannot evaluate: replicas in its quorum are still training (their run() goes on); call "
        "it once every replica's run() has ended"), replicas.describe()
    assert replicas.process(1).returncode == 0 and 'EPOCHS 3' in replicas.out(1), replicas.describe()
