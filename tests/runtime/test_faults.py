"""Faults end cleanly: bounded time, a one-line cause, nothing left running (issue 4).

Every test runs real processes over gloo on loopback. Hand-started ranks run this file as a script
(``python tests/runtime/test_faults.py --rank i ...``, see :func:`main`), as a user starts one rank per machine;
each runs in its own session, and the session is killed by pgid in ``finally``. Each test asserts the
time bound, the message (the rank, the cause and the fix), and that nothing is left running with the
master port bindable again.
"""
import argparse
import faulthandler
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

#: Collective timeout of the hand-started ranks, seconds: long, so that only the heartbeat and the
#: published causes can end a faulty job fast.
TIMEOUT = 60
#: Their rendezvous timeout, seconds: also how long a silent peer may go without a heartbeat.
RENDEZVOUS_TIMEOUT = 5

# tests/, for the shared helpers: pytest's conftest puts it on sys.path, but not a script run of this
# file, nor the ranks that launch() spawns from one (they import it as __mp_main__).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ != '__main__':  # as a script (one hand-started rank) torch is imported only in main()
    from torchbearer_dist.runtime import rendezvous

    from _dist import CAUSE_WAIT, ROOT, STARTUP, child_env, free_port, kill_session, launch_workers, run_command
    from _netns import TwoHosts

    #: Seconds between heartbeats (watchdog.py).
    BEAT = 1
    #: A dead peer ends the job: at worst its heartbeat is missed, then the cause is read.
    DEAD_PEER_BOUND = RENDEZVOUS_TIMEOUT + BEAT + CAUSE_WAIT
    #: Ctrl-C on a rank inside a collective: the watcher's grace (interrupts.py), then the cause is read.
    INTERRUPT_GRACE = 2
    STOP_BOUND = INTERRUPT_GRACE + CAUSE_WAIT + BEAT
    #: launch()'s grace between SIGTERM and SIGKILL, plus a second for the kernel to reap.
    LAUNCH_STOP_BOUND = 3 + 1
HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------------------------------
# The hand-started rank: a small Trial with the package's callbacks and an injected fault.

def _build_trial(args):
    import torch
    import torchbearer
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchbearer import Callback, Trial

    import torchbearer_dist as tbd

    class Fault(Callback):
        """Inject ``args.fault`` on ``args.fault_rank`` at training (or validation) batch ``args.at``."""

        def __init__(self):
            super().__init__()
            self.steps = 0

        def _maybe(self, state, where):
            rank = tbd.get_rank()
            if where == 'train':
                self.steps += 1
                if self.steps == 2:
                    print('ready', flush=True)
            if rank != args.fault_rank or not args.fault.endswith('-' + where):
                return
            if state[torchbearer.EPOCH] != args.epoch or state[torchbearer.BATCH] != args.at:
                return
            kind = args.fault.split('-')[0]
            print('fault', flush=True)
            if kind == 'raise':
                raise ValueError('boom in {} on rank {}'.format('training' if where == 'train' else 'validation',
                                                                rank))
            if kind == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == 'sleep':
                print('sleeping', flush=True)
                time.sleep(600)
            if kind == 'loader':  # a real DataLoader timeout: this rank's own error, whose text says "timed out"
                next(iter(DataLoader(_Slow(), num_workers=1, timeout=0.5)))

        def on_step_training(self, state):
            self._maybe(state, 'train')

        def on_step_validation(self, state):
            self._maybe(state, 'val')

    class _Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            time.sleep(30)
            return torch.zeros(1)

    torch.manual_seed(0)
    x, y = torch.randn(512, 8), torch.randint(0, 2, (512,))
    train = TensorDataset(x[:384], y[:384])
    val = TensorDataset(x[384:], y[384:])
    world = tbd.get_world_size()
    rank = tbd.get_rank()
    train_loader = DataLoader(train, batch_size=8, sampler=DistributedSampler(train, world, rank, seed=0))
    val_loader = DataLoader(val, batch_size=8, sampler=DistributedSampler(val, world, rank, shuffle=False))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = [Fault(), *tbd.distributed_callbacks()]
    if args.step_delay:
        callbacks.insert(0, torchbearer.callbacks.on_step_training(lambda state: time.sleep(args.step_delay)))
    trial = Trial(model, optimizer, torch.nn.functional.cross_entropy, metrics=['loss'], callbacks=callbacks,
                  verbose=0)
    return trial.with_generators(train_loader, val_generator=val_loader)


def _deadlock(args):
    """Both ranks wait in ``recv`` for each other: blocked mid-collective until the timeout."""
    import torch
    import torch.distributed as dist
    print('ready', flush=True)
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def _launched_deadlock():
    _deadlock(None)


def _fail_first_attempt():
    """Under torchrun: rank 1 raises in the first attempt; every attempt all-reduces first."""
    import torch
    import torch.distributed as dist
    attempt = os.environ['TORCHELASTIC_RESTART_COUNT']
    total = torch.ones(1)
    dist.all_reduce(total)
    if attempt == '0' and dist.get_rank() == 1:
        raise ValueError('fails in the first attempt')
    dist.all_reduce(total)
    print('attempt {} rank {} ok {:g}'.format(attempt, dist.get_rank(), total.item()), flush=True)


