"""Side-by-side throughput of gradient synchronization in a torchbearer Trial: one command, interleaved repeats.

Usage::

    python benchmarks/run.py            # the full run (a few minutes), writes benchmarks/results/
    python benchmarks/run.py --quick    # a smoke run of seconds, writes benchmarks/results/quick/

Two ranks over loopback gloo, one thread each, batch 64 per rank, random data pre-built in memory.
Each repeat runs every contender once, in an order rotated by one each repeat; a run is a fixed
number of steps after a discarded warm-up epoch. Reported numbers are medians over repeats, and
ratios are medians of ratios taken within the same repeat.
"""
import argparse
import csv
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import contenders  # noqa: E402
import projection  # noqa: E402
import torch  # noqa: E402

import torchbearer_dist  # noqa: E402

FULL_STEPS = {'mlp': 150, 'cnn': 16, 'mlp64': 50, 'cnn1m': 8}
QUICK_STEPS = {'mlp': 6, 'cnn': 4, 'mlp64': 4, 'cnn1m': 2}
DEFAULT_MODELS = ['mlp', 'cnn', 'mlp64']
WORLD_SIZE = 2
PROJECTION_TABLE = ['model', 'link_gbit', 'wire', 'machines', 'step_ms', 'samples_per_s', 'scaling_efficiency']

TABLE_COLUMNS = ['model', 'contender', 'samples_per_s', 'ratio_to_ddp', 'scaling_efficiency', 'step_ms']
CSV_COLUMNS = TABLE_COLUMNS + ['fraction_of_floor', 'cpu_ms_rank0', 'peak_rss_mib_rank0', 'peak_rss_mib_rank1',
                               'samples_per_s_min', 'samples_per_s_max', 'ratio_to_recipe', 'repeats', 'steps',
                               'batch_per_rank', 'threads_per_rank', 'ranks', 'note']


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='a tiny smoke run: few steps, 2 repeats')
    parser.add_argument('--repeats', type=int, default=None, help='timed runs per contender (default 11, quick 2)')
    parser.add_argument('--models', type=str, default=','.join(DEFAULT_MODELS),
                        help='comma-separated models among {}'.format(', '.join(contenders.MODELS)))
    parser.add_argument('--contenders', type=str, default=','.join(contenders.CONTENDERS),
                        help='comma-separated contenders among {}'.format(', '.join(contenders.CONTENDERS)))
    parser.add_argument('--steps-scale', type=float, default=1.0, help='multiply the steps of each run by this')
    parser.add_argument('--out', type=str, default=None,
                        help='output folder (default benchmarks/results, or benchmarks/results/quick with --quick)')
    parser.add_argument('--no-plot', action='store_true', help='skip the PNG')
    parser.add_argument('--timeout', type=float, default=120.0, help='seconds for rendezvous and each collective')
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(',') if m]
    names = [c for c in args.contenders.split(',') if c]
    unknown = [m for m in models if m not in contenders.MODELS] + [c for c in names if c not in contenders.CONTENDERS]
    if unknown:
        parser.error('unknown models or contenders: {}'.format(', '.join(unknown)))
    if args.repeats is None:
        args.repeats = 2 if args.quick else 11
    if args.repeats < 1:
        parser.error('--repeats should be >= 1, but given {}'.format(args.repeats))
    if args.out is None:
        args.out = os.path.join(HERE, 'results', 'quick' if args.quick else '')
    args.models, args.contender_names = models, names
    return args


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def slowest_seconds(raw):
    """``{(model, contender, repeat): seconds}``, the slowest rank's: what a synchronous job's time is."""
    seconds = {}
    for records in raw:
        for rec in records['records']:
            if rec['seconds'] is not None:
                key = (rec['model'], rec['contender'], rec['repeat'])
                seconds[key] = max(seconds.get(key, 0.0), rec['seconds'])
    return seconds


