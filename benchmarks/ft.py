"""The fault-tolerant mode (torchft) measured: per-step cost, stall per failure, heal time, accuracy under chaos.

    python benchmarks/ft.py cost --model cnn --repeats 3   # ms per step: fail-fast mode against torchft's Manager
    python benchmarks/ft.py cost --model cnn1m --link 1gbit  # the same on two namespace hosts, a 1 Gbit/s link
    python benchmarks/ft.py faults --kills 3        # survivors' stall per kill -9, the replacement's heal time
    python benchmarks/ft.py chaos --minutes 2       # the example under random kills against no kills

Every process runs on this machine over loopback, a lighthouse in this process; with ``--link`` (cost, as
root) replica i runs on network-namespace host i (benchmarks/netns.py), each host's sending side shaped
to that rate, the lighthouse on host 0; with ``--netns`` (chaos) likewise, unshaped. Results (medians,
the load average at the start and the end) go to benchmarks/results/ft/. Never part of the tests.
"""
import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

# torchft's Rust side logs every quorum at INFO; RUST_LOG=info shows it again.
os.environ.setdefault('RUST_LOG', 'warn')
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # contenders.py, netns.py
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, 'results', 'ft')


def _worker(args):
    """One process of a measured job: ``--mode sync`` is a rank of the fail-fast mode, ``ft`` a torchft replica."""
    import torch
    import torchbearer
    from contenders import MODELS
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchbearer import Callback, Trial

    import torchbearer_dist as tbd

    torch.set_num_threads(1)
    torch.manual_seed(args.replica)
    build, shape = MODELS[args.model]
    samples = args.steps * args.batch * args.replicas
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(samples, *shape, generator=generator),
                            torch.randint(0, 10, (samples,), generator=generator))
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    class Clock(Callback):
        def on_step_training(self, state):
            print('T {:.4f} {} {}'.format(time.time(), state[torchbearer.EPOCH], state[torchbearer.BATCH]), flush=True)

    def run(callbacks):
        loader = DataLoader(dataset, batch_size=args.batch, sampler=DistributedSampler(
            dataset, num_replicas=args.replicas, rank=args.replica, seed=0))
        trial = Trial(model, optimizer, torch.nn.CrossEntropyLoss(), callbacks=[Clock(), *callbacks])
        trial.with_generators(loader).run(args.epochs, verbose=0)
        print('DONE', os.getpid(), flush=True)

    if args.mode == 'ft':
        import torchft

        from torchbearer_dist.ft import FaultTolerantAllReduce

        def timed(name, method):  # the Manager's own rounds per step, timed in this process (benchmark only)
            def wrapper(*a, **k):
                started = time.perf_counter()
                try:
                    return method(*a, **k)
                finally:
                    print('{} {:.3f}'.format(name, 1000 * (time.perf_counter() - started)), flush=True)
            return wrapper
        torchft.Manager.start_quorum = timed('Q', torchft.Manager.start_quorum)
        torchft.Manager.should_commit = timed('C', torchft.Manager.should_commit)
        # what is left at the end of backward: the buckets not yet sent, every wait, the copy back
        FaultTolerantAllReduce._average = timed('A', FaultTolerantAllReduce._average)
        run(tbd.distributed_callbacks(fault_tolerant=args.lighthouse, replica_id='r{}'.format(args.replica),
                                      min_replicas=args.min_replicas, timeout=args.timeout))
    else:
        options = {'overlap': False} if args.mode == 'sync-flat' else {}  # sync-flat: all-reduce after backward, as ft
        with tbd.process_group(rank=args.replica, world_size=args.replicas, host=args.host, port=args.port,
                               timeout=args.timeout):
            run(tbd.distributed_callbacks(report=False, **options))