def main(argv=None):
    """Run one rank by hand, as a user does on each machine; print the error in one line and exit 1.

    With ``--launch N`` start N local ranks with :func:`torchbearer_dist.launch` instead, each blocked
    in a collective.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument('--rank', type=int, default=0)
    parser.add_argument('--launch', type=int, default=0)
    parser.add_argument('--torchrun', action='store_true')
    parser.add_argument('--world-size', type=int, default=2)
    parser.add_argument('--host', type=str, default='127.0.0.1')
    parser.add_argument('--port', type=int, default=None)
    parser.add_argument('--timeout', type=float, default=TIMEOUT)
    parser.add_argument('--rendezvous-timeout', type=float, default=RENDEZVOUS_TIMEOUT)
    parser.add_argument('--fault', type=str, default='none')
    parser.add_argument('--fault-rank', type=int, default=1)
    parser.add_argument('--epoch', type=int, default=0)
    parser.add_argument('--at', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--step-delay', type=float, default=0.0)
    args = parser.parse_args(argv)
    os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')  # one line per error, as the example does
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack: why a rank hangs
    import torch
    torch.set_num_threads(1)
    import torchbearer_dist as tbd
    if args.torchrun:
        with tbd.process_group(backend='gloo', timeout=args.timeout):
            _fail_first_attempt()
        return
    if args.launch:
        try:
            tbd.launch(_launched_deadlock, args.launch, port=args.port, timeout=args.timeout,
                       rendezvous_timeout=args.rendezvous_timeout)
        except KeyboardInterrupt:
            print('error: interrupted', file=sys.stderr, flush=True)
            sys.exit(130)
        return
    tbd.watch_interrupts()  # a command line owns its process, as the example's does
    try:
        with tbd.process_group(rank=args.rank, world_size=args.world_size, host=args.host, port=args.port,
                               backend='gloo', timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout):
            if args.fault == 'deadlock':
                _deadlock(args)
            else:
                history = _build_trial(args).run(args.epochs)
                print('done {} epochs'.format(len(history)), flush=True)
    except KeyboardInterrupt:
        print('error: interrupted', file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as error:
        print('error: {}'.format(error), file=sys.stderr, flush=True)
        sys.exit(1)


# --------------------------------------------------------------------------------------------------
# Helpers of the tests.

def _start_rank(rank, port, *extra, world_size=2, host='127.0.0.1', timeout=TIMEOUT, env=None):
    command = [sys.executable, HERE, '--rank', str(rank), '--world-size', str(world_size), '--host', host,
               '--port', str(port), '--timeout', str(timeout), *map(str, extra)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env() if env is None else env, cwd=ROOT)


def _wait_for_line(process, text, timeout=60):
    """Read ``process``'s stdout until a line equals ``text``; fail on exit or at the deadline."""
    deadline = time.monotonic() + timeout
    fd = process.stdout.fileno()
    seen = b''
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
            if text.encode() in seen.splitlines():
                return
    process.poll()
    raise AssertionError('no line {!r} from pid {} (rc {}): {}'.format(text, process.pid, process.returncode,
                                                                     seen.decode(errors='replace')))


def _wait_all(processes, timeout, said=None):
    """Wait for every process; return (seconds until the last one ended, [(rc, stderr)]); fail at the deadline.

    With ``said`` (a dict), also note for each process the seconds until its first ``error:`` line.
    """
    started = time.monotonic()
    deadline = started + timeout
    errors = {p.stderr.fileno(): [p, b''] for p in processes}
    try:
        while errors or [p.poll() for p in processes].count(None):
            if time.monotonic() > deadline:
                running = [p.pid for p in processes if p.poll() is None]
                raise AssertionError('pids {} still running {:g} s later; stderr so far: {}'.format(
                    running, timeout, [seen.decode(errors='replace') for _, seen in errors.values()]))
            for fd in select.select(list(errors), [], [], 0.02)[0]:
                chunk = os.read(fd, 4096)
                process, seen = errors[fd]
                errors[fd][1] = seen + chunk
                if said is not None and b'error: ' in seen + chunk and process not in said:
                    said[process] = time.monotonic() - started
                if not chunk:
                    process.stderr_text = errors.pop(fd)[1].decode(errors='replace')
        elapsed = time.monotonic() - started
        return elapsed, [(p.returncode, p.stderr_text) for p in processes]
    finally:
        for process in processes:
            kill_session(process.pid)


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith('error: ')]


