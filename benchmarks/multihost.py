"""Throughput of gradient synchronization between several hosts on shaped links (needs root and iproute2).

Usage (as root, from a clone)::

    python benchmarks/multihost.py            # the full run, writes benchmarks/results/multihost/
    python benchmarks/multihost.py --quick    # a smoke run, writes benchmarks/results/multihost/quick/

Each host is a network namespace with one rank (one thread, batch 64, a Trial on random data held in
memory); the hosts meet on a private bridge, each sending through a ``tbf`` qdisc shaped to the link's
rate (100 Mbit/s, 1 Gbit/s, 10 Gbit/s) or unshaped. For each link a fresh job runs every contender,
repeats interleaved with the order rotated; throughput is the median over repeats, ratios are medians
of same-repeat ratios. Bytes on the wire per step come from the qdisc counters (``tc -s qdisc``),
summed over hosts. Beside each measurement stands the figure of the projection model
(:mod:`projection`), fed with the single-process phases measured in the same job. Without root or
namespaces the run exits 0 after printing why it skipped.
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import contenders  # noqa: E402
import netns  # noqa: E402
import projection  # noqa: E402
import run  # noqa: E402

LINKS = {'100mbit': 0.1, '1gbit': 1.0, '10gbit': 10.0, 'none': None}
FULL_STEPS = {'mlp': 60, 'cnn': 16, 'mlp64': 30, 'cnn1m': 8}
QUICK_STEPS = {'mlp': 3, 'cnn': 2, 'mlp64': 2, 'cnn1m': 2}
PORT = 29500
TABLE = ['link', 'model', 'contender', 'samples_per_s', 'ratio_to_ddp', 'ratio_to_single', 'projected',
         'wire_kb_per_step', 'projected_kb']
CSV = TABLE + ['ratio_to_powersgd_hook', 'samples_per_s_min', 'samples_per_s_max', 'step_ms', 'projected_step_ms',
               'hosts', 'repeats', 'steps', 'note']


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='a smoke run: 2 links, few steps, 1 repeat')
    parser.add_argument('--hosts', type=int, default=2, help='namespace hosts, one rank each (default 2)')
    parser.add_argument('--links', type=str, default=None, help='comma-separated among {} (default all; quick: '
                        '100mbit,none)'.format(', '.join(LINKS)))
    parser.add_argument('--models', type=str, default=None, help='comma-separated among {} (default all; quick: '
                        'mlp,cnn1m)'.format(', '.join(contenders.MODELS)))
    parser.add_argument('--contenders', type=str, default=','.join(contenders.MULTIHOST), help='comma-separated')
    parser.add_argument('--repeats', type=int, default=None, help='timed runs per contender (default 5, quick 1)')
    parser.add_argument('--steps-scale', type=float, default=1.0, help='multiply the steps of each run by this')
    parser.add_argument('--out', type=str, default=None, help='output folder')
    parser.add_argument('--timeout', type=float, default=300.0, help='seconds for rendezvous and collectives')
    parser.add_argument('--phases', action='store_true',
                        help='instead: per-step forward/backward/wait/optimizer ms of DDP and ours in a plain loop')
    parser.add_argument('--accuracy', type=str, default=None,
                        help='instead: MNIST accuracy and time to 0.90 of these contenders (e.g. '
                             'ddp,ours,ours-powersgd-2), on the first of --links')
    parser.add_argument('--seeds', type=int, default=3, help='seeds of --accuracy runs')
    parser.add_argument('--first-seed', type=int, default=0, help='the first of the --seeds seeds')
    parser.add_argument('--worker', type=str, default=None, help=argparse.SUPPRESS)  # internal: config file
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.links = (args.links or ('100mbit,none' if args.quick else ','.join(LINKS))).split(',')
    args.models = (args.models or ('mlp,cnn1m' if args.quick else ','.join(contenders.MODELS))).split(',')
    args.contender_names = [c for c in args.contenders.split(',') if c]
    unknown = ([x for x in args.links if x not in LINKS] + [m for m in args.models if m not in contenders.MODELS]
               + [c for c in args.contender_names if c not in contenders.CONTENDERS])
    if unknown:
        parser.error('unknown links, models or contenders: {}'.format(', '.join(unknown)))
    if args.hosts < 2:
        parser.error('--hosts should be >= 2, but given {}'.format(args.hosts))
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.out is None:
        args.out = os.path.join(HERE, 'results', 'multihost', 'quick' if args.quick else '')
    return args


def worker_main(path):
    """One rank inside its namespace: join the job, run every contender, write the raw records."""
    import torch.distributed as dist
    with open(path) as f:
        job = json.load(f)
    os.environ['GLOO_SOCKET_IFNAME'] = job['device']
    import datetime
    dist.init_process_group('gloo', init_method='tcp://{}:{}'.format(job['master'], PORT), rank=job['rank'],
                            world_size=job['world_size'], timeout=datetime.timedelta(seconds=job['timeout']))
    try:
        if job['config'].get('accuracy'):
            import accuracy
            result = accuracy.worker(job['config'])
        elif job['config'].get('phases'):
            import phases
            result = phases.worker(job['config'])
        else:
            result = contenders.worker(dict(job['config'], wire_device=job['device']))
    finally:
        dist.destroy_process_group()
    with open(job['result'], 'wb') as f:
        pickle.dump(result, f)


def run_link(hosts, link, config, args, scratch, script=None):
    """Shape the links, run one job of every host, and return each rank's raw records.

    ``script`` is the file each rank runs with ``--worker`` (this one by default; benchmarks/diloco.py
    passes its own).
    """
    hosts.shape(None if link == 'none' else link)
    # $BENCH_CPUS pins host i to the i-th ';'-separated CPU list (taskset), e.g. '2,3;4,5': on a machine of
    # many cores, each host on cores of its own, as on separate machines
    pinned = os.environ.get('BENCH_CPUS', '').split(';') if os.environ.get('BENCH_CPUS') else None
    processes, results = [], []
    for rank in range(args.hosts):
        job = dict(device=hosts.links[rank], master=hosts.address(0), rank=rank, world_size=args.hosts,
                   timeout=args.timeout, config=config, result=os.path.join(scratch, '{}-{}.pkl'.format(link, rank)))
        path = os.path.join(scratch, '{}-{}.json'.format(link, rank))
        with open(path, 'w') as f:
            json.dump(job, f)
        env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
        argv = [sys.executable, script or os.path.abspath(__file__), '--worker', path]
        if pinned:
            argv = ['taskset', '-c', pinned[rank]] + argv
        processes.append(subprocess.Popen(hosts.command(rank, argv), env=env))
        results.append(job['result'])
    deadline = time.monotonic() + 4 * args.timeout
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    codes = [p.returncode for p in processes]
    if any(codes):
        raise RuntimeError('a rank failed on link {}: exit codes {}'.format(link, codes))
    out = []
    for path in results:
        with open(path, 'rb') as f:
            out.append(pickle.load(f))
    return out


def summarize_link(link, raw, config, hosts):
    """Rows of one link: run.summarize's medians, plus bytes on the wire and the projection beside them."""
    run.WORLD_SIZE = hosts
    rows = [r for r in run.summarize(raw, config) if r['contender'] != 'comm-floor']
    gbit = LINKS[link]
    for row in rows:
        model, name = row['model'], row['contender']
        row.update(link=link, hosts=hosts)
        sent = {}
        for records in raw:
            for rec in records['records']:
                if rec['model'] == model and rec['contender'] == name and rec.get('sent_bytes') is not None:
                    sent[rec['repeat']] = sent.get(rec['repeat'], 0) + rec['sent_bytes']
        if sent and not name.startswith('single'):
            row['wire_kb_per_step'] = run._median(list(sent.values())) / config['steps'][model] / 1e3
        extra = raw[0]['extras'][model]
        sends = projection.contender_sends(name, extra, contenders.POWERSGD_RANK)
        single = [r for r in rows if r['model'] == model and r['contender'] == 'single-1-thread']
        if sends is not None and single:
            row['projected_kb'] = sum(b for _, b in sends) * 2 * (hosts - 1) / hosts * hosts / 1e3
            if gbit:
                step = single[0]['step_ms'] / 1e3
                seconds = projection.schedule_seconds(extra['phases'], step, sends, hosts, gbit)
                row['projected_step_ms'] = seconds * 1e3
                row['projected'] = hosts * contenders.BATCH / seconds
    for row in rows:
        same = {r['contender']: r for r in rows if r['model'] == row['model']}
        hook = same.get('ddp-powersgd-hook')
        if hook and hook['samples_per_s'] and row['samples_per_s']:
            row['ratio_to_powersgd_hook'] = row['samples_per_s'] / hook['samples_per_s']
        single = same.get('single-1-thread')
        if single and single['samples_per_s'] and row['samples_per_s']:
            row['ratio_to_single'] = row['samples_per_s'] / single['samples_per_s']
    return rows


