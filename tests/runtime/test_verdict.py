"""The heartbeat's verdicts over thousands of simulated schedules: no clock, thread or socket.

A small discrete-event model of a job plays what :class:`~torchbearer_dist.runtime._watchdog.Watchdog`'s
two threads see on every rank: each rank's heartbeat thread makes a store round (add its counter,
check the ``error`` key, read the watched counters) a beat after the last one ended, late by what
the load adds; its watch thread wakes four times per beat, late too, and asks
:func:`~torchbearer_dist.runtime._verdict.judge`. The store lives in rank 0's process: stopped with
it, gone with it, or blocking every call (until the client's timeout) when rank 0's host is down. A
process stopped (``kill -STOP``, a paused machine) runs none of its events until it continues. A
rank that judges a failure publishes it where the store answers and ends (rank 0 after waiting for
its readers, at most 3 s, as ``_diagnosis.wait_until_read``).

Healthy schedules, which must never be judged failed: beats late by up to the limit less one beat
(each rank's store rounds at most a limit apart), one rank slowed so throughout, the whole job
stopped for any length of time (a stop shorter than half the limit counts in the rounds' spacing:
the watch thread cannot tell it from load), ranks leaving cleanly at the end. Failures, which must
be judged within their bound by every other rank, naming the rank at fault: a rank stopped alone for
good (or its main thread holding the GIL: rank 0's store still answers then), rank 0's host gone
silent, a local rank killed, a rank raising its own error. A rank stopped alone for longer than the
limit that then continues names its own pause.
"""
import heapq
import os
import random
from dataclasses import dataclass, field, replace
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchbearer_dist.runtime import _diagnosis, _verdict
from torchbearer_dist.runtime._verdict import (
    DIED,
    FROZEN,
    LEFT,
    MASTER_SILENT,
    PUBLISHED,
    SILENT,
    Limits,
    Observation,
    Sample,
    Verdict,
    judge,
    paused,
    start,
)
from torchbearer_dist.runtime.env import DistEnv
from torchbearer_dist.runtime.errors import PeerFailedError

INF = float('inf')
#: Schedules per property: about 25 s for both on one core; the soak step (TORCHBEARER_DIST_TEST_SOAK=1) tries 20x,
#: drawn anew each time, where the test pass draws the same schedules every run (derandomize).
SOAK = os.environ.get('TORCHBEARER_DIST_TEST_SOAK') == '1'
EXAMPLES = 20000 if SOAK else 1000
#: The rendezvous timeouts tried: the beat is a quarter of the short ones, a second for the others.
LIMITS = (1.0, 2.0, 3.0, 6.0, 10.0)
#: Seconds between a rank's verdict and its exit: publish, wake, unwind (rank 0 waits for its readers).
EXIT_AFTER = 0.2
#: A store call's way there or back takes at most this many beats (under load).
MAX_LATENCY = 0.2
READERS_WAIT = 3.0
#: A published cause ends every other rank within this many seconds of being published.
PUBLISHED_BOUND = 2.0


def _beat(limit):
    return min(1.0, limit / 4)


@dataclass
class Rank:
    rank: int
    host: int
    stopped: list = field(default_factory=list)  # [begin, end) intervals in which the process does not run
    exit: float = INF  # when its process is gone
    gil: float = INF  # from when its Python threads do not run, its process alive (rank 0's store answers)
    left: float = INF  # when it marks itself left, then exits a moment later
    slow: float = 0.0  # the largest extra delay of a beat (the load)
    edge: float = 0.0  # when not 0: half its beats as late as this spacing allows (beats and rounds)
    count: int = 0  # its heartbeat counter in the store
    beats: list = field(default_factory=list)  # when it beat
    seen: Sample = None
    failed: float = -INF
    failures: int = 0
    memory: object = None
    verdict: tuple = None  # (time, Verdict)

    def resumes(self, t):
        """When this process runs an event due at ``t``: after any stop that holds ``t``."""
        for begin, end in self.stopped:
            if begin <= t < end:
                t = end
        return t