def _session_alive(sid):
    """pids of the processes whose session id is ``sid``."""
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open('/proc/{}/stat'.format(entry)) as f:
                    fields = f.read().rsplit(')', 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != 'Z':
                found.append(int(entry))
    return found


def _assert_gone(processes, port, within=None):
    """No process of the sessions of ``processes`` is left, and ``port`` binds again on 127.0.0.1."""
    deadline = time.monotonic() + (STOP_BOUND if within is None else within)
    while time.monotonic() < deadline and any(_session_alive(p.pid) for p in processes):
        time.sleep(0.05)
    left = {p.pid: _session_alive(p.pid) for p in processes if _session_alive(p.pid)}
    assert not left, 'processes left behind: {}'.format(left)
    _assert_port_free(port)


def _assert_port_free(port):
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(('127.0.0.1', port))
        sock.listen(1)


def _kill_all(processes):
    for process in processes:
        kill_session(process.pid)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (process.stdout, process.stderr):
            stream.close()


# --------------------------------------------------------------------------------------------------
# 1. Dead peer: a rank raises in a callback or is SIGKILLed, in training or in validation.

DEAD_PEER = [
    ('raise-train', 1, r'^error: rank 1 failed: ValueError: boom in training on rank 1 \(rank 0 stopped\)$'),
    ('raise-val', 1, r'^error: rank 1 failed: ValueError: boom in validation on rank 1 \(rank 0 stopped\)$'),
    ('kill-train', 1, r'^error: rank 1 died without reporting an error: it was killed .*\(rank 0 stopped\)'),
    ('kill-val', 1, r'^error: rank 1 died without reporting an error: it was killed .*\(rank 0 stopped\)'),
    ('raise-train', 0, r'^error: rank 0 failed: ValueError: boom in training on rank 0 \(rank 1 stopped\)$'),
    ('kill-train', 0, r'^error: rank 0 \(the master at 127\.0\.0\.1:\d+\) is gone.*\(rank 1 stopped\)'),
]


@pytest.mark.slow
@pytest.mark.parametrize('fault, fault_rank, message', DEAD_PEER,
                         ids=['raise-train', 'raise-val', 'kill-train', 'kill-val', 'rank0-raise', 'rank0-kill'])
def test_dead_peer_stops_every_rank_with_its_cause(fault, fault_rank, message):
    port = free_port()
    ranks = [_start_rank(r, port, '--fault', fault, '--fault-rank', fault_rank) for r in range(2)]
    try:
        # The fault fires at batch 3: measure from the moment it fires.
        _wait_for_line(ranks[fault_rank], 'fault', timeout=90)
        said = {}
        elapsed, results = _wait_all(ranks, DEAD_PEER_BOUND + 5, said)
        (rc_failed, err_failed), (rc, err) = results[fault_rank], results[1 - fault_rank]
        print('rank {} said its error {:.2f} s after the fault on rank {}, all ended after {:.2f} s: {}'.format(
            1 - fault_rank, said.get(ranks[1 - fault_rank], float('nan')), fault_rank, elapsed, _error_lines(err)))
        assert rc == 1, err
        assert elapsed < DEAD_PEER_BOUND, (elapsed, err)
        lines = _error_lines(err)
        assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
        assert re.search(message, lines[0]), lines[0]
        assert rc_failed == (-signal.SIGKILL if fault.startswith('kill') else 1), err_failed
        if fault.startswith('raise'):
            assert _error_lines(err_failed) == ['error: boom in {} on rank {}'.format(
                'training' if fault.endswith('train') else 'validation', fault_rank)], err_failed
        _assert_gone(ranks, port)
    finally:
        _kill_all(ranks)


@pytest.mark.slow
def test_local_error_that_says_timed_out_is_that_ranks_error_not_a_dead_host():
    port = free_port()
    ranks = [_start_rank(r, port, '--fault', 'loader-train') for r in range(2)]
    try:
        _wait_for_line(ranks[1], 'fault', timeout=90)
        said = {}
        elapsed, results = _wait_all(ranks, DEAD_PEER_BOUND + 5, said)
        print('rank 1 DataLoader timeout: rank 0 said its error after {:.2f} s: {}'.format(
            said.get(ranks[0], float('nan')), [r[1] for r in results]))
        assert _error_lines(results[1][1]) == ['error: DataLoader timed out after 0.5 seconds'], results[1]
        assert _error_lines(results[0][1]) == ['error: rank 1 failed: RuntimeError: DataLoader timed out after 0.5 '
                                               'seconds (rank 0 stopped)'], results[0]
        assert [rc for rc, _ in results] == [1, 1]
    finally:
        _kill_all(ranks)


def _raise_on_rank_1():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError('bad batch on rank 1')
    dist.all_reduce(torch.ones(1))


@pytest.mark.slow
def test_launcher_reraises_the_root_cause_once():
    # The deadline, not pytest.raises, fails a slow run: it raises RuntimeError('... still running ...').
    with pytest.raises(ValueError, match=r'^rank 1 failed: bad batch on rank 1$'):
        launch_workers(_raise_on_rank_1, 2, timeout=TIMEOUT, rendezvous_timeout=RENDEZVOUS_TIMEOUT,
                    deadline=STARTUP + DEAD_PEER_BOUND)


# --------------------------------------------------------------------------------------------------
# 4. Bad rendezvous.

def _init(**kwargs):
    import torchbearer_dist as tbd
    options = dict(host='127.0.0.1', backend='gloo', timeout=3)
    options.update(kwargs)
    return tbd.init_process_group(**options)


def _listening(port):
    sock = socket.socket()
    sock.bind(('127.0.0.1', port))
    sock.listen(16)
    return sock


def test_taken_port_names_the_port_and_its_holder():
    port = free_port()
    with _listening(port):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r'^port {} on 127\.0\.0\.1 is already in use \(held by pid {}: .*\); '
                                               r'pass a free --port'.format(port, os.getpid())):
            _init(rank=0, world_size=2, port=port)
        assert time.monotonic() - started < rendezvous._SCAN_SECONDS + BEAT  # the scan for the holder is bounded
    _assert_port_free(port)