def _start(mode, replica, opts, lighthouse='', port=0, log=None, hosts=None):
    """A worker process; on host ``replica`` of ``hosts`` (namespaces) if given, rank 0's store on host 0."""
    command = [sys.executable, os.path.abspath(__file__), 'worker', '--mode', mode, '--replica', str(replica),
               '--replicas', str(opts.replicas), '--model', opts.model, '--steps', str(opts.steps), '--batch',
               str(opts.batch), '--epochs', str(opts.epochs), '--lighthouse', lighthouse, '--port', str(port),
               '--host', hosts.address(0) if hosts else '127.0.0.1', '--timeout', str(opts.timeout),
               '--min-replicas', str(opts.replicas if opts.what == 'cost' else 1)]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT + os.pathsep + HERE)
    if hosts is not None:  # gloo on the host's own link: its host name resolves outside the namespace
        env['GLOO_SOCKET_IFNAME'] = hosts.links[replica]
        command = hosts.command(replica, command)
    return subprocess.Popen(command, stdout=log or subprocess.PIPE, stderr=log or subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)


def _times(text):
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith('T ')]


def _ms_per_step(times, skip):
    """Median milliseconds between consecutive steps, the first ``skip`` steps (warm-up) left out."""
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1:])]
    return 1000 * statistics.median(gaps)


def _free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _lighthouse(min_replicas=1):
    from torchbearer_dist.ft import Lighthouse
    return Lighthouse(bind='127.0.0.1:0', min_replicas=min_replicas, join_timeout=60.0, heartbeat_timeout=2.0)


#: cost's modes: the fail-fast mode (the package's default set), the same with its all-reduce after backward
#: (no overlap, as the fault-tolerant mode's), and torchft's Manager.
COST_MODES = ('sync', 'sync-flat', 'ft')


def _median_of(outs, name, skip_lines=10):
    """Median of the ``name ms`` lines the workers printed (their first ``skip_lines`` lines left out), or None."""
    values = [float(line.split()[1]) for out in outs for line in out.splitlines()[skip_lines:]
              if line.startswith(name + ' ')]
    return round(statistics.median(values), 3) if values else None


def cost(opts):
    """ms per step of the same job in each mode, the modes interleaved in every repeat (order rotated).

    On loopback each run has a lighthouse of its own in this process; with ``--link`` the two replicas (or
    ranks) run on two namespace hosts whose sending sides are shaped to that rate, the lighthouse on host 0
    (one for the whole run: the modes between two ft runs outlast its heartbeat timeout).
    """
    modes = opts.modes.split(',')
    unknown = [m for m in modes if m not in COST_MODES]
    if unknown:
        raise SystemExit('unknown modes {}: choose among {}'.format(','.join(unknown), ','.join(COST_MODES)))
    rows = []
    link = None if opts.link == 'none' else opts.link
    # Every quorum waits for all the replicas: a replica that started late would otherwise heal from one that
    # trained alone meanwhile (cheaper steps), and train fewer steps itself.
    with (_Namespaces(opts.replicas, link, opts.replicas) if opts.link else contextlib.nullcontext()) as shared:
        for repeat in range(opts.repeats):
            for mode in modes[repeat % len(modes):] + modes[:repeat % len(modes)]:
                with (contextlib.nullcontext(shared) if shared else _Loopback(opts.replicas)) as net:
                    if shared:  # the last run's replicas dropped by the lighthouse (heartbeat timeout 2 s)
                        time.sleep(3)
                    port = 29520 + len(rows) if shared else _free_port()  # rank 0's store, on host 0 with --link
                    procs = [_start(mode, r, opts, net.address, port, hosts=net.hosts) for r in range(opts.replicas)]
                    outs = [p.communicate(timeout=1800)[0] for p in procs]
                if any(p.returncode for p in procs) or min(len(_times(out)) for out in outs) < 7:  # 5 skipped
                    raise RuntimeError('a {} run failed (exit codes {}):\n{}'.format(
                        mode, [p.returncode for p in procs], outs[0][-2000:]))
                ms = statistics.median(_ms_per_step(_times(out), skip=5) for out in outs)
                rows.append({'repeat': repeat, 'mode': mode, 'ms_per_step': round(ms, 2)})
                for name, what in (('Q', 'quorum_ms'), ('C', 'commit_ms'), ('A', 'all_reduce_ms')):
                    value = _median_of(outs, name)
                    if value is not None:
                        rows[-1][what] = value
                print(rows[-1], flush=True)
    result = {'link': opts.link or 'loopback', 'model': opts.model, 'modes': modes, 'rows': rows}
    for mode in modes:
        result['{}_ms'.format(mode)] = statistics.median(r['ms_per_step'] for r in rows if r['mode'] == mode)
    by_repeat = {(r['repeat'], r['mode']): r['ms_per_step'] for r in rows}
    for mode, base in (('ft', 'sync'), ('ft', 'sync-flat'), ('sync-flat', 'sync')):
        if mode in modes and base in modes:  # the median of same-repeat ratios, and the ratio of the medians
            ratios = [by_repeat[(k, mode)] / by_repeat[(k, base)] for k in range(opts.repeats)]
            result['{}_over_{}'.format(mode, base)] = {
                'paired_median': round(statistics.median(ratios), 3), 'per_repeat': [round(x, 3) for x in ratios],
                'of_medians': round(result['{}_ms'.format(mode)] / result['{}_ms'.format(base)], 3)}
    for name in ('quorum_ms', 'commit_ms', 'all_reduce_ms'):
        values = [r[name] for r in rows if name in r]
        if values:
            result['ft_{}_median'.format(name)] = round(statistics.median(values), 3)
    if 'ft_quorum_ms_median' in result:
        result['manager_rounds_ms_median'] = round(result['ft_quorum_ms_median'] + result['ft_commit_ms_median'], 3)
    return result