ACCURACY = ['link', 'contender', 'final_test_acc', 'final_min', 'final_max', 'seconds_to_90', 'epochs_to_90',
            'seconds_per_epoch', 'seeds']


def summarize_accuracy(link, runs):
    """Per contender: mean final global test accuracy over seeds, and median wall time to >= 0.90."""
    import statistics
    rows = []
    for name in dict.fromkeys(r['contender'] for r in runs):
        mine = [r['points'] for r in runs if r['contender'] == name]
        finals = [points[-1][1] for points in mine]
        reach = [next(((t, e + 1) for e, (t, acc) in enumerate(points) if acc >= 0.90), (None, None))
                 for points in mine]
        times = [t for t, _ in reach if t is not None]
        rows.append(dict(link=link, contender=name, final_test_acc=statistics.mean(finals), final_min=min(finals),
                         final_max=max(finals), seconds_to_90=statistics.median(times) if len(times) == len(mine)
                         else None, epochs_to_90=statistics.median([e for _, e in reach]) if times else None,
                         seconds_per_epoch=statistics.median([p[-1][0] / len(p) for p in mine]), seeds=len(mine)))
    print('\naccuracy on link {}:'.format(link))
    print(run.format_table([{c: fmt(r.get(c), c) for c in ACCURACY} for r in rows], ACCURACY), flush=True)
    return rows