def test_nothing_listening_names_host_and_port():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r'^cannot reach the master at 127\.0\.0\.1:{} within 2 s \(.*\); check '
                                           r'that rank 0 is running there'.format(port)):
        _init(rank=1, world_size=2, port=port, timeout=2)
    elapsed = time.monotonic() - started
    print('unreachable master: {:.2f} s'.format(elapsed))
    assert elapsed < 2 * 1.5 + 5 + 2


@pytest.mark.parametrize('rank', [0, 1])
def test_unresolvable_name_names_host_and_port(monkeypatch, rank):
    # Resolution is faked: a real lookup of a bad name would query this machine's DNS server.
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == 'no-such-master.invalid':
            raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, 'getaddrinfo', getaddrinfo)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r'^cannot resolve the master address no-such-master\.invalid:29999 '
                                           r'\(Name or service not known\); (check|pass) --host'):
        _init(rank=rank, world_size=2, host='no-such-master.invalid', port=29999)
    assert time.monotonic() - started < 3  # before _init's 3 s rendezvous timeout: no network wait


def test_silent_listener_hits_our_deadline():
    """torch alone hangs here for ever: the port accepts connections and never answers."""
    port = free_port()
    with _listening(port):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r'^the master at 127\.0\.0\.1:{} accepted the connection but did not '
                                               r'answer as a torch\.distributed store within 2 s: another program '
                                               r'holds that port; check --host and --port'.format(port)):
            _init(rank=1, world_size=2, port=port, timeout=2)
        elapsed = time.monotonic() - started
    print('silent listener: {:.2f} s'.format(elapsed))
    assert elapsed < 2 * 1.5 + 5 + 2
    _assert_port_free(port)


@pytest.mark.slow
def test_stale_job_on_the_port_is_refused_and_left_unharmed():
    port = free_port()
    old = [_start_rank(r, port, '--epochs', 3, '--step-delay', 0.05) for r in range(2)]
    try:
        _wait_for_line(old[0], 'ready', timeout=90)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r'^rank 1 is already taken by another process \(\S+ pid {} world_size 2'
                                               r'\) at 127\.0\.0\.1:{}: give each process a distinct --rank, or stop '
                                               r'the stale job'.format(old[1].pid, port)):
            _init(rank=1, world_size=2, port=port, timeout=5)
        with pytest.raises(RuntimeError, match=r'^port {} on 127\.0\.0\.1 is already in use \(held by pid {}:'.format(
                port, old[0].pid)):
            _init(rank=0, world_size=2, port=port, timeout=5)
        assert time.monotonic() - started < 2 * 5  # neither waited out its 5 s timeout
        _, results = _wait_all(old, 90)
        for rank, (rc, err) in enumerate(results):
            assert rc == 0, 'the old job was harmed: rank {}: {}{}'.format(rank, old[rank].stdout.read(), err)
        assert old[0].stdout.read().splitlines()[-1] == 'done 3 epochs'
        _assert_gone(old, port)
    finally:
        _kill_all(old)


@pytest.mark.slow
def test_world_size_disagreement_fails_before_training_naming_both():
    port = free_port()
    ranks = [_start_rank(0, port, world_size=2), _start_rank(1, port, world_size=3)]
    try:
        elapsed, results = _wait_all(ranks, 60)
        print('world-size mismatch: {:.2f} s including start-up: {}'.format(elapsed, [r[1] for r in results]))
        for (rc, err), (me, mine, other, theirs) in zip(results, [(0, 2, 1, 3), (1, 3, 0, 2)]):
            assert rc == 1
            assert _error_lines(err) == ['error: world size mismatch: this process (rank {}) has world_size={} but '
                                         'rank {} has world_size={}; start every process with the same '
                                         '--world-size'.format(me, mine, other, theirs)], err
        assert not [p for p in ranks if 'ready' in p.stdout.read()], 'training started'
        _assert_gone(ranks, port)
    finally:
        _kill_all(ranks)