def faults(opts):
    """kill -9 of one replica of three, ``kills`` times: the survivors' stall and the replacement's heal time."""
    results, logs = [], []

    def start(replica):
        logs.append(os.path.join(OUT, 'faults_r{}_{}.log'.format(replica, len(logs))))
        with open(logs[-1], 'w') as log:
            return _start('ft', replica, opts, lighthouse.address, log=log), logs[-1]

    def read(path):
        with open(path) as f:
            return f.read()

    def stepping(path, steps=20, deadline=120):
        end = time.time() + deadline
        while len(_times(read(path))) < steps and time.time() < end:
            time.sleep(0.2)

    with _lighthouse() as lighthouse:
        procs = {r: start(r) for r in range(opts.replicas)}
        try:
            for r in range(opts.replicas):
                stepping(procs[r][1])
            for kill in range(opts.kills):
                time.sleep(opts.every)
                victim = 1 + kill % (opts.replicas - 1)
                os.kill(procs[victim][0].pid, signal.SIGKILL)
                killed = time.time()
                time.sleep(opts.down)
                restarted = time.time()
                procs[victim] = start(victim)
                stepping(procs[victim][1], steps=1)
                survivor, healed = _times(read(procs[0][1])), _times(read(procs[victim][1]))
                before = [b - a for a, b in zip(survivor, survivor[1:]) if b < killed]
                around = max(b - a for a, b in zip(survivor, survivor[1:]) if b >= killed)
                typical = statistics.median(before[-20:])
                joined = [b - a for a, b in zip(survivor, survivor[1:]) if healed and restarted <= a <= healed[0] + 1]
                results.append({'kill': kill, 'stall_s': round(around - typical, 2),
                                'join_pause_s': round(max(joined) - typical, 2) if joined else None,
                                'replacement_first_step_s': round(healed[0] - restarted, 2) if healed else None,
                                'typical_step_ms': round(1000 * typical, 1)})
                print(results[-1], flush=True)
        finally:
            for p, _ in procs.values():
                os.killpg(p.pid, signal.SIGKILL)
    return {'kills': results, 'median_stall_s': statistics.median(r['stall_s'] for r in results),
            'median_heal_s': statistics.median(r['replacement_first_step_s'] for r in results
                                               if r['replacement_first_step_s'] is not None),
            'median_join_pause_s': statistics.median(r['join_pause_s'] for r in results
                                                     if r['join_pause_s'] is not None)}