def summarize(raw, config):
    """Per model and contender: medians of throughput and of within-repeat ratios."""
    by_rank = [r['records'] for r in raw]
    seconds, rss, cpu = slowest_seconds(raw), {}, {}
    for rank, records in enumerate(by_rank):
        for rec in records:
            if rec.get('cpu') is not None and rank == 0:
                cpu[(rec['model'], rec['contender'], rec['repeat'])] = rec['cpu']
            if rec['rss_mib'] is not None:
                rss.setdefault((rec['model'], rec['contender'], rank), []).append(rec['rss_mib'])
    rows = []
    for model in config['models']:
        steps = config['steps'][model]
        repeats = range(config['repeats'])

        def sps(name, r, _model=model, _steps=steps):
            spec = contenders.CONTENDERS[name]
            t = seconds.get((_model, name, r))
            ranks = spec['ranks'] or WORLD_SIZE
            return None if t is None else ranks * spec.get('batch', contenders.BATCH) * _steps / t

        single_step = {r: seconds[(model, 'single-1-thread', r)] / steps
                       for r in repeats if (model, 'single-1-thread', r) in seconds}
        all_reduce = {r: seconds[(model, 'fused-all-reduce', r)] for r in repeats}
        floor = {r: WORLD_SIZE * contenders.BATCH / (single_step[r] + all_reduce[r]) for r in single_step}
        for name in config['contenders']:
            spec = contenders.CONTENDERS[name]
            per = [sps(name, r) for r in repeats]
            ddp = [sps('ddp', r) if 'ddp' in config['contenders'] else None for r in repeats]
            recipe = [sps('per-param-recipe', r) if 'per-param-recipe' in config['contenders'] else None
                      for r in repeats]
            single = [sps('single-1-thread', r) if 'single-1-thread' in config['contenders'] else None
                      for r in repeats]
            row = dict(model=model, contender=name, samples_per_s=_median(per),
                       samples_per_s_min=min(per), samples_per_s_max=max(per),
                       ratio_to_ddp=_median([p / d for p, d in zip(per, ddp) if d]),
                       ratio_to_recipe=_median([p / d for p, d in zip(per, recipe) if d]),
                       scaling_efficiency=_median([p / (WORLD_SIZE * s) for p, s in zip(per, single) if s]),
                       fraction_of_floor=_median([per[r] / floor[r] for r in floor]),
                       step_ms=_median([seconds[(model, name, r)] * 1e3 / steps for r in repeats]),
                       cpu_ms_rank0=_median([cpu.get((model, name, r), 0) * 1e3 / steps for r in repeats]),
                       peak_rss_mib_rank0=max(rss.get((model, name, 0), [0])) or None,
                       peak_rss_mib_rank1=max(rss.get((model, name, 1), [0])) or None,
                       repeats=config['repeats'], steps=steps, batch_per_rank=spec.get('batch', contenders.BATCH),
                       threads_per_rank=spec.get('threads', 1), ranks=spec['ranks'] or WORLD_SIZE, note=spec['note'])
            rows.append(row)
        if floor:
            extra = raw[0]['extras'][model]
            rows.append(dict(model=model, contender='comm-floor', samples_per_s=_median(list(floor.values())),
                             samples_per_s_min=min(floor.values()), samples_per_s_max=max(floor.values()),
                             ratio_to_ddp=_median([floor[r] / sps('ddp', r) for r in floor])
                             if 'ddp' in config['contenders'] else None,
                             scaling_efficiency=_median([floor[r] * single_step[r] / (WORLD_SIZE * contenders.BATCH)
                                                                     for r in floor]),
                             fraction_of_floor=1.0, step_ms=_median([1e3 * (single_step[r] + all_reduce[r])
                                                                     for r in floor]),
                             repeats=config['repeats'], steps=steps, batch_per_rank=contenders.BATCH,
                             threads_per_rank=1, ranks=WORLD_SIZE,
                             note='single-process step {:.3f} ms + one fused fp32 all-reduce of {} values '
                                  '({:.0f} KiB) {:.3f} ms'.format(1e3 * _median(list(single_step.values())),
                                                                  extra['numel'], extra['numel'] * 4 / 1024,
                                                                  1e3 * _median(list(all_reduce.values())))))
    return rows


def projections(raw, rows, config):
    """The modelled rows for each model (see :mod:`projection`)."""
    out = []
    for model in config['models']:
        extra = raw[0]['extras'][model]
        single = [r for r in rows if r['model'] == model and r['contender'] == 'single-1-thread']
        if not single or 'phases' not in extra:
            continue
        step = single[0]['step_ms'] / 1e3
        buckets = extra.get('buckets') or extra.get('buckets_overlap') or [extra['numel']]
        for row in projection.project(extra['phases'], step, buckets, contenders.BATCH):
            out.append(dict(model=model, buckets=len(buckets), compute_ms=1e3 * step, **row))
    return out


def _fmt(value, column):
    if value is None:
        return ''
    if isinstance(value, float):
        if column in ('ratio_to_ddp', 'ratio_to_recipe', 'scaling_efficiency', 'fraction_of_floor'):
            return '{:.2f}'.format(value)
        if column in ('step_ms', 'cpu_ms_rank0'):
            return '{:.3f}'.format(value)
        return '{:.0f}'.format(value)
    return str(value)


def write_csv(path, rows, columns):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _fmt(row.get(c), c) for c in columns})