@pytest.mark.slow
def test_duplicate_rank_fails_at_once_and_the_job_goes_on():
    port = free_port()
    ranks = [_start_rank(0, port, '--epochs', 2, '--step-delay', 0.02), _start_rank(1, port, '--epochs', 2),
             _start_rank(1, port, '--epochs', 2)]
    try:
        _, results = _wait_all(ranks, 90)
        codes = sorted(rc for rc, _ in results)
        assert codes == [0, 0, 1], results
        loser = [i for i, (rc, _) in enumerate(results) if rc == 1][0]
        winner = 3 - loser
        assert _error_lines(results[loser][1]) == [
            'error: rank 1 is already taken by another process ({} pid {} world_size 2) at 127.0.0.1:{}: give each '
            'process a distinct --rank, or stop the stale job using that port'.format(socket.gethostname(),
                                                                                       ranks[winner].pid, port)]
        _assert_gone(ranks, port)
    finally:
        _kill_all(ranks)


# --------------------------------------------------------------------------------------------------
# 3. Interrupt and orphans.

@pytest.mark.slow
@pytest.mark.parametrize('interrupted', [0, 1])
def test_ctrl_c_on_a_rank_blocked_in_a_collective_stops_every_rank(interrupted):
    port = free_port()
    ranks = [_start_rank(r, port, '--fault', 'deadlock') for r in range(2)]
    try:
        for process in ranks:
            _wait_for_line(process, 'ready', timeout=90)
        time.sleep(0.5)  # inside recv
        os.killpg(ranks[interrupted].pid, signal.SIGINT)  # Ctrl-C in that rank's terminal
        said = {}
        elapsed, results = _wait_all(ranks, STOP_BOUND + 5, said)
        other = 1 - interrupted
        print('Ctrl-C on rank {}: rank {} said its error after {:.2f} s, all ended in {:.2f} s: {}'.format(
            interrupted, other, said.get(ranks[other], float('nan')), elapsed, [r[1] for r in results]))
        assert elapsed < STOP_BOUND
        # The watcher makes the collective fail; the main thread then raises KeyboardInterrupt and
        # unwinds normally, so the script's own handler prints its line and exits 130.
        assert results[interrupted] == (130, 'torchbearer_dist: rank {} interrupted inside a collective; stopping\n'
                                             'error: interrupted\n'.format(interrupted)), results[interrupted]
        assert results[other][0] == 1
        assert _error_lines(results[other][1]) == [
            'error: rank {} failed: KeyboardInterrupt: interrupted (SIGINT) (rank {} stopped)'.format(
                interrupted, other)], results[other][1]
        _assert_gone(ranks, port, within=0.5)
    finally:
        _kill_all(ranks)


def _start_launcher(port):
    command = [sys.executable, HERE, '--launch', '2', '--port', str(port), '--timeout', str(TIMEOUT)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env(TORCH_CPP_LOG_LEVEL='FATAL'), cwd=ROOT)


def _wait_for_ranks(launcher, count, timeout=90):
    """Wait until ``count`` ranks of the launcher's session are blocked in their collective."""
    deadline = time.monotonic() + timeout
    fd = launcher.stdout.fileno()
    seen = b''
    while seen.count(b'ready') < count:  # ranks print concurrently: lines may interleave
        assert time.monotonic() < deadline and launcher.poll() is None, 'ranks not ready: {!r}'.format(seen)
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 4096)
    time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize('target', ['group', 'launcher'])
def test_ctrl_c_on_the_launcher_stops_every_rank(target):
    port = free_port()
    launcher = _start_launcher(port)
    try:
        _wait_for_ranks(launcher, 2)
        assert len(_session_alive(launcher.pid)) >= 3
        started = time.monotonic()
        if target == 'group':
            os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
        else:
            os.kill(launcher.pid, signal.SIGINT)
        launcher.wait(LAUNCH_STOP_BOUND + 5)
        while _session_alive(launcher.pid) and time.monotonic() - started < LAUNCH_STOP_BOUND + 5:
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        print('Ctrl-C on the launcher ({}): all ended in {:.2f} s'.format(target, elapsed))
        assert elapsed < LAUNCH_STOP_BOUND
        assert launcher.returncode in (130, -signal.SIGINT), launcher.stderr.read()
        _assert_gone([launcher], port, within=0.5)
    finally:
        _kill_all([launcher])


@pytest.mark.slow
def test_killed_launcher_leaves_no_rank_behind():
    port = free_port()
    launcher = _start_launcher(port)
    try:
        _wait_for_ranks(launcher, 2)
        children = [pid for pid in _session_alive(launcher.pid) if pid != launcher.pid]
        assert len(children) >= 2
        started = time.monotonic()
        launcher.kill()
        launcher.wait(5)
        while _session_alive(launcher.pid) and time.monotonic() - started < LAUNCH_STOP_BOUND + 5:
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        print('SIGKILL of the launcher: children gone in {:.2f} s'.format(elapsed))
        assert elapsed < LAUNCH_STOP_BOUND
        _assert_gone([launcher], port, within=0.5)
    finally:
        _kill_all([launcher])