class Job:
    """One simulated job: the store, the ranks, and their threads' events in time order."""

    def __init__(self, rnd, world_size, limit, ranks, horizon, store_down=INF, spurious_after_stop=False,
                 latency=MAX_LATENCY):
        self.rnd, self.limit, self.beat, self.horizon = rnd, limit, _beat(limit), horizon
        self.latency = latency
        self.ranks, self.store_down = ranks, store_down
        self.client_timeout = min(5.0, limit / 2)
        self.error, self.published = INF, None  # when the first cause was published, and it
        self.spurious_after_stop = spurious_after_stop
        self.events, self.order = [], 0
        self.limits = {r.rank: Limits(r.rank, tuple(o for o in (range(world_size) if r.rank == 0 else [0])
                                                    if o != r.rank), limit) for r in ranks}
        for r in ranks:
            r.seen, r.memory = Sample(0.0, 0.0), start(0.0)
            self._at(r.resumes(self.beat + self._late(r)), 'round', r)
            self._at(r.resumes(self.beat / 4 + self._late(r, watch=True)), 'wake', r)

    # ---------------------------------------------------------------- the model
    def _late(self, r, watch=False):
        """A thread's extra delay: small always, up to the rank's ``slow`` for a beat under load."""
        small = self.rnd.uniform(0, 0.02 * self.beat)
        if watch or not r.slow:
            return small
        return self.rnd.choice((r.slow, self.rnd.uniform(0, r.slow))) if self.rnd.random() < 0.5 else small

    def _latency(self):
        """A store call's way there or back: quick, or late under load (the thread waits for the GIL)."""
        if self.rnd.random() < 0.1:
            return self.rnd.uniform(0, self.latency * self.beat)
        return self.rnd.uniform(0, 0.005 * self.beat)

    def _at(self, t, kind, r, *args):
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, r, args))

    def _alive(self, r, t):
        return t < r.exit and t < r.gil

    def _store(self, t, latency=None):
        """``('ok', served)`` or ``('fail', when)`` for a call issued at ``t``."""
        zero = self.ranks[0]
        if t >= zero.exit:
            return 'fail', t  # refused: the store went with rank 0's process
        if t >= self.store_down:
            return 'fail', t + self.client_timeout
        for begin, end in zero.stopped:
            if begin <= t < end:
                return ('ok', end) if end - t <= self.client_timeout else ('fail', t + self.client_timeout)
        return 'ok', t + (self._latency() if latency is None else latency)

    def _dead(self, r, t):
        return frozenset(o.rank for o in self.ranks if o is not r and o.host == r.host and o.exit <= t)

    def _call(self, r, t, round_, call):
        """Issue ``r``'s store call number ``call`` at ``t``: the store serves it, or it fails."""
        status, when = self._store(t, round_['latencies'].pop() if round_.get('latencies') else None)
        if self.spurious_after_stop and r.stopped and r.stopped[0][1] <= t:  # the first call after the stop
            self.spurious_after_stop = False  # times out: its timer ran out during the stop
            status, when = 'fail', t + self.rnd.uniform(0, 0.05 * self.beat)
        if status == 'fail':
            self._at(r.resumes(when), 'seen', r, None)
        else:
            self._at(when, 'serve', r, round_, call)

    def _serve(self, r, t, round_, call):
        """The store serves ``r``'s call at ``t``; its answer reaches the thread a latency later."""
        if call == 0:
            r.count += 1
            r.beats.append(t)
        elif call == 1:
            round_['error'] = t >= self.error
        else:
            round_['values'] = tuple(o.count for o in self.ranks if o.rank in self.limits[r.rank].watched)
        back = t + (round_['latencies'].pop() if round_.get('latencies') else self._latency())
        if call < 2:
            self._call(r, r.resumes(back), round_, call + 1)
        else:
            self._at(r.resumes(back), 'seen', r, Sample(round_['began'], r.resumes(back), round_['error'],
                                                        round_['values']))

    def _next_round(self, r, t):
        """Schedule ``r``'s next round after the one that ended at ``t``; at the edge, its beat and its end
        land just inside ``edge`` of the last ones."""
        if r.edge and r.beats and self.rnd.random() < 0.5:
            latencies = [self._latency() for _ in range(6)]  # there and back, three calls; popped from the end
            beat_at = min(r.beats[-1] + r.edge, t + r.edge - sum(latencies[:5])) * (1 - 1e-9)
            began = beat_at - latencies[5]
            if began >= t + self.beat:
                self._at(r.resumes(began), 'round', r, latencies)
                return
        self._at(r.resumes(t + self.beat + self._late(r)), 'round', r)

    def _end(self, r, t, verdict):
        r.verdict = (t, verdict)
        if verdict.kind != PUBLISHED and verdict.store_answers and self.published is None:
            if self._store(t)[0] == 'ok':
                self.error, self.published = t, (verdict.kind, verdict.rank)
        r.exit = min(r.exit, t + (READERS_WAIT if r.rank == 0 else EXIT_AFTER))

    def run(self):
        while self.events:
            t, _, kind, r, args = heapq.heappop(self.events)
            if t > self.horizon or not self._alive(r, t) or r.verdict is not None:
                continue
            if t >= r.left:  # marked left: no longer watched, its threads stopped, soon gone
                r.count += LEFT
                r.gil, r.exit = t, min(r.exit, t + self.rnd.uniform(0.001, EXIT_AFTER))
                continue
            if kind == 'round':
                self._call(r, t, {'began': t, 'latencies': list(args[0]) if args else None}, 0)
            elif kind == 'serve':
                self._serve(r, t, *args)
            elif kind == 'seen':
                sample, = args
                if sample is None:
                    r.failed, r.failures = t, r.failures + 1
                else:
                    r.seen, r.failures = sample, 0
                self._next_round(r, t)
            else:
                seen = Observation(t, r.seen, r.failed, r.failures, self._dead(r, t))
                r.memory, verdict = judge(r.memory, seen, self.limits[r.rank])
                if verdict is not None:
                    self._end(r, t, verdict)
                else:
                    self._at(r.resumes(t + self.beat / 4 + self._late(r, watch=True)), 'wake', r)
        return self

    def named(self, r):
        """The rank that ``r``'s verdict names: the rank at fault, or the published cause's."""
        t, verdict = r.verdict
        return self.published[1] if verdict.kind == PUBLISHED else verdict.rank