def print_phases(link, phases):
    """Print rank 0's per-step phases, ms, for each model and contender."""
    for model, by_name in phases.items():
        print('\nlink {}, {} (rank 0, plain loop, median ms per step):'.format(link, model))
        for name, row in by_name.items():
            print('  {:11s} '.format(name) + '  '.join('{} {:.1f}'.format(k, row[k]) for k in
                                                        ('forward', 'backward', 'wait', 'optimizer', 'step')))
            if row.get('schedule'):
                print('        buckets in sending order: {}'.format(row['schedule']))


def fmt(value, column):
    if isinstance(value, float) and column.startswith('final'):
        return '{:.4f}'.format(value)
    if isinstance(value, float) and column.startswith(('seconds', 'epochs')):
        return '{:.1f}'.format(value)
    if isinstance(value, float) and column in ('ratio_to_single', 'ratio_to_powersgd_hook', 'ratio_to_ceiling'):
        return '{:.2f}'.format(value)
    if isinstance(value, float) and column in ('projected', 'wire_kb_per_step', 'projected_kb', 'projected_step_ms'):
        return '{:.0f}'.format(value)
    return run._fmt(value, column)


def write_csv(path, rows, columns):
    import csv
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({c: fmt(row.get(c), c) for c in columns})


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    reason = netns.unavailable()
    if reason:
        print('multi-host benchmark skipped: {}'.format(reason))
        return 0
    steps = {m: max(2, int(round((QUICK_STEPS if args.quick else FULL_STEPS)[m] * args.steps_scale)))
             for m in args.models}
    config = dict(models=args.models, contenders=args.contender_names, steps=steps, repeats=args.repeats,
                  all_reduce_calls=3 if args.quick else 10, phase_steps=3 if args.quick else 20, phases=args.phases,
                  accuracy=args.accuracy and args.accuracy.split(','),
                  seeds=list(range(args.first_seed, args.first_seed + args.seeds)))
    os.makedirs(args.out, exist_ok=True)
    command = 'python benchmarks/multihost.py ' + ' '.join(argv if argv is not None else sys.argv[1:])
    print('multi-host benchmark: {} namespace hosts, 1 rank x 1 thread and batch {} each, links {}; RANDOM data; '
          '{} repeats interleaved; steps {}'.format(args.hosts, contenders.BATCH, args.links, args.repeats, steps),
          flush=True)
    rows, started = [], time.monotonic()
    try:
        hosts = netns.Hosts(args.hosts).__enter__()
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        print('multi-host benchmark skipped: cannot make network namespaces here: {}'.format(error))
        return 0
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for link in args.links:
                raw = run_link(hosts, link, config, args, scratch)
                if args.phases:
                    print_phases(link, raw[0]['phases'])
                    continue
                if args.accuracy:
                    rows += summarize_accuracy(link, raw[0]['runs'])
                    break
                link_rows = summarize_link(link, raw, config, args.hosts)
                rows += link_rows
                print('\nlink {} ({:.0f} s so far):'.format(link, time.monotonic() - started))
                print(run.format_table([{c: fmt(r.get(c), c) for c in TABLE} for r in link_rows], TABLE), flush=True)
    finally:
        hosts.__exit__(None, None, None)
    load = os.getloadavg()
    if args.phases:
        return 0
    if args.accuracy:
        write_csv(os.path.join(args.out, 'accuracy.csv'), rows, ACCURACY)
        with open(os.path.join(args.out, 'accuracy_command.txt'), 'w') as f:
            f.write('{}\n# load average at the end {:.1f} {:.1f} {:.1f}\n'.format(command, *load))
        return 0
    for row in rows:
        row.update(note='{}; {} hosts; load average at the end {:.1f}'.format(row.get('note', ''), args.hosts, load[0]))
    write_csv(os.path.join(args.out, 'multihost.csv'), rows, CSV)
    write_csv(os.path.join(args.out, 'multihost_table.csv'), rows, TABLE)
    with open(os.path.join(args.out, 'command.txt'), 'w') as f:
        f.write('{}\n# {:.0f} s, load average at the end {:.1f} {:.1f} {:.1f}\n'.format(
            command, time.monotonic() - started, *load))
    try:
        import plot_multihost
        found = plot_multihost.read_rows(args.out)
        plot_multihost.calibrate(found)
        plot_multihost.plot(os.path.join(args.out, 'multihost.png'), found, command)
        plot_multihost.write_model_tables(args.out, found)
    except ImportError as error:
        print('no plot: {}'.format(error))
    print('\nwrote {} in {:.0f} s; load average {:.1f}'.format(args.out, time.monotonic() - started, load[0]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