# --------------------------------------------------------------------------------------------------
# 2. Silent peer: a host drops off the network (its veth link goes down); nobody gets an error.

@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize('silent', [1, 0])
def test_silent_peer_ends_every_rank_within_the_rendezvous_timeout(silent):
    """The collective timeout is long (60 s); the heartbeat ends the job within the rendezvous timeout."""
    with TwoHosts() as hosts:
        env = child_env(TORCH_CPP_LOG_LEVEL='FATAL')
        env.pop('GLOO_SOCKET_IFNAME', None)
        ranks = []
        try:
            for rank in range(2):
                command = hosts.command(rank, [sys.executable, HERE, '--rank', str(rank), '--host', hosts.address(0),
                                               '--port', '29500', '--timeout', str(TIMEOUT), '--rendezvous-timeout',
                                               str(RENDEZVOUS_TIMEOUT), '--epochs', '50', '--step-delay', '0.02'])
                ranks.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              start_new_session=True, env=env, cwd=ROOT))
            for process in ranks:
                _wait_for_line(process, 'ready', timeout=90)
            hosts.link_down(silent)
            said = {}
            # rank 1's store calls time out after half the rendezvous timeout before it counts the silence
            bound = RENDEZVOUS_TIMEOUT * 1.5 + BEAT + CAUSE_WAIT
            elapsed, results = _wait_all(ranks, bound + 20, said)
            print('link of rank {} down: errors after {} s, all ended in {:.2f} s: {}'.format(
                silent, ['{:.2f}'.format(said.get(p, float('nan'))) for p in ranks], elapsed,
                [r[1] for r in results]))
            assert max(said.values()) < bound
            expected = [
                'error: no heartbeat from rank 1 for {} s: its host is down or the network is partitioned (a rank '
                'that is merely busy keeps beating); check that host and the network, or raise rendezvous_timeout= '
                '(rank 0 stopped)'.format(RENDEZVOUS_TIMEOUT),
                'error: no answer from rank 0 (the master at {}:29500) for {} s: its host is down or the network is '
                'partitioned; check that host and the network, or raise rendezvous_timeout= (rank 1 stopped)'.format(
                    hosts.address(0), RENDEZVOUS_TIMEOUT)]
            for rank, (rc, err) in enumerate(results):
                assert rc == 1, err
                assert _error_lines(err) == [expected[rank]], err
        finally:
            _kill_all(ranks)


# --------------------------------------------------------------------------------------------------
# 5. Uneven inputs: no hang (correctness is tested in tests/callbacks/test_callbacks.py).

def _worker_uneven():
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torchbearer import Trial
    from torchbearer.callbacks import on_step_training

    import torchbearer_dist as tbd
    rank = tbd.get_rank()
    size = 40 + 8 * rank  # 5 batches on rank 0, 6 on rank 1
    data = TensorDataset(torch.randn(size, 4), torch.randint(0, 2, (size,)))
    model = torch.nn.Linear(4, 2)
    steps = []
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                  callbacks=[on_step_training(lambda state: steps.append(1)), *tbd.distributed_callbacks()],
                  verbose=0).with_generators(DataLoader(data, batch_size=8))
    trial.run(2)
    return len(steps), model.weight.detach().clone()


@pytest.mark.slow
def test_uneven_inputs_end_without_a_hang():
    import torch
    # A hang would wait for the collective timeout: the deadline, well below it, fails the test first.
    (steps0, weight0), (steps1, weight1) = launch_workers(_worker_uneven, 2, timeout=TIMEOUT, deadline=TIMEOUT - 10)
    assert steps0 == steps1 == 10
    assert torch.equal(weight0, weight1)


# --------------------------------------------------------------------------------------------------
# 10. Security defaults.