def _ranks(rnd, world_size):
    return [Rank(r, host=0 if r == 0 else rnd.choice((0, 1))) for r in range(world_size)]


# -------------------------------------------------------------------- healthy schedules
@st.composite
def healthy_jobs(draw):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    world_size = draw(st.integers(2, 4))
    limit = draw(st.sampled_from(LIMITS))
    stop = draw(st.one_of(st.just(0.0), st.floats(0.0, 5.0)))  # the whole job stopped, in limits
    slowed = draw(st.sampled_from(['none', 'all', 'one']))
    spurious = draw(st.booleans())
    return seed, world_size, limit, stop * limit, slowed, spurious


@pytest.mark.timeout(1800 if SOAK else 180)
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not SOAK,
          suppress_health_check=[HealthCheck.too_slow])
@given(healthy_jobs())
def test_no_healthy_schedule_is_ever_judged_failed(job):
    seed, world_size, limit, stop, slowed, spurious = job
    rnd, beat = random.Random(seed), _beat(limit)
    ranks = _ranks(rnd, world_size)
    # a beat late by up to the limit less one beat: store rounds at most the limit apart, counting a
    # stop of the whole job that the watch thread cannot tell from load (shorter than half the limit)
    slow = limit - beat - 6 * MAX_LATENCY * beat - (stop if stop <= limit / 2 + beat else 0.0)
    for r in ranks:
        r.slow = slow if slowed == 'all' or (slowed == 'one' and r.rank == world_size - 1) else 0.0
        r.edge = limit if r.slow and (stop == 0.0 or stop > limit / 2 + beat) else 0.0
    at = rnd.uniform(0, 2 * limit)
    for r in ranks:
        r.stopped = [(at, at + stop)] if stop else []
    end = at + stop + 3 * limit
    for r in ranks[1:]:
        r.left = end + rnd.uniform(0, beat)
    ranks[0].left = end + 2 * beat
    spurious = spurious and stop > limit / 2 + beat  # a failed round after a short stop is one beat fewer: load
    j = Job(rnd, world_size, limit, ranks, horizon=end + 4 * beat, spurious_after_stop=spurious).run()
    assert [(r.rank, r.verdict) for r in ranks if r.verdict is not None] == [], (job, [r.slow for r in ranks])
    assert j.published is None


