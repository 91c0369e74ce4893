"""Ctrl-C and SIGTERM end a replica of the fault-tolerant mode at once, in one line, wherever they land (issue 42).

Signals at random moments to the replicas of a real two-replica run (a lighthouse in this process, replicas of
tests/ft/_replica.py as processes): inside torchft's collectives, its quorums, its heals, its future callbacks.
Each signalled replica must end within :data:`STOP_BOUND` with status 128 + the signal's number and one line on
stderr, and the other must go on. The signalled one is started again (it heals from the other) before the next.
"""
import collections
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from _dist import LOAD_SLACK, SOAK, STARTUP, child_env, kill_session, python

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import HERE, Replicas  # noqa: E402

from torchbearer_dist.ft import Lighthouse, _signals  # noqa: E402 (after the skip)

#: A replica ends this long after the signal at the latest (the grace, and the process's own end), on an idle
#: machine; each one is allowed LOAD_SLACK more here, their median none.
STOP_BOUND = _signals.GRACE + 0.5
#: Seconds of torchft's bounds on a lost replica (as test_fault_tolerant.py's): the heartbeat and a collective.
LOST_BOUND = 2 + 10
#: A long run: the replicas are signalled long before it ends (90 steps an epoch, 50 ms each at least).
ARGS = ('--replicas', '2', '--epochs', '1000', '--sleep', '0.05', '--timeout', '10')
WHERE = (r'(in epoch \d+ of \d+, batch \d+ of \d+|in epoch \d+ of \d+, validating|before training its first batch '
         r'\(joining the replicas, healing if behind\)|between the passes of epoch \d+ of \d+ \(not in a training '
         r'step\))')
NO_CHECKPOINT = 'no checkpoint (no torchbearer_dist.Checkpoint is configured)'


class SpareReplicas(Replicas):
    """:class:`Replicas` that can also start a replica ahead (tests/ft/_spare_replica.py), to run at a gate."""

    def spare(self, replica, *args):
        """Start replica ``replica`` ahead; returns ``(index in started, the gate file that lets it run)``."""
        gate = self.tmp_path / 'gate-{}'.format(len(self.started))
        out, err = (self.tmp_path / 'r{}-{}.{}'.format(replica, len(self.started), kind) for kind in ('out', 'err'))
        command = python(os.path.join(HERE, '_spare_replica.py'), str(gate), '--lighthouse', self.lighthouse,
                         '--replica', str(replica), *args)
        with open(out, 'w') as stdout, open(err, 'w') as stderr:
            process = subprocess.Popen(command, stdout=stdout, stderr=stderr, start_new_session=True,
                                       env=child_env(RUST_LOG='warn'))
        self.started.append((process, out, err))
        return len(self.started) - 1, gate


def _stop(replicas, i, signum):
    """Send ``signum`` to replica ``i``; returns (seconds until it ended, its exit status, its stderr since)."""
    process, offset = replicas.process(i), len(replicas.err(i))
    sent = time.monotonic()
    os.kill(process.pid, signum)
    try:
        code = process.wait(STOP_BOUND + LOAD_SLACK + 30)
    except subprocess.TimeoutExpired:
        raise AssertionError('replica {} still runs {} s after {}:\n{}'.format(
            i, STOP_BOUND + LOAD_SLACK + 30, signal.Signals(signum).name, replicas.describe())) from None
    return time.monotonic() - sent, code, replicas.err(i)[offset:]


def _wait_ready(replicas, i):
    """Until replica ``i`` is about to run (its READY line), polled finely: its join and heal take 0.1 to 0.2 s."""
    end = time.monotonic() + STARTUP
    while 'READY' not in replicas.out(i):
        assert time.monotonic() < end, 'no READY within {} s:\n{}'.format(STARTUP, replicas.describe())
        time.sleep(0.005)


