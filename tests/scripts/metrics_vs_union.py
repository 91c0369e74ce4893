"""Print each epoch figure of 2 ranks against its reference: the per-sample value over the union, computed directly.

Runs with whichever torchbearer_dist comes first on PYTHONPATH, so the same numbers can be taken on main::

    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/callbacks python tests/scripts/metrics_vs_union.py
    PYTHONPATH=/work/main:$PWD/tests:$PWD/tests/callbacks python tests/scripts/metrics_vs_union.py
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchbearer_dist
import torchbearer_dist.callbacks.metrics as _metrics

_metrics.batch_size = getattr(_metrics, 'batch_size', getattr(_metrics, '_batch_size', None))  # older versions
import test_metrics as t  # noqa: E402

from _dist import run_workers  # noqa: E402


def _worker():
    import torchbearer
    torch.set_num_threads(1)
    return t._padded_trial().evaluate(data_key=torchbearer.VALIDATION_DATA), t._evaluate_structured()


if __name__ == '__main__':
    padded, structured = run_workers(_worker, 2)[0]
    x, y = t._data(t.VAL, 2)
    direct = t._direct(x, y)
    with torch.no_grad():
        means = [nn.functional.cross_entropy(t._model()(a), b).item() for a, b in
                 DataLoader(TensorDataset(x, y), batch_size=2 * t.B)]
    print(torchbearer_dist.__file__)
    print('{} samples, batch {}, 2 ranks; one process at {} (mean of batch means) val_loss {:.6f}'.format(
        t.VAL, t.B, 2 * t.B, sum(means) / len(means)))
    for name, value in direct.items():
        print('val_{:14s} reported {:.6f}  per-sample {:.6f}  |diff| {:.1e}'.format(
            name, padded['val_' + name], value, abs(padded['val_' + name] - value)))
    sx, sy = t._data(t.VAL, 5)
    reference = t._direct(sx, sy)['loss']
    print('dict/list batches: val_loss {:.6f}  per-sample {:.6f}  |diff| {:.1e}'.format(
        structured['val_loss'], reference, abs(structured['val_loss'] - reference)))