def format_table(rows, columns):
    cells = [columns] + [[_fmt(r.get(c), c) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ['  '.join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def plot(path, rows, model_rows, config):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    models = config['models']
    figure, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 8.5), squeeze=False)
    for column, model in enumerate(models):
        ax = axes[0][column]
        mine = [r for r in rows if r['model'] == model and r['samples_per_s']]
        names = [r['contender'] for r in mine]
        values = [r['samples_per_s'] for r in mine]
        colours = ['tab:gray' if n.startswith('single') else 'tab:red' if n == 'ddp' else 'tab:orange'
                   if n == 'per-param-recipe' else 'tab:green' if n == 'comm-floor' else 'tab:blue' for n in names]
        ax.barh(range(len(names)), values, color=colours)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel('samples/s (median), measured')
        ax.set_title('{}: measured, 2 ranks x 1 thread, loopback gloo'.format(model), fontsize=9)
        ax = axes[1][column]
        for gbit, colour in zip(projection.LINKS_GBIT, ('tab:red', 'tab:orange', 'tab:blue')):
            for wire, style in (('fp32', '-'), ('fp16', '--')):
                line = [r for r in model_rows if r['model'] == model and r['link_gbit'] == gbit and r['wire'] == wire]
                ax.plot([r['machines'] for r in line], [r['scaling_efficiency'] for r in line], style, color=colour,
                        marker='o', markersize=3, label='{} Gbit/s {}'.format(gbit, wire))
        ax.set_xscale('log', base=2)
        ax.set_xticks(projection.MACHINES)
        ax.set_xticklabels([str(m) for m in projection.MACHINES])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel('machines (1 rank each)')
        ax.set_ylabel('scaling efficiency')
        ax.set_title('{}: MODEL (projection), not a measurement'.format(model), fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    figure.suptitle('torchbearer_dist gradient sync: random data; {}'.format(config['machine']), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv=None):
    args = parse_args(argv)
    steps = {m: max(2, int(round((QUICK_STEPS if args.quick else FULL_STEPS)[m] * args.steps_scale)))
             for m in args.models}
    config = dict(models=args.models, contenders=args.contender_names, steps=steps, repeats=args.repeats,
                  all_reduce_calls=5 if args.quick else 50, phase_steps=3 if args.quick else 30,
                  machine='{} cores, torch {}, {}'.format(os.cpu_count(), torch.__version__, platform.machine()))
    os.makedirs(args.out, exist_ok=True)
    print('torchbearer_dist benchmark: {} ranks over loopback gloo, 1 thread and batch {} per rank, in a Trial; '
          'RANDOM data pre-built in memory (throughput only); {} repeats, contender order rotated each repeat; '
          'steps per run {}'.format(WORLD_SIZE, contenders.BATCH, args.repeats, steps), flush=True)
    started = time.monotonic()
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    raw = torchbearer_dist.launch(contenders.worker, WORLD_SIZE, args=(config,), timeout=args.timeout)
    rows = summarize(raw, config)
    model_rows = projections(raw, rows, config)
    write_csv(os.path.join(args.out, 'results.csv'), rows, CSV_COLUMNS)
    write_csv(os.path.join(args.out, 'table.csv'), rows, TABLE_COLUMNS)
    write_csv(os.path.join(args.out, 'projection.csv'), model_rows,
              ['model', 'link_gbit', 'wire', 'machines', 'buckets', 'compute_ms', 'step_ms', 'samples_per_s',
               'scaling_efficiency'])
    load = os.getloadavg() if hasattr(os, 'getloadavg') else None
    print('\nMEASURED on {} (medians of {} runs; ratios are medians of same-repeat ratios); load average '
          'at the end {}:'.format(config['machine'], args.repeats, load and '{:.1f} {:.1f} {:.1f}'.format(*load)))
    print(format_table(rows, TABLE_COLUMNS))
    for model in args.models:
        extra = raw[0]['extras'][model]
        print('{}: {} tensors, {} values; buckets (values, in order sent) {}; single-process phases (ms) {}'.format(
            model, extra['tensors'], extra['numel'], extra.get('buckets'),
            {k: round(v * 1e3, 3) for k, v in extra.get('phases', {}).items()}))
    if not raw[0]['rss_reset']:
        print('note: peak RSS could not be reset per contender; ru_maxrss is the process-lifetime peak')
    print('\nPROJECTION (a MODEL, not a measurement; ring all-reduce 2(N-1)/N x bytes / bandwidth + 2(N-1) x '
          '{:.0f} us hop latency per call):'.format(projection.HOP_LATENCY_S * 1e6))
    shown = [r for r in model_rows if r['machines'] in (2, 8, 64)]
    print(format_table(shown, PROJECTION_TABLE))
    write_csv(os.path.join(args.out, 'projection_table.csv'), shown, PROJECTION_TABLE)
    if not args.no_plot:
        plot(os.path.join(args.out, 'performance.png'), rows, model_rows, config)
    print('\nwrote {} in {:.0f} s'.format(', '.join(sorted(os.listdir(args.out))), time.monotonic() - started))
    return 0


if __name__ == '__main__':
    sys.exit(main())