def _signal_at_random(tmp_path, signals, seed):
    """``signals`` SIGINTs and SIGTERMs at random moments to either replica of a two-replica run; returns the
    seconds each took to end, and the lines they wrote."""
    rng = random.Random(seed)
    elapsed, lines = [], []
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = SpareReplicas(tmp_path, server.address)
        try:
            live = {r: replicas.start(r, *ARGS) for r in (0, 1)}
            spares = {r: replicas.spare(r, *ARGS) for r in (0, 1)}
            replicas.wait_for(lambda: min(replicas.steps(i) for i in live.values()) >= 5, STARTUP + 60)
            newest = None  # the replica started last, at the last round
            for n in range(signals):
                victim = rng.choice((0, 1))
                other = 1 - victim
                signum = rng.choice((signal.SIGINT, signal.SIGTERM))
                if victim != newest:  # the other is the new one: it goes on alone once it has trained a step
                    replicas.wait_for(lambda i=live[other]: replicas.steps(i) >= 1, STARTUP + 60)
                # From the new one's start: half of them in its first 0.25 s (its join and heal take 0.1 to 0.2 s
                # here), the others over its first steps.
                delay = rng.uniform(0.0, 0.25 if rng.random() < 0.5 else 3.0)
                time.sleep(delay)
                seconds, code, err = _stop(replicas, live[victim], signum)
                name = signal.Signals(signum).name
                context = 'seed {}, signal {} ({} to replica {} after {:.2f} s):\n{}'.format(
                    seed, n, name, victim, delay, replicas.describe())
                assert code == 128 + signum, context
                assert re.fullmatch(r'torchbearer_dist: replica r{} stopped by {} {}; {}\n'.format(
                    victim, name, WHERE, re.escape(NO_CHECKPOINT)), err), (err, context)
                assert seconds < STOP_BOUND + LOAD_SLACK, (seconds, context)
                elapsed.append(seconds)
                lines.append(err)
                # The other goes on: it loses the signalled one as any lost replica, and trains on.
                before = replicas.steps(live[other])
                replicas.wait_for(lambda i=live[other], k=before + 3: replicas.steps(i) >= k, LOST_BOUND + LOAD_SLACK)
                assert replicas.process(live[other]).poll() is None, context
                # The signalled one starts again (a spare whose imports are done) and heals from the other.
                live[victim], gate = spares[victim]
                gate.touch()
                spares[victim] = replicas.spare(victim, *ARGS)
                _wait_ready(replicas, live[victim])
                newest = victim
        finally:
            replicas.kill_all()
    return elapsed, lines


def _report(seed, elapsed, lines):
    places = collections.Counter(re.sub(r'\d+', 'N', line.split(' stopped by ')[1].split(' ', 1)[1].split(';')[0])
                                 for line in lines)
    print('{} signals (seed {}): replicas ended in {:.2f} s at most, {:.2f} s median; where: {}'.format(
        len(elapsed), seed, max(elapsed), statistics.median(elapsed), dict(places)))


@pytest.mark.timeout(400)
def test_ctrl_c_and_sigterm_at_random_moments_end_a_replica_in_one_line_and_the_other_goes_on(tmp_path):
    _report(42, *_signal_at_random(tmp_path, 10, seed=42))


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason='a soak test: set TORCHBEARER_DIST_TEST_SOAK=1')
@pytest.mark.timeout(1500)
def test_fifty_signals_at_random_moments_each_end_a_replica_in_one_line(tmp_path):
    seed = random.randrange(2 ** 32)  # a schedule of its own at each soak, named in every failure
    _report(seed, *_signal_at_random(tmp_path, 50, seed))


