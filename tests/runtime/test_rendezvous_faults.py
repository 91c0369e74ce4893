"""A bad rendezvous fails at once on every rank, with one line naming the bad value and the fix.

A taken port, nothing listening, an unresolvable name, a port held by a program that is not a
store, a stale job, ranks that disagree on the world size, a duplicate rank; and torchrun restarts
that meet under a store prefix of their own.
"""
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from torchbearer_dist.runtime._timing import Timing

from _dist import CAUSE_WAIT, LOAD_SLACK, ROOT, STARTUP, TORCHRUN, child_env, free_port, run_command
from _fault_rank import HERE, RENDEZVOUS_TIMEOUT, TIMEOUT
from _faults import (
    _assert_gone,
    _assert_port_free,
    _error_lines,
    _kill_all,
    _start_rank,
    _wait_all,
    _wait_for_line,
)

#: The hand-started rank that says where it is in the handshake.
HANDSHAKE_RANK = os.path.join(os.path.dirname(HERE), '_handshake_rank.py')

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


def test_taken_port_names_the_port():
    port = free_port()
    with _listening(port):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r'^port {} on 127\.0\.0\.1 is already in use \(another job, or a '
                                               r'stale process from an earlier run\); pass a free --port'.format(port)):
            _init(rank=0, world_size=2, port=port)
        assert time.monotonic() - started < LOAD_SLACK  # at once: no network wait
    _assert_port_free(port)


def test_nothing_listening_names_host_and_port():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r'^cannot reach the master at 127\.0\.0\.1:{} within 2 s \(.*\); check '
                                           r'that rank 0 is running there'.format(port)):
        _init(rank=1, world_size=2, port=port, timeout=2)
    elapsed = time.monotonic() - started
    print('unreachable master: {:.2f} s'.format(elapsed))
    assert elapsed < 2 * 1.5 + 5 + LOAD_SLACK  # the package's bound on the connect: 1.5 x timeout + 5 s


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
        _init(rank=rank, world_size=2, host='no-such-master.invalid', port=29999, timeout=4 * LOAD_SLACK)
    assert time.monotonic() - started < LOAD_SLACK  # well before the rendezvous timeout: no network wait


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
    assert elapsed < 2 * 1.5 + 5 + LOAD_SLACK  # the package's bound on the connect: 1.5 x timeout + 5 s
    _assert_port_free(port)


@pytest.mark.slow
def test_stale_job_on_the_port_is_refused_and_left_unharmed():
    port = free_port()
    old = [_start_rank(r, port, '--epochs', 3, '--step-delay', 0.05) for r in range(2)]
    try:
        _wait_for_line(old[0], 'ready', timeout=90)
        slow = 4 * LOAD_SLACK  # a rendezvous timeout that a wait would show, however loaded the machine
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r'^rank 1 is already taken by another process \(\S+ pid {} world_size 2'
                                               r'\) at 127\.0\.0\.1:{}: give each process a distinct --rank, or stop '
                                               r'the stale job'.format(old[1].pid, port)):
            _init(rank=1, world_size=2, port=port, timeout=slow)
        with pytest.raises(RuntimeError, match=r'^port {} on 127\.0\.0\.1 is already in use '.format(port)):
            _init(rank=0, world_size=2, port=port, timeout=slow)
        # neither waited out its rendezvous timeout: both together end well within one
        assert time.monotonic() - started < 2 * LOAD_SLACK < slow
        _, results = _wait_all(old, 90)
        outputs = [process.stdout.read() for process in old]
        for rank, ((rc, err), out) in enumerate(zip(results, outputs)):
            harmed = 'the old job was harmed: rank {}: {}{}'.format(rank, out, err)
            assert (rc, out.splitlines()[-1:]) == (0, ['done 3 epochs']), harmed
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
# 9. Restarts under torchrun: each attempt meets under its own store prefix.

@pytest.mark.slow
@pytest.mark.parametrize('runs', [1, pytest.param(5, marks=pytest.mark.soak)], ids=['once', 'soak'])
def test_torchrun_restart_does_not_trip_over_the_previous_attempt(runs):
    for _ in range(runs):  # torch's own rendezvous failed 2 runs in 5 here without a prefix per attempt
        result = run_command([*TORCHRUN, '--standalone', '--nproc-per-node', '2', '--max-restarts', '1',
                              '--monitor-interval', '0.5', HERE, '--torchrun', '--timeout', str(TIMEOUT)],
                             timeout=120, env=child_env(TORCH_CPP_LOG_LEVEL='FATAL'))
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(re.findall(r'attempt \d rank \d ok \d', result.stdout)) == [
            'attempt 1 rank 0 ok 4', 'attempt 1 rank 1 ok 4'], result.stdout


