"""The fault-tolerant mode (torchft) measured: per-step cost, stall per failure, heal time, accuracy under chaos.

    python benchmarks/ft.py cost --model cnn --repeats 3   # ms per step: fail-fast mode against torchft's Manager
    python benchmarks/ft.py cost --model cnn1m --link 1gbit  # the same on two namespace hosts, a 1 Gbit/s link
    python benchmarks/ft.py faults --kills 3        # survivors' stall per kill -9, the replacement's heal time
    python benchmarks/ft.py chaos --minutes 2       # the example under random kills against no kills
    python benchmarks/ft.py groups --netns --ranks 2 --epochs 30 --seed 0   # replica groups: a rank killed

Every process runs on this machine over loopback, a lighthouse in this process; with ``--link`` (cost, as
root) replica i runs on network-namespace host i (benchmarks/netns.py), each host's sending side shaped
to that rate, the lighthouse on host 0; with ``--netns`` (chaos, groups) likewise, unshaped. Results (medians,
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
        """Each step's time (T lines); at the end, the median of its phases: from on_sample to the end of forward
        (the ft mode's quorum is taken in on_sample, or behind forward), backward (the buckets' waits), the update
        (the commit, the optimizer); and the CPU time of the whole process (every thread) per step after the
        warm-up. The ft mode's Manager rounds (``rounds``) are kept here too, and said once at the end with the
        phases, so that its steps write no more than the fail-fast mode's."""
        phases = {'forward': [], 'backward': [], 'update': []}
        rounds = {}  # name: each call's milliseconds (see timed)
        cpu, steps = None, 0  # the process's CPU seconds once 5 steps were taken (the warm-up), the steps taken

        def _mark(self, name):
            now = time.perf_counter()
            self.phases[name].append(now - self._last)
            self._last = now

        def on_sample(self, state):
            self._last = time.perf_counter()
            if self.steps == 5:  # the steps that _ms_per_step counts
                self.cpu = time.process_time()

        def on_forward(self, state):
            self._mark('forward')

        def on_backward(self, state):
            self._mark('backward')

        def on_step_training(self, state):
            self._mark('update')
            self.steps += 1
            print('T {:.4f} {} {}'.format(time.time(), state[torchbearer.EPOCH], state[torchbearer.BATCH]), flush=True)

        def on_end(self, state):
            medians = {k: 1000 * statistics.median(v[5:]) for k, v in self.phases.items() if len(v) > 5}
            medians.update((k, statistics.median(v[5:])) for k, v in self.rounds.items() if len(v) > 5)
            if self.cpu is not None and self.steps > 5:
                medians['cpu'] = 1000 * (time.process_time() - self.cpu) / (self.steps - 5)
            print('PHASES', ' '.join('{}={:.3f}'.format(k, v) for k, v in medians.items()), flush=True)

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
            times = Clock.rounds.setdefault(name, [])

            def wrapper(*a, **k):
                started = time.perf_counter()
                try:
                    return method(*a, **k)
                finally:
                    times.append(1000 * (time.perf_counter() - started))
            return wrapper
        torchft.Manager.start_quorum = timed('quorum', torchft.Manager.start_quorum)
        torchft.Manager.should_commit = timed('commit', torchft.Manager.should_commit)
        # what is left at the end of backward: the buckets not yet sent, every wait, the copy back
        FaultTolerantAllReduce.on_backward = timed('all_reduce', FaultTolerantAllReduce.on_backward)
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
    return subprocess.Popen(command, stdout=log or subprocess.PIPE, stderr=log or subprocess.PIPE, text=True,
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
                    lighthouse_cpu = shared.lighthouse_cpu() if shared else None
                    procs = [_start(mode, r, opts, net.address, port, hosts=net.hosts) for r in range(opts.replicas)]
                    outs, errs = zip(*(p.communicate(timeout=1800) for p in procs))
                    if shared and mode == 'ft':  # on the replicas' cores: a real one runs on a machine of its own
                        lighthouse_cpu = shared.lighthouse_cpu() - lighthouse_cpu
                if any(p.returncode for p in procs) or min(len(_times(out)) for out in outs) < 7:  # 5 skipped
                    raise RuntimeError('a {} run failed (exit codes {}):\n{}\n{}'.format(
                        mode, [p.returncode for p in procs], outs[0][-2000:], errs[0][-3000:]))
                ms = statistics.median(_ms_per_step(_times(out), skip=5) for out in outs)
                rows.append({'repeat': repeat, 'mode': mode, 'ms_per_step': round(ms, 2)})
                phases = [dict(item.split('=') for item in line.split()[1:]) for out in outs
                          for line in out.splitlines() if line.startswith('PHASES ')]
                for name in phases[0] if phases else ():  # the workers' median phase times, their median
                    rows[-1]['{}_ms'.format(name)] = round(statistics.median(float(p[name]) for p in phases), 3)
                if shared and mode == 'ft':
                    rows[-1]['lighthouse_cpu_ms'] = round(1000 * lighthouse_cpu / (opts.steps * opts.epochs), 3)
                print(rows[-1], flush=True)
    result = {'link': opts.link or 'loopback', 'model': opts.model, 'modes': modes, 'rows': rows}
    for mode in modes:
        result['{}_ms'.format(mode)] = statistics.median(r['ms_per_step'] for r in rows if r['mode'] == mode)
        cpu = [r['cpu_ms'] for r in rows if r['mode'] == mode and 'cpu_ms' in r]
        if cpu:  # a worker process's CPU per step, every thread: on two cores, what one mode adds slows the other
            result['{}_cpu_ms'.format(mode)] = statistics.median(cpu)
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


def _state_digest(state):
    """A short hash of a state dict's tensors, bit for bit, in the order of their sorted names."""
    import hashlib
    return hashlib.sha256(b''.join(state[k].detach().cpu().numpy().tobytes() for k in sorted(state))).hexdigest()[:16]


def _digest(path):
    import torch
    return _state_digest(torch.load(path, weights_only=True))


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
                env=dict(os.environ, PYTHONPATH=ROOT), start_new_session=True, stdout=log,
                stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while _serving(path) == started and self.server.poll() is None and time.monotonic() < end:
            time.sleep(0.1)

    def lighthouse_cpu(self):
        """Seconds of CPU the lighthouse process has used (every thread, from /proc: the package's own reader is
        private to it, see tests/test_layers.py)."""
        with open('/proc/{}/stat'.format(self.server.pid)) as f:
            fields = f.read().rsplit(')', 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')

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


# --- replica groups (issue 43): each host's torchrun job of k ranks is one replica ----------------------------------

def _probed_example(argv):
    """``ft.py example ARGS``: the example's ``main(ARGS)``, as it is, with lines of this benchmark's on each rank's
    output (the example prints and saves on one process only; these are what the benchmark reads per rank):
    ``START pid rank time`` as the process starts, ``T pid rank time epoch batch`` at each training step, and
    ``DIGEST pid rank heals hash`` of its model's weights after its last step, before the ranks compare theirs."""
    rank = os.environ.get('RANK', '0')

    def say(*fields):  # one write of a whole line: the ranks share torchrun's output, unbuffered
        sys.stdout.write(' '.join(str(field) for field in fields) + '\n')
        sys.stdout.flush()
    say('START', os.getpid(), rank, '{:.4f}'.format(time.time()))
    sys.path.insert(0, os.path.join(ROOT, 'examples'))
    import distributed_data_parallel as example
    import torchbearer
    from torchbearer import Callback

    import torchbearer_dist as tbd
    from torchbearer_dist.ft import FaultTolerantAllReduce

    class Clock(Callback):
        def on_step_training(self, state):
            epoch, batch = state[torchbearer.EPOCH], state[torchbearer.BATCH]
            say('T', os.getpid(), rank, '{:.4f}'.format(time.time()), epoch, batch)

    callbacks, agree = tbd.distributed_callbacks, FaultTolerantAllReduce._agree_at_end

    def distributed_callbacks(*args, **kwargs):  # the example's fault-tolerant list, the clock first
        return [Clock(), *callbacks(*args, **kwargs)]

    def agree_at_end(self, state):  # every rank of the last quorum, after the run's last step
        say('DIGEST', os.getpid(), rank, self.heals, _state_digest(state[torchbearer.MODEL].state_dict()))
        return agree(self, state)

    # Benchmark only: two attributes replaced in this process, the example's code untouched.
    tbd.distributed_callbacks, FaultTolerantAllReduce._agree_at_end = distributed_callbacks, agree_at_end
    return example.main(argv)


def _group_job(host, opts, net, log, save):
    """Host ``host``'s replica group: ``torchrun --standalone --nproc-per-node K --max-restarts R`` of the example
    (through :func:`_probed_example`) in that host's namespace, gloo on its link. Returns (process, command)."""
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', str(opts.ranks),
               '--max-restarts', str(opts.max_restarts), os.path.abspath(__file__), 'example', '--fault-tolerant',
               '--lighthouse', net.address, '--replica', str(host), '--replicas', str(opts.replicas), '--epochs',
               str(opts.epochs), '--seed', str(opts.seed), '--threads', '1', '--save', save]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=net.hosts.links[host])
    process = subprocess.Popen(net.hosts.command(host, command), stdout=log, stderr=log, text=True, env=env,
                               start_new_session=True, cwd=os.path.join(ROOT, 'examples'))
    return process, command