@pytest.mark.timeout(300)
def test_a_replica_stuck_with_a_frozen_peer_still_ends_at_once(tmp_path):
    # The other replica frozen (SIGSTOP): the signalled one waits for it inside torchft (a collective, a quorum),
    # and at exit Python would wait for torchft's quorum thread, blocked in a Rust call: its helper ends it.
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = SpareReplicas(tmp_path, server.address)
        try:
            other, victim = (replicas.start(r, *ARGS) for r in (0, 1))
            spare = replicas.spare(1, *ARGS)
            replicas.wait_for(lambda: min(replicas.steps(i) for i in (other, victim)) >= 5, STARTUP + 60)
            for signum in (signal.SIGINT, signal.SIGTERM):
                os.kill(replicas.process(other).pid, signal.SIGSTOP)
                try:  # under 3 s in all (the pause the other would refuse to go on from alone, see ft/_pause.py)
                    time.sleep(0.5)
                    seconds, code, err = _stop(replicas, victim, signum)
                finally:
                    os.kill(replicas.process(other).pid, signal.SIGCONT)
                context = replicas.describe()
                assert code == 128 + signum and seconds < STOP_BOUND + LOAD_SLACK, (code, seconds, context)
                assert re.fullmatch(r'torchbearer_dist: replica r1 stopped by {} {}; {}\n'.format(
                    signal.Signals(signum).name, WHERE, re.escape(NO_CHECKPOINT)), err), (err, context)
                before = replicas.steps(other)
                replicas.wait_for(lambda n=before + 3: replicas.steps(other) >= n, LOST_BOUND + LOAD_SLACK)
                victim, gate = spare
                gate.touch()
                spare = replicas.spare(1, *ARGS)
                replicas.wait_for(lambda i=victim: replicas.steps(i) >= 3, STARTUP + 60)
        finally:
            replicas.kill_all()


@pytest.mark.timeout(240)
def test_a_signal_that_torchft_swallowed_in_a_future_callback_ends_the_replica_at_once_in_its_one_line(replicas):
    # The signal handled inside a callback of torchft's future chain, in the main thread: torchft turns the stop
    # into the step's error. The step it failed raises it again (before: a "dropped the step ... Stopped: ..."
    # line after the stop's, and the process ended by the helper at the grace's end, its finally blocks skipped).
    args = ('--replicas', '2', '--epochs', '1000', '--sleep', '0.05', '--timeout', '10')
    other = replicas.start(0, *args)
    victim = replicas.start(1, *args, '--sigterm-in-callback', '20')
    try:
        code = replicas.process(victim).wait(STARTUP + 60)
    except subprocess.TimeoutExpired:
        raise AssertionError(replicas.describe()) from None
    signalled = [float(line.split()[1]) for line in replicas.out(victim).splitlines() if line.startswith('SIGNALLED')]
    assert code == 128 + signal.SIGTERM and len(signalled) == 1, replicas.describe()
    lines = replicas.err(victim).strip().splitlines()
    assert re.fullmatch(r'torchbearer_dist: replica r1 stopped by SIGTERM {}; {}'.format(
        WHERE, re.escape(NO_CHECKPOINT)), lines[-1]), replicas.describe()
    assert not any('dropped the step' in line for line in lines), replicas.describe()
    assert 'UNWOUND' in replicas.out(victim), replicas.describe()  # the main thread raised it, not the helper's end
    assert replicas.process(other).poll() is None, replicas.describe()  # the other trains on


# --- the line tells the truth -------------------------------------------------------------------------------------

def _last_step(replicas, i):
    epoch, batch = replicas.out(i).split('STEP ')[-1].split()[:2]
    return int(epoch), int(batch)


