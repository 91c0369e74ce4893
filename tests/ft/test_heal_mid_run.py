"""A replica healed in the middle of a run goes on from its healer's position, or says in one line why it cannot.

Real replica processes (tests/ft/_replica.py) on loopback, a torchft lighthouse in this process. A replica
stopped with SIGSTOP past the lighthouse's heartbeat and the collectives' timeout is left out; when it goes
on, its next quorum heals it in the middle of its run, where its Trial's loop is elsewhere: before, it trained
on from there (an epoch-end reduction met the others' gradients, a fork at exit 0).
"""
import os
import re
import signal
import time

import pytest

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: Two replicas, 60 steps an epoch each, 3 epochs; collectives time out after 3 s, the lighthouse drops a silent
#: replica after 2 s: an 8 s stop is past both.
ARGS = ('--replicas', '2', '--epochs', '3', '--samples', '1200', '--sleep', '0.05', '--timeout', '3')


def _finished(replicas, i):
    """(epochs, restarts) of replica ``i``'s run, from its EPOCHS line."""
    line = re.search(r'^EPOCHS (\d+) RESTARTS (\d+)$', replicas.out(i), re.M)
    return int(line.group(1)), int(line.group(2))


@pytest.mark.timeout(240)
@pytest.mark.parametrize('mode', [(), ('--local-steps', '16')], ids=['every-step', 'diloco-16'])
def test_a_replica_stopped_past_the_heartbeat_heals_mid_run_and_ends_bit_identical(replicas, mode):
    started = [replicas.start(r, *ARGS, *mode) for r in range(2)]
    replicas.wait_for(lambda: min(replicas.position(i) for i in started) >= 20, STARTUP + 60)
    os.kill(replicas.process(started[1]).pid, signal.SIGSTOP)
    before = replicas.steps(started[0])
    time.sleep(8)
    assert replicas.steps(started[0]) > before + 5, replicas.describe()  # the other went on alone meanwhile
    os.kill(replicas.process(started[1]).pid, signal.SIGCONT)
    replicas.wait_for(lambda: all(replicas.done(i) for i in started), STARTUP + 120)
    assert [replicas.process(i).wait(30) for i in started] == [0, 0], replicas.describe()
    digests = [replicas.done(i) for i in started]
    assert digests[0][0] == digests[1][0], replicas.describe()  # bit-identical weights
    assert digests[0][3] == digests[1][3], replicas.describe()  # the same global metrics of the last epoch
    assert int(digests[1][1]) >= 1, replicas.describe()  # it healed ...
    assert _finished(replicas, started[0]) == (3, 0)
    epochs, restarts = _finished(replicas, started[1])
    assert (epochs, restarts >= 1) == (3, True), replicas.describe()  # ... mid-run, and ran the epochs asked
    lines = [line for line in replicas.err(started[1]).splitlines() if 'healed mid-run' in line]
    assert lines and re.fullmatch(r'torchbearer_dist: replica r1 healed mid-run at epoch \d, batch \d+ \(it was at '
                                  r'epoch \d, batch \d+\): its run ends after this step and begins again there',
                                  lines[0]), replicas.describe()


#: The one line of a replica stopped past the others' end: stopped while it trained (it then finds nobody at the
#: lighthouse), or while it asked for a quorum (the quorum's deadline passed meanwhile).
STOPPED = (r'error: this replica was stopped for \d+\.\d s \(SIGSTOP, a paused VM, swap\) (and finds no live replica '
           r'since: the others finished or were lost meanwhile; it stops rather than train on alone from where it was '
           r'\(restart it to start anew\)|while it asked for a quorum, past the quorum\'s timeout, and the others '
           r'went on without it; it stops rather than train on from where it was \(restart it: it heals from the '
           r'live replicas, or starts anew\))')


@pytest.mark.timeout(240)
@pytest.mark.parametrize('where', ['anywhere', 'entering-a-quorum'])
def test_a_replica_stopped_until_the_others_finished_stops_in_one_line_instead_of_training_alone(replicas, where):
    # Stopped wherever the signal lands (inside its quorum call, 2 runs in 7 said "no quorum within 9 s ... fewer
    # live replicas than the minimum"), or by itself as it enters its 21st quorum call: it then trained on alone and
    # ended at exit 0 with other weights than the replica that finished (its stop was read before the call only)
    own = ('--stop-in-quorum', '21') if where == 'entering-a-quorum' else ()
    started = [replicas.start(0, *ARGS), replicas.start(1, *ARGS, *own)]
    replicas.wait_for(lambda: min(replicas.position(i) for i in started) >= 20, STARTUP + 60)
    if own:
        replicas.wait_for(lambda: _state(replicas.process(started[1]).pid) == 'T', 10, starting=[started[1]])
    else:
        os.kill(replicas.process(started[1]).pid, signal.SIGSTOP)
    replicas.wait_for(lambda: replicas.done(started[0]), STARTUP + 120)
    assert replicas.process(started[0]).wait(30) == 0, replicas.describe()
    steps = replicas.steps(started[1])
    os.kill(replicas.process(started[1]).pid, signal.SIGCONT)
    assert replicas.process(started[1]).wait(3 * 3 + 3 + LOAD_SLACK) == 1, replicas.describe()
    assert replicas.steps(started[1]) <= steps + 1, replicas.describe()  # it did not train on alone
    last = replicas.err(started[1]).strip().splitlines()[-1]
    assert re.fullmatch(STOPPED, last), replicas.describe()
    assert not own or 'finds no live replica since' in last, last  # its quorum formed after the stop: alone


def _state(pid):
    with open('/proc/{}/stat'.format(pid)) as f:
        return f.read().rsplit(')', 1)[1].split()[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize('delay', [0.2, 0.8, 1.4])
def test_a_heal_whose_healer_is_killed_ends_bit_identical_on_the_others(tmp_path, delay):
    # A model of 460k values (3.7 MB with its momentum) so that a heal takes a while; replica 1 starts while 0 and 2
    # train and heals from one of them, which is killed about when the heal runs: cut or not, whichever healed it,
    # the two left end with the same weights and metrics. The lighthouse waits for two replicas: 0 and 2 start
    # together, whichever is up first (a replica that came first would train alone to the gate, where the other
    # would wait its whole quorum timeout for it).
    args = ('--replicas', '3', '--epochs', '2', '--samples', '1800', '--sleep', '0.05', '--timeout', '5',
            '--hidden', '20000')
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            gate = str(tmp_path / 'gate')  # 0 and 2 hold at their 20th step until replica 1 is up
            first = {r: replicas.start(r, *args, '--gate', gate, '--gate-step', '20') for r in (0, 2)}
            replicas.wait_for(lambda: min(replicas.position(i) for i in first.values()) >= 20, STARTUP + 60)
            late = replicas.start(1, *args)
            replicas.wait_for(lambda: 'READY' in replicas.out(late), STARTUP + 60)
            open(gate, 'w').close()
            time.sleep(delay)
            os.kill(replicas.process(first[0]).pid, signal.SIGKILL)
            left = (first[2], late)
            replicas.wait_for(lambda: all(replicas.done(i) for i in left), STARTUP + 180)
            assert [replicas.process(i).wait(30) for i in left] == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    assert replicas.done(left[0])[0] == replicas.done(left[1])[0], replicas.describe()
    assert replicas.done(left[0])[3] == replicas.done(left[1])[3], replicas.describe()
    assert _finished(replicas, left[1])[0] == 2, replicas.describe()
    assert int(replicas.done(late)[1]) >= 1, replicas.describe()  # it healed (from 0, from 2, or both)
