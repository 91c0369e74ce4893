"""Draw CommunicationReport's figures across epochs from a Trial's history.

Usage::

    python benchmarks/plot_comm_report.py history.json               # writes history.png beside it
    python benchmarks/plot_comm_report.py run.ckpt --out report.png  # a Checkpoint file holds the history too

The history is what ``trial.run()`` returns (a list with one dict per epoch), saved as JSON on rank 0:

.. code-block:: python

    history = trial.run(epochs)
    if torchbearer_dist.is_main_process():
        with open('history.json', 'w') as f:
            json.dump(history, f, default=float)

or a file written by :class:`torchbearer_dist.Checkpoint`, which stores it. From a running program,
``plot(history, 'report.png')``.

Three panels share the epoch axis: each epoch's training time split into the fastest rank's
compute, the slowest rank's lag behind it, and the wait on communication that backward did not hide
(``train_s`` less those two is the rest, a few milliseconds); the megabytes each rank sent; the link
rate achieved.
"""
import argparse
import json
import os
import sys

REPORT = ('comm_bytes', 'comm_wait_s', 'comm_mbit_s', 'train_s', 'slowest_rank', 'slowest_lag_s')


def load_history(path):
    """The list of per-epoch dicts in a JSON file (a list, or a dict with ``'history'``) or a checkpoint file."""
    if path.endswith('.json'):
        with open(path) as f:
            data = json.load(f)
    else:
        import torch
        data = torch.load(path, weights_only=True)
    history = data['history'] if isinstance(data, dict) else data
    if not isinstance(history, list) or not history or not all(isinstance(e, dict) for e in history):
        raise ValueError('{} should hold a Trial history (a list of per-epoch dicts), but holds {}'.format(
            path, type(history).__name__))
    if 'train_s' not in history[0]:
        raise ValueError("{} has no CommunicationReport figures ('train_s' missing from epoch 1); train with "
                         "distributed_callbacks() on 2 or more ranks, or add CommunicationReport()".format(path))
    return history


def plot(history, path):
    """Write a PNG of the report in ``history`` to ``path``, 720 px wide (a documentation page's width)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    epochs = list(range(1, len(history) + 1))
    train = [e['train_s'] for e in history]
    wait = [e.get('comm_wait_s', 0.0) for e in history]
    lag = [e['slowest_lag_s'] for e in history]
    compute = [max(t - w - g, 0.0) for t, w, g in zip(train, wait, lag)]
    counted = 'comm_bytes' in history[0]
    figure, axes = plt.subplots(3 if counted else 1, 1, figsize=(7.2, 7.6 if counted else 3.4), sharex=True,
                                squeeze=False, layout='constrained')
    ax = axes[0][0]
    ax.bar(epochs, compute, color='#1f77b4', label='compute (fastest rank)')
    ax.bar(epochs, lag, bottom=compute, color='#ff7f0e', label='slowest rank behind the fastest')
    ax.bar(epochs, wait, bottom=[c + g for c, g in zip(compute, lag)], color='#d62728',
           label='waiting on communication (not hidden)')
    for x, top, e in zip(epochs, train, history):
        ax.annotate('slowest rank {}'.format(int(e['slowest_rank'])), (x, top), ha='center', va='bottom', fontsize=9)
    ax.set_ylim(0, 1.6 * max(train))
    ax.set_ylabel('seconds of training', fontsize=11)
    ax.set_title('Where each epoch went', fontsize=12)
    ax.legend(fontsize=9, loc='upper center', ncol=2, framealpha=0.9)
    if counted:
        axes[1][0].bar(epochs, [e['comm_bytes'] / 1e6 for e in history], color='#9467bd')
        axes[1][0].set_ylabel('MB sent by each rank', fontsize=11)
        axes[2][0].plot(epochs, [e.get('comm_mbit_s', float('nan')) for e in history], 'o-', color='#2ca02c')
        axes[2][0].set_ylabel('link rate, Mbit/s', fontsize=11)
        axes[2][0].set_ylim(bottom=0)
    for row in axes:
        row[0].grid(axis='y', alpha=0.3)
        row[0].tick_params(labelsize=10)
    axes[-1][0].set_xlabel('epoch', fontsize=11)
    axes[-1][0].set_xticks(epochs)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('history', type=str, help='a JSON file of trial.run()\'s history, or a Checkpoint file')
    parser.add_argument('--out', type=str, help='the PNG to write (default: beside the history, .png)')
    args = parser.parse_args(argv)
    try:
        history = load_history(args.history)
    except (OSError, ValueError) as error:
        sys.exit('error: {}'.format(error))
    out = args.out or os.path.splitext(args.history)[0] + '.png'
    print('wrote', plot(history, out))


if __name__ == '__main__':
    main()