# -------------------------------------------------------------------- failures
@st.composite
def failed_jobs(draw):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    world_size = draw(st.integers(2, 4))
    limit = draw(st.sampled_from(LIMITS))
    fault = draw(st.sampled_from(['stopped', 'gil', 'host down', 'killed', 'raised', 'paused alone']))
    culprit = 0 if fault == 'host down' else draw(st.integers(0, world_size - 1))
    return seed, world_size, limit, fault, culprit


@pytest.mark.timeout(1800 if SOAK else 180)
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not SOAK,
          suppress_health_check=[HealthCheck.too_slow])
@given(failed_jobs())
def test_every_failure_is_named_within_its_bound_by_every_other_rank(job):
    seed, world_size, limit, fault, culprit = job
    rnd, beat = random.Random(seed), _beat(limit)
    ranks = _ranks(rnd, world_size)
    if fault == 'killed':
        ranks[culprit].host = 0
        for r in ranks:  # the killed rank is local to every rank that watches it
            r.host = 0 if culprit == 0 or r.rank == 0 else r.host
    at = rnd.uniform(beat, 2 * limit)
    bad = ranks[culprit]
    store_down = INF
    pause = limit + 3 * beat + rnd.uniform(0, 2) * limit  # long enough to be judged
    if fault in ('stopped', 'paused alone'):
        bad.stopped = [(at, INF if fault == 'stopped' else at + pause)]
    elif fault == 'gil':
        bad.gil = at
    elif fault == 'host down':
        store_down, bad.gil = at, at
    elif fault == 'killed':
        bad.exit = at
    horizon = at + pause + 3 * limit + READERS_WAIT + 3
    j = Job(rnd, world_size, limit, ranks, horizon=horizon, store_down=store_down, latency=0.02)
    if fault == 'raised':  # its own error: published, then the rank exits (rank 0 after its readers)
        j.error, j.published = at, ('local', culprit)
        bad.gil, bad.exit = at, at + (READERS_WAIT if culprit == 0 else EXIT_AFTER)
    j.run()
    last_beat = max([0.0] + [b for b in bad.beats if b <= at])
    others = [r for r in ranks if r is not bad]
    missing = [r.rank for r in others if r.verdict is None]
    assert missing == [], (job, [(r.rank, r.verdict) for r in ranks])
    for r in others:
        t, verdict = r.verdict
        assert j.named(r) == culprit, (job, r.rank, r.verdict, j.published)
        if verdict.kind == PUBLISHED:
            assert t - j.error <= min(PUBLISHED_BOUND, 1.5 * beat), (job, r.rank, r.verdict, j.error)
            continue
        assert fault != 'raised', (job, r.rank, r.verdict)
        if verdict.kind == SILENT:  # silent for the limit at least, named a beat or two after it
            assert fault in ('stopped', 'gil', 'paused alone'), (job, r.rank, verdict)
            # the round that reads the silence may itself be late by its store calls (three, there and back)
            bound = last_beat + limit + 2.5 * beat + 6 * j.latency * beat
            assert last_beat + limit < t <= bound, (job, r.rank, verdict, last_beat)
        elif verdict.kind == MASTER_SILENT:
            assert culprit == 0 and t <= at + limit + 1.5 * beat + j.client_timeout, (job, r.rank, verdict)
            assert t >= at + limit - 1.1 * beat, (job, r.rank, verdict)
        else:
            assert (verdict.kind, fault) == (DIED, 'killed') and t <= at + 2 * beat, (job, r.rank, verdict)
    if fault == 'paused alone' and bad.verdict is not None:  # it names its own pause, or reads that cause
        t, verdict = bad.verdict
        assert j.named(bad) == culprit and verdict.kind in (FROZEN, PUBLISHED), (job, bad.verdict)


# -------------------------------------------------------------------- single rules, by hand
LIM = Limits(rank=0, watched=(1,), limit=4.0)


def _fold(limits, *observations):
    memory, verdicts = start(0.0), []
    for seen in observations:
        memory, verdict = judge(memory, seen, limits)
        verdicts.append(verdict)
    return memory, verdicts