def _listening_addresses(port):
    """Local addresses of the sockets listening on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table, width in (('/proc/net/tcp', 8), ('/proc/net/tcp6', 32)):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                address, hex_port = fields[1].split(':')
                if fields[3] == '0A' and int(hex_port, 16) == port:
                    raw = bytes.fromhex(address)
                    if width == 8:
                        found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:
                        words = b''.join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


def _worker_listening():
    return _listening_addresses(int(os.environ['MASTER_PORT']))


def test_store_listens_on_the_master_address_only():
    addresses = launch_workers(_worker_listening, 2, timeout=TIMEOUT)[0]
    assert addresses == ['127.0.0.1'], 'the store listens on {}, not on 127.0.0.1 only'.format(addresses)


OBJECT_COLLECTIVES = ('broadcast_object_list', 'all_gather_object', 'gather_object', 'scatter_object_list',
                      'send_object_list', 'recv_object_list')


def test_library_source_never_calls_object_collectives():
    package = os.path.join(ROOT, 'torchbearer_dist')
    for name in sorted(os.listdir(package)):
        if name.endswith('.py'):
            with open(os.path.join(package, name)) as f:
                text = f.read()
            for collective in OBJECT_COLLECTIVES:
                assert collective not in text, '{} uses {}, which unpickles what peers send'.format(name, collective)


def _worker_no_pickle(path):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError('a pickle-based object collective was called')

    for collective in OBJECT_COLLECTIVES:
        setattr(dist, collective, refuse)
        setattr(dist.distributed_c10d, collective, refuse)
    import torchbearer

    import torchbearer_dist as tbd
    args = argparse.Namespace(fault='none', fault_rank=1, epoch=0, at=0, step_delay=0.0)
    trial = _build_trial(args)
    trial.state[torchbearer.CALLBACK_LIST].append([tbd.CheckReplicas(every=5), tbd.Checkpoint(path)])
    return len(trial.run(1))


@pytest.mark.slow
def test_training_never_uses_object_collectives(tmp_path):
    assert launch_workers(_worker_no_pickle, 2, args=(str(tmp_path / 'run.pt'),), timeout=TIMEOUT) == [1, 1]


# --------------------------------------------------------------------------------------------------
# 11. Two timeouts, the fallback, opt-in interrupts, no leaks (issue 11).

def _worker_rank0_works_alone(seconds):
    import torch
    import torch.distributed as dist
    total = torch.ones(1)
    dist.all_reduce(total)
    started = time.monotonic()
    if dist.get_rank() == 0:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:  # rank-0-only work in Python (a checkpoint, a slow first batch)
            sum(range(10000))
    dist.all_reduce(total)
    return total.item(), time.monotonic() - started


@pytest.mark.slow
def test_rank0_only_work_longer_than_the_rendezvous_timeout_does_not_end_the_job():
    rendezvous_timeout, collective_timeout = 2, 40
    pause = 3 * rendezvous_timeout  # the heartbeat goes on meanwhile; only the collective timeout could end it
    results = launch_workers(_worker_rank0_works_alone, 2, args=(pause,), timeout=collective_timeout,
                          rendezvous_timeout=rendezvous_timeout, deadline=STARTUP + pause + CAUSE_WAIT)
    assert [total for total, _ in results] == [4.0, 4.0]
    rank0_worked, rank1_waited = (waited for _, waited in results)
    # rank 1's clock starts when its all_reduce returns, a little after rank 0's: not >= pause
    assert rank0_worked >= pause and rank1_waited > 2 * rendezvous_timeout, results


def _worker_fail_holding_a_work():
    import torch
    import torch.distributed as dist
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    if dist.get_rank() == 1:  # ``work`` stays referenced from the traceback: destroy_process_group alone
        raise ValueError('fails holding a Work')  # would leave gloo's connections open (_gloo_sockets.py)
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        print('rank 0 blocked for {:.2f} s'.format(time.monotonic() - started), flush=True)


@pytest.mark.slow
def test_failing_rank_that_still_holds_the_group_stops_its_peers_at_once():
    # The collective timeout is 60 s; the deadline fails the test long before it.
    with pytest.raises(ValueError, match=r'^rank 1 failed: fails holding a Work$'):
        launch_workers(_worker_fail_holding_a_work, 2, timeout=TIMEOUT, rendezvous_timeout=RENDEZVOUS_TIMEOUT,
                    deadline=STARTUP + CAUSE_WAIT)


def _worker_gloo_connections():
    import torch
    import torch.distributed as dist

    from torchbearer_dist.runtime import _gloo_sockets, group
    dist.all_reduce(torch.ones(1))  # gloo may accept a peer's connection only when it is first used
    listener = socket.create_server(('127.0.0.1', 0))  # a foreign connection, opened while the group lives
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    found = [fd for fd, _ in _gloo_sockets.connections(group._live['gloo'], dist.get_rank())]
    foreign = {listener.fileno(), client.fileno(), accepted.fileno()}
    for sock in (accepted, client, listener):
        sock.close()
    return len(found), bool(foreign & set(found))


def test_gloo_connections_are_identified_positively():
    """Exactly one connection per peer, never the store's nor another library's."""
    assert launch_workers(_worker_gloo_connections, 3, timeout=TIMEOUT) == [(2, False)] * 3


def _wakeup_fd():
    import signal
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def test_process_group_leaves_signal_handling_alone_in_a_job_of_one():
    import signal

    import torchbearer_dist as tbd
    handler, fd = signal.getsignal(signal.SIGINT), _wakeup_fd()
    with tbd.process_group(rank=0, world_size=1, backend='gloo'):
        assert (signal.getsignal(signal.SIGINT), _wakeup_fd()) == (handler, fd)
    tbd.init_process_group(rank=0, world_size=1, backend='gloo')
    assert (signal.getsignal(signal.SIGINT), _wakeup_fd()) == (handler, fd)
    tbd.destroy_process_group()
    assert (signal.getsignal(signal.SIGINT), _wakeup_fd()) == (handler, fd)


def test_watch_interrupts_is_opt_in_and_undone():
    import signal

    import torchbearer_dist as tbd
    handler, fd = signal.getsignal(signal.SIGINT), _wakeup_fd()
    tbd.watch_interrupts()
    try:
        assert signal.getsignal(signal.SIGINT) is not handler and _wakeup_fd() != fd
    finally:
        tbd.unwatch_interrupts()
    assert (signal.getsignal(signal.SIGINT), _wakeup_fd()) == (handler, fd)


USER_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
import torchbearer_dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
before = dict(os.environ)
with torchbearer_dist.process_group(rank=rank, world_size=3, host='127.0.0.1', port=port, backend='gloo',
                                    timeout=60, rendezvous_timeout=20):
    total = torch.ones(1)
    dist.all_reduce(total)
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
print('rank', rank, 'total', total.item())
"""
#: The same job from a script that never tears its group down and exits right after a collective.
UNDESTROYED_SCRIPT = """
import sys
import torch, torch.distributed as dist
import torchbearer_dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
torchbearer_dist.init_process_group(rank=rank, world_size=3, host='127.0.0.1', port=port, timeout=60,
                                    rendezvous_timeout=20)
total = torch.ones(1)
dist.all_reduce(total)
print('rank', rank, 'total', total.item())
"""


