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
from _replicas import train_together  # noqa: E402


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
@pytest.mark.parametrize('test_samples', [300])
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