def test_a_silence_counts_from_the_sample_that_saw_the_last_beat_to_the_round_that_read_it_unchanged():
    first = Sample(0.9, 1.0, False, (1,))
    late = Sample(4.95, 5.5, False, (1,))  # read no earlier than 4.95: silent for 3.95 s at least
    later = Sample(5.05, 5.1, False, (1,))
    _, verdicts = _fold(LIM, Observation(1.0, first), Observation(1.25, first), Observation(1.5, first),
                        Observation(1.75, first), Observation(2.0, first), Observation(2.25, first),
                        Observation(2.5, first), Observation(2.75, first), Observation(3.0, first),
                        Observation(3.25, first), Observation(3.5, first), Observation(3.75, first),
                        Observation(4.0, first), Observation(4.25, first), Observation(4.5, first),
                        Observation(4.75, first), Observation(5.5, late), Observation(5.75, later))
    assert verdicts[:-1] == [None] * (len(verdicts) - 1)
    assert verdicts[-1] == _verdict.Verdict(SILENT, 1, 4.0, True)


def test_a_wake_up_gap_longer_than_the_limit_is_this_ranks_own_pause_and_wins_for_a_limit():
    limits = Limits(rank=1, watched=(0,), limit=4.0)
    memory, verdicts = _fold(limits, Observation(1.0, Sample(0.9, 1.0, False, (1,))),
                             Observation(11.0, Sample(0.9, 1.0, False, (1,))))
    assert verdicts == [None, None]  # nothing read before the pause is judged
    assert paused(memory, 14.0, limits) == 10.0
    assert paused(replace(memory, awake=15.25), 15.5, limits) is None  # a limit after it
    assert paused(start(0.0), 4.5, limits) == 4.5  # before the watch thread has woken again


def test_a_single_failed_store_round_after_a_pause_is_not_the_pause():
    limits = Limits(rank=1, watched=(0,), limit=4.0)
    ok = Sample(10.5, 10.6, False, (5,))
    _, verdicts = _fold(limits, Observation(1.0, Sample(0.9, 1.0, False, (1,))),
                        Observation(10.0, Sample(0.9, 1.0, False, (1,))),
                        Observation(10.25, Sample(0.9, 1.0, False, (1,)), failed=10.2, failures=1),
                        Observation(10.75, ok, failed=10.2), Observation(11.0, ok, failed=10.2))
    assert verdicts == [None] * 5
    _, verdicts = _fold(limits, Observation(1.0, Sample(0.9, 1.0, False, (1,))),
                        Observation(10.0, Sample(0.9, 1.0, False, (1,))),
                        Observation(11.25, Sample(0.9, 1.0, False, (1,)), failed=11.2, failures=2))
    assert verdicts == [None, None, _verdict.Verdict(FROZEN, 1, 9.0, False)]


def test_a_local_peer_gone_after_marking_itself_left_is_not_named():
    # seen gone at 2.0; a round begun before that may have read the counter before the leave mark
    _, verdicts = _fold(LIM, Observation(1.0, Sample(0.9, 1.0, False, (3,))),
                        Observation(2.0, Sample(1.9, 2.1, False, (3,)), dead=frozenset([1])),
                        Observation(2.25, Sample(1.9, 2.1, False, (3,)), dead=frozenset([1])),
                        Observation(3.25, Sample(3.0, 3.1, False, (3 + LEFT,)), dead=frozenset([1])))
    assert verdicts == [None] * 4
    _, verdicts = _fold(LIM, Observation(1.0, Sample(0.9, 1.0, False, (3,))),
                        Observation(2.0, Sample(0.9, 1.0, False, (3,)), dead=frozenset([1])),
                        Observation(3.25, Sample(3.0, 3.1, False, (4,)), dead=frozenset([1])))
    assert verdicts == [None, None, _verdict.Verdict(DIED, 1, 0.0, True)]


def test_a_published_cause_wins_over_what_this_rank_finds():
    _, verdicts = _fold(LIM, Observation(1.0, Sample(0.9, 1.0, False, (1,))),
                        Observation(9.0, Sample(8.9, 9.0, True, (1,)), dead=frozenset([1])))
    assert verdicts == [None, _verdict.Verdict(PUBLISHED, -1, 0.0, True)]


# -------------------------------------------------------------------- causes, from facts
ENV = DistEnv(rank=1, world_size=2, local_rank=1, host='10.0.0.1', port=29500, backend='gloo',
              timeout=timedelta(seconds=60), rendezvous_timeout=timedelta(seconds=4))