def _example(replica, opts, lighthouse, log, hosts=None):
    command = [sys.executable, os.path.join(ROOT, 'examples', 'distributed_data_parallel.py'), '--fault-tolerant',
               '--lighthouse', lighthouse, '--replica', str(replica), '--replicas', str(opts.replicas), '--epochs',
               str(opts.epochs), '--threads', '1', '--save', os.path.join(OUT, 'chaos_model.pt')] + (
                   ['--local-steps', str(opts.local_steps)] if opts.local_steps else [])
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    if hosts is not None:  # replica i on host i; gloo on that host's link (its hostname resolves elsewhere)
        env['GLOO_SOCKET_IFNAME'] = hosts.links[replica]
        command = hosts.command(replica, command)
    return subprocess.Popen(command, stdout=log, stderr=log, text=True, env=env,
                            start_new_session=True, cwd=os.path.join(ROOT, 'examples'))


def _last_val_acc(text):
    found = re.findall(r'val_acc ([0-9.]+)', text)
    return float(found[-1]) if found else None


def _last_line(path):
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return lines[-1] if lines else ''


def _signal(process, signum):
    """``signum`` to ``process``'s session, unless it has ended."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass


def _digest(path):
    import hashlib

    import torch
    state = torch.load(path, weights_only=True)
    return hashlib.sha256(b''.join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()[:16]


class _Loopback:
    """The lighthouse in this process, every replica on loopback."""

    def __init__(self, min_replicas=1):
        self.min_replicas = min_replicas

    def __enter__(self):
        self.lighthouse = _lighthouse(self.min_replicas)
        self.address = self.lighthouse.address
        return self

    def restart_lighthouse(self, down):
        """Stop the lighthouse, and start it again on the same address ``down`` seconds later."""
        from torchbearer_dist.ft import Lighthouse
        self.lighthouse.shutdown()
        time.sleep(down)
        from urllib.parse import urlparse
        self.lighthouse = Lighthouse(bind='127.0.0.1:{}'.format(urlparse(self.address).port),
                                     min_replicas=self.min_replicas, join_timeout=60.0, heartbeat_timeout=2.0)

    def __exit__(self, *exc):
        self.lighthouse.shutdown()

    hosts = None


def _serving(path):
    """How many times the lighthouse log at ``path`` says a lighthouse listens (``python -m torchbearer_dist.ft``
    writes its first line once it does)."""
    try:
        with open(path) as f:
            return f.read().count('lighthouse at ')
    except FileNotFoundError:
        return 0


class _Namespaces:
    """Replica i on network-namespace host i, each host's sending side shaped to ``link`` (a tc rate, or None:
    unshaped); the lighthouse on host 0 (benchmarks/netns.py)."""

    def __init__(self, count, link=None, min_replicas=1):
        from netns import Hosts
        self.hosts, self.link, self.min_replicas = Hosts(count), link, min_replicas

    def __enter__(self):
        self.hosts.__enter__()
        try:
            self.hosts.shape(self.link)
        except BaseException:
            self.hosts.__exit__(None, None, None)
            raise
        self.address = '{}:29510'.format(self.hosts.address(0))
        self._serve('w')
        return self

    def _serve(self, mode):
        """Start the lighthouse; return once it listens (its first line, written then), up to a minute."""
        path = os.path.join(OUT, 'lighthouse.log')
        started = _serving(path) if mode == 'a' else 0
        with open(path, mode) as log:
            self.server = subprocess.Popen(self.hosts.command(0, [
                sys.executable, '-m', 'torchbearer_dist.ft', '--bind', '0.0.0.0:29510', '--heartbeat-timeout', '2',
                '--min-replicas', str(self.min_replicas)]),
                env=dict(os.environ, PYTHONPATH=ROOT, RUST_LOG='info'), start_new_session=True, stdout=log,
                stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while _serving(path) == started and self.server.poll() is None and time.monotonic() < end:
            time.sleep(0.1)

    def restart_lighthouse(self, down):
        """Kill the lighthouse process, and start it again on the same address ``down`` seconds later (plus its
        start, which this waits for: a restart drawn next never kills one that has not listened yet; keep the
        replicas' timeout above both)."""
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
        time.sleep(down)
        self._serve('a')

    def __exit__(self, *exc):
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
        self.hosts.__exit__(*exc)


def chaos(opts):
    """The example in the fault-tolerant mode: unfaulted, then with a replica killed and restarted at random."""
    runs = {}
    for faulted in (False, True):
        rng = random.Random(opts.seed)
        if os.path.exists(os.path.join(OUT, 'chaos_model.pt')):
            os.remove(os.path.join(OUT, 'chaos_model.pt'))
        with (_Namespaces(opts.replicas) if opts.netns else _Loopback()) as net:
            names = {r: os.path.join(OUT, 'chaos_{}_r{}.log'.format('faulted' if faulted else 'clean', r))
                     for r in range(opts.replicas)}
            for name in names.values():
                open(name, 'w').close()
            logs = {r: open(names[r], 'a') for r in range(opts.replicas)}  # appended to by every restart
            procs = {r: _example(r, opts, net.address, logs[r], net.hosts) for r in range(opts.replicas)}
            survivor_pid, end = procs[0].pid, time.time() + 60 * opts.minutes

            def early(path=logs[0].name):  # kills stop at half the epochs: the last replacement heals in time
                with open(path) as f:
                    return len(re.findall(r"^epoch \d+/", f.read(), re.M)) < 0.5 * opts.epochs

            counts, ended = {kind: 0 for kind in opts.faults}, []

            def restart_if_ended(r, procs=procs, ended=ended, names=names, logs=logs, net=net):
                # a replica that ended (killed, or stopped saying why) starts again
                if procs[r].poll() is not None:
                    ended.append({'replica': r, 'returncode': procs[r].returncode, 'last_line': _last_line(names[r])})
                    procs[r] = _example(r, opts, net.address, logs[r], net.hosts)

            try:
                while faulted and procs[0].poll() is None and time.time() < end and early():
                    time.sleep(rng.uniform(opts.every / 2, opts.every * 1.5))
                    kind, victim = rng.choice(opts.faults), rng.randrange(1, opts.replicas)  # 0 is watched to the end
                    counts[kind] += 1
                    if kind == 'lighthouse':  # restarted on its address within the replicas' timeout: rejoined
                        net.restart_lighthouse(rng.uniform(0.5, 2))
                    elif kind == 'pause':  # frozen past the heartbeat: it heals mid-run, or stops saying why
                        _signal(procs[victim], signal.SIGSTOP)
                        time.sleep(opts.pause)
                        _signal(procs[victim], signal.SIGCONT)
                    else:
                        _signal(procs[victim], signal.SIGKILL)
                        time.sleep(rng.uniform(0.5, 3))
                        restart_if_ended(victim)
                        if kind == 'healer' and opts.replicas > 2:  # the replacement heals from 0 or the other
                            other = rng.choice([r for r in range(1, opts.replicas) if r != victim])
                            time.sleep(rng.uniform(0.5, 2.5))  # its start-up, then its heal, on this machine
                            _signal(procs[other], signal.SIGKILL)
                            time.sleep(rng.uniform(0.5, 3))
                            restart_if_ended(other)
                    time.sleep(opts.pause if kind == 'pause' else 0)
                    for r in range(1, opts.replicas):
                        restart_if_ended(r)
                procs[0].wait(timeout=1800)
                for p in procs.values():
                    p.wait(timeout=600)
            finally:
                for p in procs.values():
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            with open(names[0]) as f:
                text = f.read()
            saved = os.path.join(OUT, 'chaos_model.pt')  # by one replica; each compared its weights with the others'
            runs['faulted' if faulted else 'clean'] = {
                'val_acc': _last_val_acc(text), 'faults': counts if faulted else {}, 'ended_early': ended,
                'returncodes': [p.returncode for p in procs.values()],
                'replica0_never_restarted': procs[0].pid == survivor_pid,
                'final_weights': _digest(saved) if os.path.exists(saved) else None,
                # at the end of run() the last quorum compares its weights' fingerprints: exit 0 is agreement
                'bit_identical': all(p.returncode == 0 for p in procs.values())}
            print(runs, flush=True)
    runs['difference_points'] = round(100 * (runs['faulted']['val_acc'] - runs['clean']['val_acc']), 2)
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('what', choices=('cost', 'faults', 'chaos', 'worker'))
    add = parser.add_argument
    add('--mode', type=str, default='ft', help='worker: sync, sync-flat or ft')
    add('--modes', type=str, default=','.join(COST_MODES), help='cost: the modes compared, comma-separated, '
        'the first the baseline (sync: the fail-fast mode; sync-flat: it without overlap; ft: the Manager)')
    add('--link', type=str, default=None, choices=('100mbit', '1gbit', '10gbit', 'none'),
        help='cost: two namespace hosts on a link of this rate (none: unshaped); default loopback (root)')
    add('--host', type=str, default='127.0.0.1', help="worker: rank 0's address (the fail-fast mode's store)")
    add('--replica', type=int, default=0)
    add('--replicas', type=int, default=None)
    add('--model', type=str, default='cnn')
    add('--steps', type=int, default=60, help='steps per epoch per replica')
    add('--batch', type=int, default=32)
    add('--epochs', type=int, default=None)
    add('--lighthouse', type=str, default='')
    add('--port', type=int, default=0)
    add('--timeout', type=float, default=10.0)
    add('--min-replicas', type=int, default=1, help='worker: the fewest replicas a step trains with (cost: all)')
    add('--repeats', type=int, default=3)
    add('--kills', type=int, default=3)
    add('--every', type=float, default=6.0, help='seconds between kills')
    add('--down', type=float, default=2.0, help='seconds a killed replica stays down (faults)')
    add('--minutes', type=float, default=2.0)
    add('--seed', type=int, default=0)
    add('--netns', action='store_true', help='chaos: replica i on network-namespace host i (root)')
    add('--faults', type=str, default='kill', help='chaos: the faults drawn, comma-separated: kill (kill -9, then '
        'restart), pause (SIGSTOP for --pause s, then SIGCONT), healer (kill -9 and restart one, then kill its '
        'likely healer during the heal, and restart it), lighthouse (restart it on its address)')
    add('--local-steps', type=int, default=None, help="chaos: the example's DiLoCo meetings every H steps")
    add('--pause', type=float, default=8.0, help='chaos: seconds a paused replica stays stopped')
    add('--out', type=str, default=None, help='the result file (default: benchmarks/results/ft/WHAT.json, or '
        'cost_LINK_MODEL.json, which a new run overwrites: name another to keep the stored figures)')
    opts = parser.parse_args()
    if opts.what == 'worker':
        return _worker(opts)
    opts.replicas = opts.replicas or (2 if opts.what == 'cost' else 3)
    opts.faults = [kind for kind in opts.faults.split(',') if kind]
    if any(kind not in ('kill', 'pause', 'healer', 'lighthouse') for kind in opts.faults) or not opts.faults:
        parser.error('--faults takes kill, pause, healer and lighthouse, comma-separated, not {!r}'.format(
            ','.join(opts.faults)))
    opts.epochs = opts.epochs or {'cost': 1, 'faults': 1000, 'chaos': 5}[opts.what]  # faults: runs until killed
    os.makedirs(OUT, exist_ok=True)
    started, load_at_start = time.time(), os.getloadavg()
    result = {'cost': cost, 'faults': faults, 'chaos': chaos}[opts.what](opts)
    result.update(command=' '.join(['python', 'benchmarks/ft.py'] + sys.argv[1:]), seconds=round(time.time() - started),
                  load_average_at_start=load_at_start, load_average=os.getloadavg(), cpus=os.cpu_count())
    name = opts.what if not (opts.what == 'cost' and opts.link) else 'cost_{}_{}'.format(opts.link, opts.model)
    with open(opts.out or os.path.join(OUT, '{}.json'.format(name)), 'w') as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == '__main__':
    main()