@pytest.mark.timeout(240)
def test_sigterm_says_where_training_was_and_which_checkpoint_was_written(tmp_path):
    # Three runs at once, each one replica alone at its own lighthouse (so that it writes the checkpoints):
    # no Checkpoint; a Checkpoint signalled in its first epoch (nothing written); one signalled in its second.
    kept = [None, tmp_path / 'early.ckpt', tmp_path / 'late.ckpt']
    lighthouses = [Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0)
                   for _ in kept]
    runs = [Replicas(tmp_path / str(k), server.address) for k, server in enumerate(lighthouses)]
    try:
        # 40 steps an epoch: the first two mid-epoch 1, the third mid-epoch 2 (after its first checkpoint). Each
        # waits there for a file never made, whatever the load (before, a run signalled last trained on meanwhile).
        at = [(0, 10), (0, 10), (1, 10)]
        started = []
        for run, path, (epoch, batch) in zip(runs, kept, at):
            run.tmp_path.mkdir()
            extra = ('--checkpoint', str(path)) if path else ()
            started.append(run.start(0, '--replicas', '1', '--samples', '400', '--epochs', '5', '--sleep', '0.05',
                                     '--gate', str(tmp_path / 'never'), '--gate-step', str(epoch * 40 + batch + 1),
                                     *extra))
        for run, i, (epoch, batch) in zip(runs, started, at):
            run.wait_for(lambda r=run, i=i, n=epoch * 40 + batch: r.position(i, per_epoch=40) >= n, STARTUP + 60)
            assert run.process(i).poll() is None, run.describe()
            seconds, code, err = _stop(run, i, signal.SIGTERM)
            assert code == 128 + signal.SIGTERM and seconds < STOP_BOUND + LOAD_SLACK, (code, seconds, run.describe())
            done = _last_step(run, i)
            assert done[0] == epoch, run.describe()
            match = re.fullmatch(r'torchbearer_dist: replica r0 stopped by SIGTERM in epoch {} of 5, batch (\d+) of '
                                 r'40; (.*)\n'.format(epoch + 1), err)
            assert match, (err, run.describe())
            # The batch it was in: the next after the last one printed, or that one (stopped after it was printed).
            assert int(match.group(1)) in (done[1] + 1, done[1] + 2), (err, done)
            said = match.group(2)
            if run is runs[0]:
                assert said == NO_CHECKPOINT
            elif run is runs[1]:
                assert said == 'no checkpoint written yet (torchbearer_dist.Checkpoint writes {})'.format(kept[1])
                assert not kept[1].exists()
            else:
                age = re.fullmatch(r'its checkpoint {} was written ([\d.]+) s before'.format(re.escape(str(kept[2]))),
                                   said)
                assert age and kept[2].exists(), said
                # Written at the end of epoch 1, 10 steps of at least 50 ms before the signal.
                assert 0.5 <= float(age.group(1)) <= 0.5 + 10 + LOAD_SLACK, said
    finally:
        for run in runs:
            run.kill_all()
        for server in lighthouses:
            server.shutdown()


# --- the mechanism, in a small program: chaining, the fallback, and what is put back ------------------------------

PROGRAM = r'''
import os, signal, sys, threading, time
from torchbearer_dist.ft import _signals

mode = sys.argv[1]
called = []
if mode != 'default':
    signal.signal(signal.SIGTERM, lambda signum, frame: called.append(signum))  # the program's own handler
found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
stop = _signals.SignalStop('x', lambda: (None, False))
assert all(signal.getsignal(s) is not found[s] for s in found)
if mode == 'close':
    stop.close()
    assert {s: signal.getsignal(s) for s in found} == found and signal.set_wakeup_fd(-1) == -1
    print('restored', flush=True)
    sys.exit(0)
if mode == 'swallowed':  # torchft's future callbacks turn what the main thread raises into a step error
    while True:
        try:
            print('ready', flush=True)
            while True:
                time.sleep(0.01)
        except BaseException:
            print('swallowed', called, flush=True)
elif mode == 'dropped':  # it lands in a __del__, where Python drops what is raised (after printing a traceback)
    class Slow:
        def __del__(self):
            print('ready', flush=True)
            time.sleep(60)
    try:
        Slow()
        time.sleep(60)
    finally:
        print('finally', called, flush=True)
elif mode == 'native':  # the main thread in a native call that the signal does not interrupt
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    print('ready', flush=True)
    time.sleep(60)
else:
    try:
        print('ready', flush=True)
        time.sleep(60)
    finally:
        print('finally', called, flush=True)
'''