def _proc_table():
    """``{pid: (state, parent pid)}`` of every process, from /proc."""
    table = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open('/proc/{}/stat'.format(entry)) as f:
                    fields = f.read().rsplit(')', 1)[1].split()
                table[int(entry)] = (fields[0], int(fields[1]))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    return table


def _cmdline(pid):
    try:
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            return f.read().replace(b'\0', b' ').decode(errors='replace')
    except OSError:
        return ''


def _workers(agent):
    """The live (not zombie) torchrun workers under ``agent`` (the pid this benchmark started): the processes
    below it that run ``ft.py example`` and are not torchrun itself."""
    table, found, below = _proc_table(), [], {agent}
    grew = True
    while grew:  # every descendant (`ip netns exec` execs torchrun, which starts the workers)
        grew = False
        for pid, (_, parent) in table.items():
            if parent in below and pid not in below:
                below.add(pid)
                grew = True
    for pid in below - {agent}:
        line = _cmdline(pid)
        if table[pid][0] != 'Z' and ' example ' in line and 'torch.distributed.run' not in line:
            found.append(pid)
    return sorted(found)


def _local_rank(pid):
    """A torchrun worker's LOCAL_RANK, from its environment (None once it is gone)."""
    try:
        with open('/proc/{}/environ'.format(pid), 'rb') as f:
            env = dict(item.split(b'=', 1) for item in f.read().split(b'\0') if b'=' in item)
        return int(env[b'LOCAL_RANK'])
    except (OSError, KeyError, ValueError):
        return None