@pytest.mark.slow
@pytest.mark.parametrize('runs', [1, pytest.param(10, marks=pytest.mark.soak)], ids=['once', 'soak'])
@pytest.mark.parametrize('script_text', [USER_SCRIPT, UNDESTROYED_SCRIPT], ids=['process_group', 'never_destroyed'])
def test_a_users_own_script_exits_0_every_time(tmp_path, script_text, runs):
    """torch 2.14 scripts may abort at exit ("terminate called without an active exception", 134): a
    gloo worker or our heartbeat still inside torch when the interpreter finalizes (group.py).

    The abort is a race: one run checks the path every time, ten (TORCHBEARER_DIST_TEST_SOAK=1) catch it.
    """
    script = tmp_path / 'user.py'
    script.write_text(script_text)
    runs = int(os.environ.get('TORCHBEARER_DIST_TEST_EXIT_RUNS', runs))
    for run in range(runs):
        port = free_port()
        ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True, env=child_env())
                 for r in range(3)]
        _, results = _wait_all(ranks, STARTUP + 30)
        outputs = [p.stdout.read() for p in ranks]
        for rank, ((rc, err), out) in enumerate(zip(results, outputs)):
            assert (rc, out) == (0, 'rank {} total 3.0\n'.format(rank)), 'run {} rank {}: {}'.format(run, rank, err)
            assert 'terminate called' not in err, err


def test_stopped_watchdog_joins_once_its_store_call_has_returned():
    """A heartbeat thread left inside a torch store call aborts the process as the call returns at
    exit ("terminate called without an active exception", exit 134: CI of stop 13, under mpirun).

    Rank 1 of a job whose rank 0 never beats: its heartbeat thread blocks in ``multi_get`` for the
    client's whole timeout, longer than the half-second wait of ``stop()``.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from torchbearer_dist.runtime._watchdog import Watchdog
    from torchbearer_dist.runtime.env import resolve, with_rendezvous_timeout

    port = free_port()
    server = dist.TCPStore('127.0.0.1', port, None, True, timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore('127.0.0.1', port, None, False, timedelta(seconds=2), wait_for_workers=False)
    env = with_rendezvous_timeout(resolve(rank=1, world_size=2, host='127.0.0.1', port=port, environ={}), 60, {})
    failures = []
    watchdog = Watchdog(env, client, failures.append, interval=0.1).start()
    time.sleep(0.5)  # the heartbeat thread is now waiting for rank 0's counter
    watchdog.stop()  # a failing rank's short wait
    watchdog.join()  # the wait at exit
    assert (watchdog.running(), failures) == (False, [])
    del server


# --------------------------------------------------------------------------------------------------
# 9. Restarts under torchrun: each attempt meets under its own store prefix.

@pytest.mark.slow
@pytest.mark.parametrize('runs', [1, pytest.param(5, marks=pytest.mark.soak)], ids=['once', 'soak'])
def test_torchrun_restart_does_not_trip_over_the_previous_attempt(runs):
    import shutil
    torchrun = shutil.which('torchrun') or os.path.join(os.path.dirname(sys.executable), 'torchrun')
    if not os.path.exists(torchrun):
        pytest.skip('torchrun is not installed')
    for _ in range(runs):  # torch's own rendezvous failed 2 runs in 5 here without a prefix per attempt
        result = run_command([torchrun, '--standalone', '--nproc-per-node', '2', '--max-restarts', '1',
                              '--monitor-interval', '0.5', HERE, '--torchrun', '--timeout', str(TIMEOUT)],
                             timeout=120, env=child_env(TORCH_CPP_LOG_LEVEL='FATAL'))
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(re.findall(r'attempt \d rank \d ok \d', result.stdout)) == [
            'attempt 1 rank 0 ok 4', 'attempt 1 rank 1 ok 4'], result.stdout


if __name__ == '__main__':
    main()