def _program(mode, signum=None):
    """Run PROGRAM in ``mode``; send ``signum`` once it is ready. Returns (status, stdout, stderr, seconds)."""
    process = subprocess.Popen([sys.executable, '-c', PROGRAM, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env=child_env())
    try:
        if signum is not None:
            assert process.stdout.readline() == 'ready\n'
            sent = time.monotonic()
            os.kill(process.pid, signum)
        else:
            sent = time.monotonic()
        try:
            out, err = process.communicate(timeout=STARTUP + 30)
        except subprocess.TimeoutExpired:
            raise AssertionError('the program ({}) still runs {} s after {}'.format(
                mode, STARTUP + 30, signal.Signals(signum).name if signum else 'its start')) from None
        return process.returncode, out, err, time.monotonic() - sent
    finally:
        kill_session(process.pid)
        process.wait()


@pytest.mark.timeout(180)
@pytest.mark.parametrize('mode, signum', [
    ('default', signal.SIGINT),     # unwinds: the program's finally runs, then status 130 and no traceback
    ('chained', signal.SIGTERM),    # the program's own SIGTERM handler runs first
    ('swallowed', signal.SIGTERM),  # every exception swallowed: the helper ends it
    ('dropped', signal.SIGTERM),    # dropped by Python in a __del__: raised again past it, the finally runs
    ('dropped', signal.SIGINT),
    ('native', signal.SIGINT),      # the main thread never comes back: the helper ends it
])
def test_a_signal_ends_the_process_in_one_line_however_the_main_thread_takes_it(mode, signum):
    code, out, err, seconds = _program(mode, signum)
    name = signal.Signals(signum).name
    assert code == 128 + signum, (code, out, err)
    assert err == ('torchbearer_dist: replica x stopped by {} before training its first batch (joining the replicas, '
                   'healing if behind); {}\n'.format(name, NO_CHECKPOINT)), err
    assert seconds < STOP_BOUND + LOAD_SLACK, seconds
    if mode in ('default', 'chained', 'dropped'):
        # the program's own SIGTERM handler ran once (a stop raised again is no second signal)
        assert 'finally [{}]'.format(int(signum) if mode != 'default' and signum == signal.SIGTERM else '') in out, out
    if mode == 'swallowed':  # its grace given to the program, then ended (a main thread stuck in native code
        # cannot use the grace: one clean-clone run ended it after 0.16 s on a loaded machine, which is allowed)
        assert seconds >= _signals.GRACE - 0.1, seconds


@pytest.mark.timeout(180)
def test_closing_puts_back_the_handlers_and_the_wakeup_fd():
    code, out, err, _ = _program('close')
    assert (code, out, err) == (0, 'restored\n', ''), (code, out, err)


def test_the_line_for_each_place_and_checkpoint():
    where = {'training': True, 'epoch': 2, 'epochs': 3, 'batch': 15, 'batches': 60, 'started': True,
             'validating': False}
    none = {'path': None, 'age': None, 'writer': None}
    assert _signals.stop_line('r1', signal.SIGTERM, where, none) == (
        'replica r1 stopped by SIGTERM in epoch 2 of 3, batch 15 of 60; ' + NO_CHECKPOINT)
    assert _signals.stop_line('r1', signal.SIGINT, dict(where, training=False, validating=True),
                              {'path': 'a.ckpt', 'age': 3.25, 'writer': True}) == (
        'replica r1 stopped by SIGINT in epoch 2 of 3, validating; its checkpoint a.ckpt was written 3.2 s before')
    assert _signals.stop_line('r1', signal.SIGINT, dict(where, training=False),
                              {'path': 'a.ckpt', 'age': None, 'writer': False}) == (
        'replica r1 stopped by SIGINT between the passes of epoch 2 of 3 (not in a training step); no checkpoint '
        'written here (a.ckpt): another replica writes them')
    assert _signals.stop_line('r1', signal.SIGTERM, dict(where, training=False, started=False, batch=None),
                              {'path': 'a.ckpt', 'age': None, 'writer': True}) == (
        'replica r1 stopped by SIGTERM before training its first batch (joining the replicas, healing if behind); '
        'no checkpoint written yet (torchbearer_dist.Checkpoint writes a.ckpt)')