def _link_counters(hosts):
    """``[(tx_bytes, rx_bytes)]`` of each host's link, read inside its namespace (the kernel's counters, those of
    /sys/class/net/LINK/statistics there)."""
    counters = []
    for name, link in zip(hosts.namespaces, hosts.links):
        out = subprocess.run(['ip', '-n', name, '-s', '-j', 'link', 'show', 'dev', link], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        stats = json.loads(out)[0]['stats64']
        counters.append((stats['tx']['bytes'], stats['rx']['bytes']))
    return counters


def _tagged(text, tag):
    """The fields of every line of ``text`` that starts with ``tag``, after it."""
    return [line.split()[1:] for line in text.splitlines() if line.startswith(tag + ' ')]


def _stop_job(process, workers):
    """SIGSTOP torchrun's agent (it starts no other worker), then SIGKILL its session and each worker's (torchrun
    starts every worker in a session of its own): only what this benchmark started."""
    _signal(process, signal.SIGSTOP)
    for pid in set(workers) | set(_workers(process.pid) if process.poll() is None else ()):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _signal(process, signal.SIGKILL)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass


def _bytes_per_step(samples, steps, hosts):
    """What each host's link sent (and received) per step of host 0's rank 0 between the samples nearest to its
    steps at 20 % and 90 % of the run (steady training, epochs' validation included)."""
    if len(steps) < 20:
        return None
    low, high = steps[len(steps) // 5], steps[9 * len(steps) // 10]
    inside = [s for s in samples if low <= s[0] <= high]
    if len(inside) < 2:
        return None
    (t1, first), (t2, last) = inside[0], inside[-1]
    count = sum(1 for t in steps if t1 < t <= t2)
    return {'steps': count, 'seconds': round(t2 - t1, 2),
            'tx_bytes_per_step': [round((last[h][0] - first[h][0]) / count) for h in range(hosts)],
            'rx_bytes_per_step': [round((last[h][1] - first[h][1]) / count) for h in range(hosts)]}


def _groups_run(opts, faulted):
    """One run of the example, replica group h (a torchrun job of ``opts.ranks`` ranks) on namespace host h; with
    ``faulted``, one rank of host 1's group SIGKILLed once both groups are ``--kill-epoch`` epochs in."""
    kind = 'faulted' if faulted else 'clean'
    rng = random.Random(opts.seed)
    victim_rank, delay = rng.randrange(opts.ranks), rng.uniform(0, 2)  # which rank; seconds into the epoch
    save = os.path.join(OUT, 'groups_model.pt')  # written by one rank: the first of the last quorum
    if os.path.exists(save):
        os.remove(save)
    name = 'groups_{}_r{}_min{}_seed{}'.format(kind, opts.ranks, opts.lighthouse_min, opts.seed)
    paths = {h: os.path.join(OUT, '{}_h{}.log'.format(name, h)) for h in range(opts.replicas)}  # kept per run
    load_at_start, started = os.getloadavg(), time.time()
    jobs, commands, seen, samples, kill, due = {}, {}, {h: {} for h in paths}, [], None, None
    # By default the lighthouse takes a quorum of every replica: the groups start together (neither trains alone
    # first), and after the kill host 0's group waits for host 1's to come back (its stall is the whole outage);
    # --lighthouse-min 1: host 0's group trains on alone meanwhile, but the groups may start apart.
    with _Namespaces(opts.replicas, None, min_replicas=opts.lighthouse_min) as net:
        logs = {h: open(path, 'a') for h, path in paths.items()}
        try:
            for h, log in logs.items():
                log.truncate(0)
                jobs[h], commands[h] = _group_job(h, opts, net, log, save)
            end = started + 60 * opts.run_minutes
            while any(job.poll() is None for job in jobs.values()):
                now = time.time()
                if now > end:
                    raise RuntimeError('the {} run did not end within {} minutes: see {}'.format(
                        kind, opts.run_minutes, ', '.join(paths.values())))
                for h, job in jobs.items():
                    for pid in _workers(job.pid):
                        seen[h].setdefault(pid, now)
                samples.append((now, _link_counters(net.hosts)))
                if faulted and kill is None:
                    epochs = []
                    for path in paths.values():
                        with open(path) as f:
                            epochs.append(len(re.findall(r'^epoch \d+/', f.read(), re.M)))
                    if due is None and min(epochs) >= opts.kill_epoch:
                        due = now + delay
                    if due is not None and now >= due:
                        victims = [pid for pid in _workers(jobs[1].pid) if _local_rank(pid) == victim_rank]
                        if victims:  # one rank of host 1's group, a torchrun worker (not the agent)
                            os.kill(victims[0], signal.SIGKILL)
                            kill = {'time': time.time(), 'pid': victims[0], 'local_rank': victim_rank,
                                    'host0_epochs_printed': epochs[0], 'host1_epochs_printed': epochs[1]}
                            print('killed', kill, flush=True)
                time.sleep(0.5)
            samples.append((time.time(), _link_counters(net.hosts)))
        finally:
            for h, job in jobs.items():
                _stop_job(job, seen[h])
            for log in logs.values():
                log.close()
    texts = {}
    for h, path in paths.items():
        with open(path) as f:
            texts[h] = f.read()
    first = {h: sorted(pid for pid, at in seen[h].items() if at == min(seen[h].values())) for h in seen if seen[h]}
    steps = {h: _tagged(texts[h], 'T') for h in texts}  # pid, rank, time, epoch, batch
    starts = {h: _tagged(texts[h], 'START') for h in texts}  # pid, rank, time
    digests = [{'host': h, 'pid': int(d[0]), 'rank': int(d[1]), 'heals': int(d[2]), 'digest': d[3]}
               for h in texts for d in _tagged(texts[h], 'DIGEST')]
    final = {h: [line for line in texts[h].splitlines() if re.match(r'epoch {}/{}:'.format(opts.epochs, opts.epochs),
                                                                        line)] for h in texts}
    saved = _digest(save) if os.path.exists(save) else None
    host0_pids = {int(s[0]) for s in starts[0]}
    run = {'kind': kind, 'returncodes': [jobs[h].returncode for h in sorted(jobs)],
           'val_acc': [_last_val_acc(texts[h]) for h in sorted(texts)],
           'final_epoch_lines': [final[h][-1] if final[h] else None for h in sorted(final)],
           'digests': digests, 'saved_model_digest': saved,
           'workers_seen': {h: sorted(seen[h]) for h in seen},
           'host0_workers_never_changed': sorted(seen[0]) == first.get(0) == sorted(host0_pids) and
           len(host0_pids) == opts.ranks and {d['pid'] for d in digests if d['host'] == 0} == host0_pids,
           # the package's lines (a dropped step, a heal) and the example's errors, each host's
           'events': ['host {}: {}'.format(h, line[:240]) for h in texts for line in texts[h].splitlines()
                      if 'torchbearer_dist:' in line or line.startswith('error:') or 'failed (exitcode' in line][:30],
           'commands': {h: ' '.join(net.hosts.command(h, commands[h])) for h in commands},
           # what each host runs, but for ft.py's lines (ft.py example: the example's main() with START, T, DIGEST)
           'example_command': 'torchrun --standalone --nproc-per-node {} --max-restarts {} '
                              'examples/distributed_data_parallel.py --fault-tolerant --lighthouse HOST0:29510 '
                              '--replica H --replicas {} --epochs {} --seed {} --threads 1'.format(
                                  opts.ranks, opts.max_restarts, opts.replicas, opts.epochs, opts.seed),
           'lighthouse': 'python -m torchbearer_dist.ft --bind 0.0.0.0:29510 --heartbeat-timeout 2 --min-replicas '
                         '{} (on host 0)'.format(opts.lighthouse_min),
           'seconds': round(time.time() - started), 'load_average_at_start': load_at_start,
           'load_average': os.getloadavg()}
    run['last_val_acc'] = run['val_acc'][0]
    run['bit_identical'] = (len(digests) == opts.ranks * opts.replicas and len({d['digest'] for d in digests}) == 1
                            and saved == digests[0]['digest'] and not any(run['returncodes']))
    lines = run['final_epoch_lines']  # printed by each group's rank 0: the global figures
    run['final_epoch_lines_identical'] = len(set(lines)) == 1 and None not in lines
    host0 = sorted(float(t[2]) for t in steps[0] if t[1] == '0')
    if not faulted:
        run['link'] = _bytes_per_step(samples, host0, opts.replicas)
    elif kill is not None:
        killed = kill['time']
        gaps = list(zip(host0, host0[1:]))
        typical = statistics.median([b - a for a, b in gaps if b < killed][-20:])
        longest = max((g for g in gaps if g[1] >= killed), key=lambda g: g[1] - g[0], default=None)
        new = [s for s in starts[1] if float(s[2]) > killed]
        new_pids = {s[0] for s in new}
        resumed = sorted(float(t[2]) for t in steps[1] if t[0] in new_pids)
        at = [[int(t[3]), int(t[4])] for t in steps[0] if t[1] == '0' and float(t[2]) <= killed]
        run['kill'] = dict(kill, time=round(killed, 3), host0_last_step=at[-1] if at else None)  # epoch, batch
        run['host0_typical_step_ms'] = round(1000 * typical, 1)
        run['host0_stall_s'] = round(longest[1] - longest[0] - typical, 2) if longest else None
        run['host0_resumed_after_kill_s'] = round(longest[1] - killed, 2) if longest else None
        run['group1_restarted_after_s'] = round(min(float(s[2]) for s in new) - killed, 2) if new else None
        run['heal_s'] = round(resumed[0] - killed, 2) if resumed else None  # kill to the new group's first step
        run['group1_start_to_first_step_s'] = round(resumed[0] - min(float(s[2]) for s in new), 2) \
            if new and resumed else None
        run['group1_new_ranks_heals'] = sorted(d['heals'] for d in digests if d['host'] == 1 and str(d['pid']) in
                                                new_pids)
    print({k: v for k, v in run.items() if k not in ('commands', 'digests', 'workers_seen')}, flush=True)
    return run


def groups(opts):
    """The example's replica groups on two namespace hosts: unfaulted, then with one rank of host 1's group killed.

    Host h runs ``torchrun --standalone --nproc-per-node K --max-restarts 3`` of the example (``--fault-tolerant
    --replica h --replicas 2 --threads 1``, gloo on the host's link), the lighthouse on host 0 with ``--min-replicas
    2``. The faulted run SIGKILLs one worker of host 1 (the local rank drawn from the seed) once both groups have
    printed ``--kill-epoch`` epochs; host 1's torchrun starts its group again, which heals from host 0's. Each run
    records the last test accuracy, every rank's weights' digest and the writer's saved model, the workers' pids;
    the unfaulted run what each host's link sent per step, the faulted one host 0's stall and the heal time.
    """
    runs = {'clean': _groups_run(opts, False)}
    if not opts.no_fault:
        runs['faulted'] = _groups_run(opts, True)
        runs['difference_points'] = round(100 * (runs['faulted']['last_val_acc'] - runs['clean']['last_val_acc']), 2)
    runs.update(ranks=opts.ranks, replicas=opts.replicas, epochs=opts.epochs, seed=opts.seed,
                lighthouse_min_replicas=opts.lighthouse_min, revision=_revision())
    return runs


def _revision():
    """The commit the measured package and example come from, '+edits' where they differ from it."""
    def git(*args):
        return subprocess.run(['git', '-C', ROOT, *args], capture_output=True, text=True, timeout=30).stdout.strip()
    commit = git('rev-parse', '--short', 'HEAD')
    return commit + ('+edits' if git('status', '--porcelain', '--', 'torchbearer_dist', 'examples') else '') \
        if commit else None


def _groups_summary():
    """benchmarks/results/ft/groups_netns_seeds.json: every seed's groups run of 2 ranks a group, the accuracy
    difference's mean and 95 % t-interval, and the bytes per step with groups of 1 and of 2 ranks."""
    from diloco_accuracy import interval
    found = {}
    for name in sorted(os.listdir(OUT)):
        match = re.match(r'groups_netns(_r(\d+))?_seed(\d+)\.json$', name)
        if match:
            with open(os.path.join(OUT, name)) as f:
                found[(int(match.group(2) or 2), int(match.group(3)))] = json.load(f)
    seeds = []
    for (ranks, seed), run in sorted(found.items()):
        if ranks == 2 and 'faulted' in run:
            faulted = run['faulted']
            seeds.append({'seed': seed, 'clean_acc': run['clean']['last_val_acc'],
                          'faulted_acc': faulted['last_val_acc'], 'difference_points': run['difference_points'],
                          'bit_identical': [run['clean']['bit_identical'], faulted['bit_identical']],
                          'host0_workers_never_changed': faulted['host0_workers_never_changed'],
                          'killed_local_rank': faulted.get('kill', {}).get('local_rank'),
                          'host0_stall_s': faulted.get('host0_stall_s'), 'heal_s': faulted.get('heal_s'),
                          # no step lost: the faulted run's weights are the unfaulted run's, bit for bit
                          'faulted_weights_equal_unfaulted': faulted['saved_model_digest'] is not None and
                          faulted['saved_model_digest'] == run['clean']['saved_model_digest'],
                          'returncodes': [run['clean']['returncodes'], faulted['returncodes']],
                          'seconds': run['seconds'],
                          'load_average': [run['load_average_at_start'], run['load_average']]})
    summary = {'seeds': seeds}
    if seeds:
        mean, low, high = interval([s['difference_points'] for s in seeds])
        summary['difference_points'] = {'mean': round(mean, 2), 'ci95': None if len(seeds) < 2 else
                                        [round(low, 2), round(high, 2)]}
    for ranks in sorted({r for r, _ in found}):
        links = [run['clean']['link'] for (r, _), run in sorted(found.items())
                 if r == ranks and run['clean'].get('link')]
        if links:
            summary['bytes_per_step_ranks{}'.format(ranks)] = {
                'tx': [statistics.median(link['tx_bytes_per_step'][h] for link in links) for h in range(2)],
                'rx': [statistics.median(link['rx_bytes_per_step'][h] for link in links) for h in range(2)],
                'runs': len(links)}
    one, two = summary.get('bytes_per_step_ranks1'), summary.get('bytes_per_step_ranks2')
    if one and two:  # the claim: a host sends a single-rank replica's bytes, split over its ranks
        summary['tx_ratio_ranks2_over_ranks1'] = [round(b / a, 4) for a, b in zip(one['tx'], two['tx'])]
    with open(os.path.join(OUT, 'groups_netns_seeds.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    return summary


def main():
    if sys.argv[1:2] == ['example']:  # a rank of groups' torchrun jobs: the example with this benchmark's lines
        return _probed_example(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('what', choices=('cost', 'faults', 'chaos', 'groups', 'worker'))
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
    add('--steps', type=int, default=None, help='steps per epoch per replica (cost: 300, else 60)')
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
    add('--netns', action='store_true', help='chaos, groups: replica i on network-namespace host i (root)')
    add('--ranks', type=int, default=2, help='groups: ranks per replica group (torchrun --nproc-per-node)')
    add('--max-restarts', type=int, default=3, help="groups: torchrun's restarts of a group")
    add('--kill-epoch', type=int, default=3, help="groups: kill a rank of host 1's group once both groups printed "
        'this many epochs (plus 0-2 s drawn from the seed)')
    add('--lighthouse-min', type=int, default=None, help="groups: the lighthouse's --min-replicas (default: all, "
        'so that the groups start together; 1: a group trains on alone while the other is down)')
    add('--run-minutes', type=float, default=20.0, help='groups: a run still going after this long is stopped')
    add('--no-fault', action='store_true', help='groups: the unfaulted run only (what the links send per step)')
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
    opts.replicas = opts.replicas or (2 if opts.what in ('cost', 'groups') else 3)
    if opts.what == 'groups' and not opts.netns:
        parser.error('groups measures what each host sends: it needs --netns (two namespace hosts, as root)')
    opts.lighthouse_min = opts.lighthouse_min or opts.replicas
    opts.faults = [kind for kind in opts.faults.split(',') if kind]
    if any(kind not in ('kill', 'pause', 'healer', 'lighthouse') for kind in opts.faults) or not opts.faults:
        parser.error('--faults takes kill, pause, healer and lighthouse, comma-separated, not {!r}'.format(
            ','.join(opts.faults)))
    opts.epochs = opts.epochs or {'cost': 1, 'faults': 1000, 'chaos': 5, 'groups': 20}[opts.what]  # faults: to a kill
    opts.steps = opts.steps or (300 if opts.what == 'cost' else 60)  # cost: a 5 % difference above the noise
    os.makedirs(OUT, exist_ok=True)
    started, load_at_start = time.time(), os.getloadavg()
    result = {'cost': cost, 'faults': faults, 'chaos': chaos, 'groups': groups}[opts.what](opts)
    result.update(command=' '.join(['python', 'benchmarks/ft.py'] + sys.argv[1:]), seconds=round(time.time() - started),
                  load_average_at_start=load_at_start, load_average=os.getloadavg(), cpus=os.cpu_count())
    name = opts.what if not (opts.what == 'cost' and opts.link) else 'cost_{}_{}'.format(opts.link, opts.model)
    if opts.what == 'groups':
        name = 'groups_netns{}{}_seed{}'.format('' if opts.ranks == 2 else '_r{}'.format(opts.ranks),
                                                '' if opts.lighthouse_min == opts.replicas else
                                                '_min{}'.format(opts.lighthouse_min), opts.seed)
    with open(opts.out or os.path.join(OUT, '{}.json'.format(name)), 'w') as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if opts.what == 'groups' and not opts.out:  # every seed's file so far, and the interval over them
        print(json.dumps(_groups_summary(), indent=1))


if __name__ == '__main__':
    main()