# --------------------------------------------------------------------------------------------------
# 10. Ctrl-C on a rank inside the handshake.

#: The rendezvous timeout of the Ctrl-C test below: a rank that waited it out (the published cause
#: unread) would end at least this long after the ranks started, far past any bound of the fault.
LONG_MEET = 60
#: Seconds from the moment a rank may see the cause to its error line: a store poll (50 ms), the cause read
#: and the line printed, and fixed headroom for a loaded machine's scheduling.
SAY_BOUND = 1.5


@pytest.mark.slow
def test_ctrl_c_in_the_handshake_ends_every_rank_naming_it(tmp_path):
    """Rank 1 of 3 is interrupted after claiming its rank, before saying where it runs: ranks 0 and 2,
    waiting for its world size, end on its published cause, not on the rendezvous timeout, and rank 2
    names it too, though it polls only a second later (a loaded machine): rank 0, which holds the store,
    waits until rank 2 has read the cause (it left at once, and rank 2 said 'rank 0 is gone': 3 of 3).

    No wait: ranks 0 and 2 say their lines within :data:`SAY_BOUND` of rank 2's release (rank 0 waits for
    rank 2's read, rank 2 reads at once), with a rendezvous timeout of :data:`LONG_MEET` that a wait could
    not hide in."""
    port = free_port()
    release = tmp_path / 'release'
    command = [sys.executable, HANDSHAKE_RANK, '--world-size', '3', '--port', str(port), '--timeout', str(TIMEOUT),
               '--rendezvous-timeout', str(LONG_MEET)]
    started = time.monotonic()
    ranks = [subprocess.Popen([*command, '--rank', str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True, cwd=ROOT,
                              env=child_env(HANDSHAKE_RELEASE_2=str(release))) for r in range(3)]
    try:
        _wait_for_line(ranks[1], 'held in the handshake', timeout=STARTUP + 60)
        for rank in (0, 2):
            _wait_for_line(ranks[rank], 'waiting for rank 1', timeout=STARTUP + 60)
        said = {}
        interrupted = time.monotonic()
        os.killpg(ranks[1].pid, signal.SIGINT)  # Ctrl-C in rank 1's terminal
        time.sleep(1.0)  # rank 0 has read the cause and, unless it waits for rank 2, is on its way out
        release.touch()
        released = time.monotonic()
        _, results = _wait_all(ranks, LONG_MEET, said)
        ended = time.monotonic()
        said = {ranks.index(process): seconds for process, seconds in said.items()}  # from the release
        print('Ctrl-C in the handshake: rank 2 released {:.2f} s after it, error lines of ranks 0 and 2 {:.2f} and '
              '{:.2f} s after the release, every rank gone {:.2f} s after the Ctrl-C, {:.2f} s after the ranks '
              'started'.format(released - interrupted, said.get(0, -1), said.get(2, -1), ended - interrupted,
                               ended - started))
        assert [rc for rc, _ in results] == [1, 130, 1], results
        for rank in (0, 2):
            assert _error_lines(results[rank][1]) == [
                'error: rank 1 failed: KeyboardInterrupt (rank {} stopped)'.format(rank)], results[rank][1]
        assert max(said[0], said[2]) < SAY_BOUND, said
        assert ended - started < LONG_MEET  # no rank waited out the rendezvous timeout
        _assert_gone(ranks, port)
    finally:
        _kill_all(ranks)


@pytest.mark.slow
@pytest.mark.soak
def test_ctrl_c_at_a_random_moment_of_the_start_ends_every_rank_naming_rank_1():
    """The race the tests above hold still: Ctrl-C on rank 1 of 3 at a random moment of its start (before
    it joins, inside the handshake, or once training runs), 10 times. Ranks 0 and 2 always end within the
    rendezvous timeout, the cause wait and the slack of the Ctrl-C (or of their own start, where it came
    later: ``interrupts watched at``), and name rank 1, never each other.

    Except where CPython dropped the Ctrl-C: one that lands in rank 1's ``import torch``, before any
    handler of the package exists, inside a finalizer (or C code that clears errors) is reported as
    "Exception ignored in" or not at all, and rank 1 goes on as if never interrupted; the job then trains
    to its end, every rank exits 0 and none says an error (CI's soak step, attempt 7 of 10: every rank
    gone 30.9 s after the Ctrl-C without an error line; here 3 in 80 Ctrl-Cs 1.4-1.9 s into ``import
    torch``). Told apart by when rank 1 started watching Ctrl-C (``interrupts watched at``, on the
    machine's monotonic clock): a Ctrl-C before it that did not end rank 1 must leave a job that ends
    well; see test_ctrl_c_dropped_by_python_before_any_handler_lets_the_job_train_on."""
    rng = random.Random(0)
    dropped = 0
    for attempt in range(10):
        port = free_port()
        ranks = [_start_rank(r, port, '--epochs', 3, '--step-delay', 0.2, world_size=3,
                             env=child_env(FAULT_RANK_SAY_WATCHED=1)) for r in range(3)]
        try:
            time.sleep(rng.uniform(0.5, 8.0))
            interrupted = time.monotonic()
            os.killpg(ranks[1].pid, signal.SIGINT)  # Ctrl-C in rank 1's terminal
            _, results = _wait_all(ranks, RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK + 30)
            elapsed = time.monotonic() - interrupted
            outputs = [process.stdout.read() for process in ranks]
            watched = re.search(r'^interrupts watched at (\S+)$', outputs[1], re.M)
            # the package's bound runs from when it runs: a peer still importing torch at the Ctrl-C (6-10x
            # load) starts its rendezvous timeout later (19.8 s after the Ctrl-C once, 5 s of it its start)
            began = max([interrupted] + [float(m.group(1)) for m in (
                re.search(r'^interrupts watched at (\S+)$', outputs[r], re.M) for r in (0, 2)) if m])
            print('attempt {}: gone {:.2f} s after the Ctrl-C, {:.2f} s after ranks 0 and 2 were up, rank 1 '
                  'watching {}: {}'.format(attempt, elapsed, interrupted + elapsed - began, '{:+.2f} s after '
                  'it'.format(float(watched.group(1)) - interrupted) if watched else 'never',
                  [(rc, _error_lines(err)) for rc, err in results]))
            if results[1][0] == 0 and (watched is None or float(watched.group(1)) > interrupted):
                dropped += 1  # CPython dropped it before rank 1 had a handler: no fault, the job ends well
                print('  dropped; rank 1 said: {}'.format([line for line in results[1][1].splitlines()
                                                            if 'ignored' in line or 'KeyboardInterrupt' in line]))
                assert [rc for rc, _ in results] == [0, 0, 0], results
                assert all(out.splitlines()[-1:] == ['done 3 epochs'] for out in outputs), outputs
                continue
            for rank in (0, 2):
                lines = _error_lines(results[rank][1])
                assert len(lines) == 1 and 'rank 1' in lines[0] and 'rank 0 (' not in lines[0], results[rank][1]
            assert interrupted + elapsed - began < RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK
        finally:
            _kill_all(ranks)
    print('Ctrl-Cs dropped by Python before rank 1 had a handler: {} of 10'.format(dropped))


def _start_held(port, hold, release=None):
    """Ranks 0-2 of a three-rank job (``_handshake_rank.py``), rank 1 held before it imports torch (see
    ``_fault_rank._hold_at_start``), training one short epoch once it goes on."""
    command = [sys.executable, HANDSHAKE_RANK, '--world-size', '3', '--port', str(port), '--timeout', str(TIMEOUT)]
    env = child_env(FAULT_RANK_HOLD='1 {}'.format(hold), FAULT_RANK_RELEASE=str(release),
                    HANDSHAKE_HOLD='1' if hold == 'start' else '-1')  # a rank 1 that goes on is not held again
    return [subprocess.Popen([*command, '--rank', str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True, cwd=ROOT, env=env) for r in range(3)]


@pytest.mark.slow
def test_ctrl_c_before_any_handler_ends_the_others_naming_the_rank_that_never_joined():
    """Ctrl-C on rank 1 before it imported torch (Python's own handler: it dies with a traceback, having
    claimed nothing), while ranks 0 and 2 wait for it in the handshake: both end within the rendezvous
    timeout and the cause wait, saying that rank 1 did not join."""
    port = free_port()
    ranks = _start_held(port, 'start')
    try:
        _wait_for_line(ranks[1], 'held at start', timeout=STARTUP + 60)
        for rank in (0, 2):
            _wait_for_line(ranks[rank], 'waiting for rank 1', timeout=STARTUP + 60)
        interrupted = time.monotonic()
        os.killpg(ranks[1].pid, signal.SIGINT)  # Ctrl-C in rank 1's terminal
        _, results = _wait_all(ranks, RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK + 30)
        elapsed = time.monotonic() - interrupted
        print('Ctrl-C before any handler: every rank gone {:.2f} s after it'.format(elapsed))
        assert results[1][0] == -signal.SIGINT and 'KeyboardInterrupt' in results[1][1], results[1]
        for rank in (0, 2):
            lines = _error_lines(results[rank][1])
            assert [rc for rc, _ in results[::2]] == [1, 1], results
            assert len(lines) == 1 and 'rank 1 of 3 did not join at 127.0.0.1:{} within {:g} s'.format(
                port, RENDEZVOUS_TIMEOUT) in lines[0], results[rank][1]
        assert elapsed < RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK
        _assert_gone(ranks, port)
    finally:
        _kill_all(ranks)


@pytest.mark.slow
def test_ctrl_c_dropped_by_python_before_any_handler_lets_the_job_train_on(tmp_path):
    """CI's unexplained soak outcome, held still: rank 1's Ctrl-C lands in a finalizer (as importlib's
    module-lock callbacks run while torch is imported), where CPython reports its KeyboardInterrupt as
    "Exception ignored in" and drops it. No handler of the package exists yet and rank 1 goes on as if never
    interrupted: the job is not at fault and trains to its end, every rank exits 0 with no error line."""
    port = free_port()
    release = tmp_path / 'release'
    ranks = _start_held(port, 'finalizer', release)
    try:
        _wait_for_line(ranks[1], 'held in a finalizer', timeout=STARTUP + 60)
        os.killpg(ranks[1].pid, signal.SIGINT)  # Ctrl-C in rank 1's terminal
        time.sleep(0.5)
        release.touch()
        _, results = _wait_all(ranks, STARTUP + 90)
        outputs = [process.stdout.read() for process in ranks]
        assert 'Exception ignored in' in results[1][1] and 'KeyboardInterrupt' in results[1][1], results[1][1]
        assert [rc for rc, _ in results] == [0, 0, 0], results
        assert [_error_lines(err) for _, err in results] == [[], [], []], results
        assert all(out.splitlines()[-1:] == ['done 1 epochs'] for out in outputs), outputs
    finally:
        _kill_all(ranks)


#: Seconds from rank 0's stop to the others' error lines: the docs' bound for a master whose store stopped
#: answering (troubleshooting.rst: the rendezvous timeout, and a quarter beat, after its last answer, which
#: came before the stop), then the main thread woken from its store wait, and a fixed 1.5 s for a loaded machine.
MASTER_NAMED_BOUND = RENDEZVOUS_TIMEOUT + 0.25 * Timing(RENDEZVOUS_TIMEOUT).beat + 1.5


@pytest.mark.slow
def test_rank_0_stopped_in_the_handshake_ends_the_others_naming_it(tmp_path):
    """Rank 0, which holds the store, is stopped (kill -STOP) while every rank is inside the handshake:
    ranks 1 and 2 end within the rendezvous timeout and the cause wait, naming rank 0. Its kernel still
    accepts what they send, and torch's client retried its read past its own timeout: both waited in
    ``rendezvous._wait`` for over 40 s (none ended in 40 s, measured), beyond every bound."""
    port = free_port()
    release = tmp_path / 'release'
    command = [sys.executable, HANDSHAKE_RANK, '--world-size', '3', '--port', str(port), '--timeout', str(TIMEOUT)]
    ranks = [subprocess.Popen([*command, '--rank', str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True, cwd=ROOT,
                              env=child_env(HANDSHAKE_HOLD='2', HANDSHAKE_HOLD_RELEASE=str(release)))
             for r in range(3)]
    try:
        _wait_for_line(ranks[2], 'held in the handshake', timeout=STARTUP + 60)
        for rank in (0, 1):
            _wait_for_line(ranks[rank], 'waiting for rank 2', timeout=STARTUP + 60)
        os.kill(ranks[0].pid, signal.SIGSTOP)  # rank 1 now waits on the frozen store for rank 2's world size
        stopped = time.monotonic()
        release.touch()  # rank 2 says where it runs and its world size to the frozen store, then waits too
        said, began = {}, time.monotonic()
        _, results = _wait_all(ranks[1:], RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK + 30, said)
        elapsed = time.monotonic() - stopped
        said = [said.get(p, float('nan')) + began - stopped for p in ranks[1:]]
        print('rank 0 stopped in the handshake: ranks 1 and 2 said their errors {} s after it (bound {:.2f} s), '
              'gone {:.2f} s after it'.format(['{:.2f}'.format(t) for t in said], MASTER_NAMED_BOUND, elapsed))
        assert max(said) < MASTER_NAMED_BOUND, said
        assert [rc for rc, _ in results] == [1, 1], results
        for rank, (_, err) in zip((1, 2), results):
            assert _error_lines(err) == [
                'error: no answer from rank 0 (the master at 127.0.0.1:{}) for {:g} s: its host is down or the '
                'network is partitioned; check that host and the network, or raise rendezvous_timeout= (rank {} '
                'stopped)'.format(port, RENDEZVOUS_TIMEOUT, rank)], err
        assert elapsed < RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK
    finally:
        try:
            os.kill(ranks[0].pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        _kill_all(ranks)