def test_each_verdict_is_reported_as_its_cause():
    line = {kind: None if cause is None else (cause.rank, cause.kind, cause.line()) for kind, cause in (
        (kind, _diagnosis.cause_of(Verdict(kind, rank, seconds, True), ENV)) for kind, rank, seconds in (
            (PUBLISHED, -1, 0.0), (SILENT, 0, 4.0), (DIED, 0, 0.0), (MASTER_SILENT, 0, 4.0), (FROZEN, 1, 9.6)))}
    assert line == {
        PUBLISHED: None,
        SILENT: (0, 'network', 'no heartbeat from rank 0 for 4 s: its host is down or the network is partitioned (a '
                               'rank that is merely busy keeps beating); check that host and the network, or raise '
                               'rendezvous_timeout='),
        DIED: (0, 'peer', 'rank 0 died without reporting an error: it was killed (by the OOM killer, or a signal) '
                          'or crashed in native code; see its log and dmesg'),
        MASTER_SILENT: (0, 'network', 'no answer from rank 0 (the master at 10.0.0.1:29500) for 4 s: its host is '
                                      'down or the network is partitioned; check that host and the network, or raise '
                                      'rendezvous_timeout='),
        FROZEN: (1, 'network', 'rank 1 did not run for 10 s, longer than the rendezvous timeout (4 s), and the other '
                               'ranks took it for lost: it was stopped (Ctrl-Z, kill -STOP), its machine was paused, '
                               'or its main thread held the GIL in one native call; let it run, or raise '
                               'rendezvous_timeout=')}


def _raised(error, filename):
    try:
        exec(compile('raise error', filename, 'exec'), {'error': error})
    except BaseException as caught:
        return caught


def test_a_collective_error_is_told_by_its_type_and_where_it_was_raised_not_by_its_words():
    inside = os.path.join(os.path.dirname(dist.__file__), 'distributed_c10d.py')
    assert _diagnosis.is_collective_error(_raised(RuntimeError('Connection reset by peer'), inside))
    assert _diagnosis.is_collective_error(_raised(RuntimeError('Application timeout caused pair closure'), inside))
    assert _diagnosis.is_collective_error(dist.DistStoreError('anything'))
    # the rank's own errors, whatever they say
    assert not _diagnosis.is_collective_error(_raised(RuntimeError('Connection reset by peer'), 'train.py'))
    assert not _diagnosis.is_collective_error(_raised(RuntimeError('DataLoader timed out'), 'train.py'))
    assert not _diagnosis.is_collective_error(_raised(ValueError('bad batch'), inside))
    assert not _diagnosis.is_collective_error(PeerFailedError('rank 0 failed: ValueError: bad batch', 0, 'local'))


def test_a_guess_is_a_fact_of_the_cause_and_travels_through_the_store():
    closed = _diagnosis.Cause(1, _diagnosis.PEER, '', 'rank 1 closed its connection', guess=True)
    assert _diagnosis.is_guess(closed) and _diagnosis.Cause.from_json(closed.to_json()) == closed
    assert not _diagnosis.is_guess(_diagnosis.died([1]))
    assert not _diagnosis.is_guess(_diagnosis.own_cause(1, ValueError('closed its connection without reporting')))
    assert _diagnosis.is_guess(_diagnosis.no_heartbeat(1, 4.0))
    # a cause published by a rank of an older release, without the field
    assert _diagnosis.Cause.from_json('{"exc_type": "", "kind": "peer", "message": "m", "rank": 1}').guess is False


def test_a_peers_silence_is_read_from_the_heartbeats_memory_not_from_an_error():
    limits = _verdict.Limits(0, (1, 2), 4.0)
    memory, _ = _verdict.judge(_verdict.start(0.0), _verdict.Observation(
        0.5, _verdict.Sample(0.1, 0.2, False, (3, 5))), limits)
    memory, _ = _verdict.judge(memory, _verdict.Observation(
        1.5, _verdict.Sample(1.1, 1.2, False, (4, 5 + _verdict.LEFT))), limits)
    assert _verdict.silence(memory, 3.2) == pytest.approx(2.0)  # rank 1 changed at 1.2; rank 2 left
    assert _verdict.silence(_verdict.start(0.0), 3.0) is None
    assert _diagnosis._is_timeout(RuntimeError('Timed out waiting'), None, 4.0) is False
    assert _diagnosis._is_timeout(RuntimeError('anything'), 2.5, 4.0) is True
