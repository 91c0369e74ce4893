"""The one fold of why a rank stops (runtime/_decision.py): every rule on events and facts, no process, clock or
store."""
import signal
from dataclasses import replace
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis
from torchbearer_dist.runtime._decision import (
    ARGUMENT,
    CAUGHT,
    COLLECTIVE,
    FAIL,
    FORWARD,
    FOUND,
    INTERRUPTED,
    JOIN,
    LEAVE,
    NAME,
    OWN,
    PREEMPTED,
    PUBLISH,
    RAISE,
    READ,
    READERS,
    REPORTED,
    RETURN,
    RUN,
    SENSE,
    SETUP,
    STOP_PEERS,
    TICK,
    TOLD,
    UNCONNECTED,
    WAIT,
    WAKE,
    Decision,
    Event,
    Facts,
    Memory,
    Poll,
    State,
    Watch,
    classify,
    decide,
    fold,
)
from torchbearer_dist.runtime._timing import Timing
from torchbearer_dist.runtime.env import DistEnv
from torchbearer_dist.runtime.errors import GlooConnectError, PeerFailedError, Preempted

LIMIT = 10.0
TIMING = Timing(LIMIT, 600.0)


def _env(rank=1, world_size=2):
    return DistEnv(rank=rank, world_size=world_size, local_rank=rank, host='127.0.0.1', port=29500, backend='gloo',
                   timeout=timedelta(seconds=600), rendezvous_timeout=timedelta(seconds=LIMIT))


def _facts(phase, error=COLLECTIVE, rank=1, world_size=2, **kwargs):
    env = _env(rank, world_size)
    own = _diagnosis.own_cause(rank, ValueError('bad batch')) if error not in (COLLECTIVE, None) else None
    return Facts(env, phase, error, own, **kwargs)


BAD = _diagnosis.Cause(2, _diagnosis.LOCAL, 'ValueError', 'bad batch')
SILENT = _diagnosis.no_heartbeat(2, LIMIT)


def test_the_timing_is_derived_from_the_users_timeouts():
    assert (Timing(60.0).beat, Timing(2.0).beat, Timing(60.0).heartbeat_call, Timing(4.0).heartbeat_call) == (
        1.0, 0.5, 5.0, 2.0)
    assert (Timing(60.0).guess, Timing(2.0).guess, Timing(60.0).last_rank, Timing(60.0).listener) == (
        3.0, 2.0, 63.0, 95.0)
    assert Timing(60.0, 30.0).gloo_connect == 30.0 and Timing(60.0, 1800.0).gloo_connect == 60.0
    assert (Timing.READ_TIMED_OUT, Timing.CAUSE_WAIT) == (1.0, 3.0)


def test_classify_reads_what_was_caught_never_its_words():
    assert classify(ValueError('x'), RUN) == ARGUMENT
    assert classify(PeerFailedError('x', 1), JOIN) == REPORTED
    assert classify(Preempted(), RUN) == PREEMPTED
    assert classify(dist.DistNetworkError('Connection closed by peer'), RUN) == COLLECTIVE
    assert classify(RuntimeError('rank 1 did not join'), JOIN) == SETUP
    assert classify(RuntimeError('timed out'), RUN) == OWN  # its words sound like the network: still its own
    assert classify(KeyboardInterrupt(), JOIN) == OWN


def _fold(*events, rank=1, world_size=2, state=None):
    """The state and every action after folding ``events``, in order."""
    state, actions = state or State(_env(rank, world_size), timing=TIMING), []
    for event in events:
        state, more = fold(state, event)
        actions += more
    return state, actions


def test_the_heartbeat_publishes_where_the_store_answers_or_reads_another_ranks_cause():
    state, actions = _fold(Event(FOUND, cause=SILENT, store_answers=True))
    assert (state.heartbeat, actions) == (SILENT, [(PUBLISH, SILENT, True), (WAKE, True)])
    assert _fold(Event(FOUND, cause=SILENT, store_answers=False))[1] == [(WAKE, True)]
    state, actions = _fold(Event(FOUND, published=BAD))  # read by the heartbeat's thread
    assert (state.heartbeat, actions) == (BAD, [(WAKE, True)])


def test_a_job_of_one_and_a_preemption_in_the_block_raise_as_they_are():
    assert decide(_facts(RUN, world_size=1, rank=0), TIMING) == Decision(own=True)
    assert decide(_facts(RUN, PREEMPTED, heartbeat=SILENT), TIMING) == Decision(own=True)


def test_a_clean_end_reports_only_a_peer_that_fell_silent_before_leaving():
    assert decide(_facts(LEAVE, None), TIMING) == Decision(own=True)
    assert decide(_facts(LEAVE, None, heartbeat=SILENT), TIMING) == Decision(SILENT)


@pytest.mark.parametrize('rank', [0, 1])
def test_at_the_join_each_rank_says_its_own_argument_error_and_rank_0_keeps_the_store_for_a_reported_one(rank):
    assert decide(_facts(JOIN, ARGUMENT, rank=rank), TIMING) == Decision(own=True)
    assert decide(_facts(JOIN, REPORTED, rank=rank, reported=2), TIMING) == Decision(
        own=True, readers=rank == 0, skip=2)


def test_at_the_join_the_rendezvous_words_are_published_by_rank_0_only_and_anything_else_by_any_rank():
    mine = _diagnosis.own_cause(1, ValueError('bad batch'))
    assert decide(_facts(JOIN, SETUP), TIMING) == Decision(mine, own=True)
    assert decide(_facts(JOIN, SETUP, rank=0), TIMING).publish and decide(_facts(JOIN, SETUP, rank=0), TIMING).readers
    assert decide(_facts(JOIN, OWN), TIMING) == Decision(mine, own=True, publish=True)


@pytest.mark.parametrize('rank', [0, 1])
def test_gloos_failed_connect_is_this_ranks_interface_unless_the_heartbeat_found_a_peer_at_fault(rank):
    assert classify(GlooConnectError('gloo on rank 1 could not connect'), JOIN) == UNCONNECTED
    mine = _diagnosis.own_cause(rank, ValueError('bad batch'))
    # no peer at fault: this rank's own words, published by rank 0 only (its store ends with it), as the rendezvous'
    assert decide(_facts(JOIN, UNCONNECTED, rank=rank), TIMING) == Decision(
        mine, own=True, publish=rank == 0, readers=rank == 0)
    # the heartbeat named a peer first: that peer, as for any failure of the join
    peer = decide(_facts(JOIN, UNCONNECTED, rank=rank, heartbeat=SILENT, watching=True), TIMING)
    assert (peer.cause, peer.own, peer.skip) == (SILENT, False, 2)
    state = State(_env(rank), timing=TIMING)
    _, actions = fold(state, Event(CAUGHT, error=GlooConnectError('x'), phase=JOIN))
    assert actions[-1] == (RAISE, None) if rank else actions[-1][0] == READERS
    found, _ = fold(state, Event(FOUND, cause=SILENT))
    _, actions = fold(found, Event(CAUGHT, error=GlooConnectError('x'), phase=JOIN))
    assert actions[-1] == (RAISE, SILENT)  # no heartbeat memory: nobody to wait for


def test_a_heartbeats_cause_wins_over_what_the_store_says():
    facts = _facts(RUN, heartbeat=SILENT, gathered=True, published=BAD, master='refused')
    assert decide(facts, TIMING).cause == SILENT
    assert decide(_facts(RUN, heartbeat=SILENT), TIMING).read is None  # nothing to gather


def test_a_pause_of_this_rank_just_ended_names_it_on_a_collective_error_in_the_block_only():
    frozen = _diagnosis.frozen(1, 25.0, LIMIT)
    assert decide(_facts(RUN, frozen=frozen), TIMING).cause == frozen
    assert decide(_facts(RUN, OWN, frozen=frozen), TIMING).cause.kind == _diagnosis.LOCAL
    assert decide(_facts(JOIN, frozen=frozen), TIMING).read is not None


def test_a_published_guess_that_this_rank_was_lost_read_right_after_its_own_pause_is_that_pause():
    # CI, issue 42's stop: rank 1, stopped past the limit, read rank 0's "no heartbeat from rank 1" before the
    # store went, and said that instead of its own pause
    frozen, lost = _diagnosis.frozen(1, 25.0, LIMIT), _diagnosis.no_heartbeat(1, LIMIT)
    back = dict(now=101.0, memory=Memory(awake=101.0, resumed=101.0, frozen=(25.0, 100.0)))  # a second after it
    assert _fold(Event(FOUND, published=lost, **back))[1] == [(WAKE, True)]
    assert _fold(Event(FOUND, published=lost, **back))[0].heartbeat == frozen
    assert _fold(Event(FOUND, published=lost))[0].heartbeat == lost  # not paused
    for other in (SILENT, BAD, _diagnosis.own_cause(1, ValueError('bad batch'))):  # another rank; its own words
        assert _fold(Event(FOUND, published=other, **back))[0].heartbeat == other


def test_a_collective_error_asks_the_store_first_briefly_after_a_timeout_which_a_death_does_not_end():
    assert decide(_facts(RUN), TIMING).read == Timing.CAUSE_WAIT
    assert decide(_facts(RUN, timed_out=True), TIMING).read == Timing.READ_TIMED_OUT == 1.0
    # rank 1's beat unchanged for the limit (timed out: it fell silent, then went) or for a moment (it died)
    for changed, actions in ((90.0, [(WAIT,), (READ, False)]), (99.9, [(PUBLISH, _diagnosis.died([1]), False)])):
        seen = Memory(awake=100.0, resumed=0.0, last={1: 5}, changed={1: changed}, dead={1: 99.95})
        state, _ = _fold(Event(CAUGHT, 100.0, seen, error=dist.DistNetworkError('closed'), phase=RUN), rank=0)
        assert _fold(Event(TOLD, 100.1, seen), state=state)[1][:len(actions)] == actions


def _told(**kwargs):
    return decide(_facts(RUN, gathered=True, **kwargs), TIMING)


def test_which_cause_explains_a_collective_error_in_order():
    gone = _told(master='refused', published=BAD).cause
    assert gone.message.startswith('rank 0 (the master at 127.0.0.1:29500) is gone')
    assert _told(published=BAD, dead=(2,)).cause == BAD
    assert _told(store_failed=True, dead=(2,)).cause.message.startswith('rank 0 (the master')
    assert _told(dead=(2,)).cause == _diagnosis.died([2])
    assert _told(dead=(2,), timed_out=True).cause.message.startswith('no answer from rank 0 for 600 s')
    guess = _told(master='silent')
    assert guess.cause.guess and guess.cause.line().startswith('rank 0 closed its connection')
    assert decide(_facts(RUN, rank=0, world_size=3, gathered=True, store_failed=True), TIMING).cause.rank == -1


def test_this_ranks_own_cause_read_back_from_the_store_is_raised_as_its_own_error():
    mine = _diagnosis.Cause(1, _diagnosis.LOCAL, 'KeyboardInterrupt', 'interrupted (SIGINT)')
    assert _told(published=mine).own and not _told(published=replace(mine, rank=0)).own


@pytest.mark.parametrize('rank, cause, published', [
    (0, SILENT, True), (1, SILENT, True), (1, _diagnosis.no_heartbeat(0, LIMIT), False), (0, BAD, True),
    (1, replace(BAD, rank=0), True)])
def test_in_the_block_a_cause_is_published_where_the_store_lives_and_the_peers_are_stopped(rank, cause, published):
    found = decide(_facts(RUN, rank=rank, heartbeat=cause), TIMING)
    assert found == Decision(cause, publish=published, readers=rank == 0, skip=cause.rank, stop_peers=True)


def test_at_the_join_a_guess_waits_for_the_heartbeat_two_beats_and_a_second():
    facts = _facts(JOIN, gathered=True, watching=True, failed_at=100.0, now=100.5)
    assert decide(facts, TIMING).until == 100.0 + TIMING.guess
    assert decide(replace(facts, now=100.0 + TIMING.guess), TIMING).cause.guess
    assert decide(replace(facts, watching=False), TIMING).until is None
    assert decide(replace(facts, heartbeat=SILENT), TIMING).cause == SILENT


@pytest.mark.parametrize('rank', [0, 1])
def test_at_the_join_only_rank_0_publishes_a_peers_cause(rank):
    found = decide(_facts(JOIN, rank=rank, heartbeat=SILENT, watching=True), TIMING)
    assert found == Decision(SILENT, publish=rank == 0, readers=rank == 0, skip=2)
    assert not decide(_facts(JOIN, rank=0, heartbeat=SILENT), TIMING).publish  # no heartbeat: no store kept


GRACE, BOUND = 3.0, 63.0


def _end(states, exitcodes, preempted=False, stopped=()):
    """What launch does after one :class:`Poll` of ranks that have all ended, or failed past the grace."""
    watch = Watch(GRACE, BOUND, failed_at=0.0)
    return fold(watch, Poll(10.0, tuple(exitcodes), tuple(states), frozenset(stopped), preempted))[1][-1]


def test_launch_names_an_own_error_then_a_silent_death_then_a_peer_failure():
    assert _end(['peer', 'own', None], [1, 1, -9]) == (NAME, 1, True)
    assert _end(['peer', 'ok', None], [1, 0, -9]) == (NAME, 2, True)
    assert _end(['peer', None, 'ok'], [1, None, 0]) == (NAME, 0, True)
    assert _end(['ok', None, 'ok'], [0, 0, 0]) == (NAME, 1, True)  # it ended without a word
    assert _end([None, 'ok', None], [75, 0, 75]) == (  # every rank left was pre-empted
        FAIL, Preempted, 'every rank was pre-empted after its checkpoint; run again to resume', False)
    assert _end([None, 'ok', None], [75, 0, None]) == (NAME, 0, True)
    assert _end(['ok', 'ok'], [0, 0]) == (RETURN,)


def test_restarts_follow_torchrun_except_after_the_users_stop_or_the_deadline():
    """launch(max_restarts=R) starts every rank again as the end says. A failure to start the ranks at all (their
    function not picklable) never reaches the fold: launch raises it (test_launch_restarts)."""
    assert _end(['own', 'peer'], [1, 1]) == (NAME, 0, True)  # a rank's own error, deterministic or not
    assert _end([None, 'peer'], [-signal.SIGKILL, 1]) == (NAME, 0, True)  # a rank killed
    assert _end(['own', 'peer'], [None, 1]) == (NAME, 0, True)  # a rank still running, stopped by launch
    assert _end(['own', 'peer'], [130, 1]) == (NAME, 0, False)  # a rank's Ctrl-C
    assert _end([None, 'peer'], [-signal.SIGINT, 1]) == (NAME, 0, False)
    assert _end(['own', 'peer'], [1, 1], preempted=True) == (NAME, 0, False)  # a pre-emption signal to the launcher
    line = 'ranks [1] still running after the 5 s deadline; stopped them'
    assert fold(Watch(GRACE, BOUND, 5.0), Poll(5.5, (0, None), ('ok', None), stalled=frozenset()))[1] == (
        (FAIL, RuntimeError, line, False),)
    assert fold(Watch(GRACE, BOUND, 5.0), Poll(5.0, (None, None), (None, None)))[1] == ((WAIT,),)


def test_a_rank_left_running_alone_is_sensed_and_a_stopped_one_named_first():
    """A rank that ended well leaves the others alone: the applier senses which used no CPU for the bound (a frozen
    rank, stopped by launch, is restarted unless the launcher was pre-empted); after a failure none is sensed."""
    watch, poll = Watch(GRACE, BOUND), Poll(70.0, (0, None, None), ('ok', None, None), frozenset({2}))
    watch, actions = fold(watch, poll)
    assert actions == ((SENSE, [1, 2]),) and watch == Watch(GRACE, BOUND)
    assert fold(watch, replace(poll, stalled=frozenset()))[1] == ((WAIT,),)
    line = ('rank {} did not end within 63 s of the other ranks, and used no CPU meanwhile: it is frozen (stopped '
            'by a signal, or stuck in native code); stopped it')
    assert fold(watch, replace(poll, stalled=frozenset({1, 2})))[1] == ((FAIL, RuntimeError, line.format(2), True),)
    assert fold(watch, replace(poll, stalled=frozenset({1}), stopped=frozenset()))[1] == (
        (FAIL, RuntimeError, line.format(1), True),)
    assert fold(replace(watch, preempted=True), replace(poll, stalled=frozenset({1}), preempted=True))[1] == (
        (FAIL, RuntimeError, line.format(1), False),)
    assert fold(watch, Poll(70.0, (1, None), ('own', None)))[1] == ((WAIT,),)  # a failure: the grace


def test_a_preemption_signal_is_passed_on_once_and_a_failure_waits_the_grace_unless_the_rest_are_stopped():
    watch, actions = fold(Watch(GRACE, BOUND), Poll(1.0, (None, None), (None, None), preempted=True))
    assert actions == ((FORWARD, [0, 1]), (WAIT,)) and watch.preempted
    watch, actions = fold(watch, Poll(2.0, (75, None), (None, None), preempted=True))
    assert actions == ((WAIT,),) and watch.failed_at == 2.0
    assert fold(watch, Poll(2.0 + GRACE, (75, None), (None, None), preempted=True))[1] == ((WAIT,),)
    assert fold(watch, Poll(2.1 + GRACE, (75, None), (None, None), preempted=True))[1] == ((NAME, 0, False),)
    assert fold(watch, Poll(2.5, (75, None), (None, None), frozenset({1}), True))[1] == ((NAME, 0, False),)
    assert fold(watch, Poll(2.5, (75, 75), (None, None), preempted=True))[1][0][:2] == (FAIL, Preempted)


def test_a_connection_closed_in_a_job_of_three_names_the_rank_whose_beat_stopped_on_rank_0():
    """gloo's 'Connection closed by peer' names no rank; rank 0 reads every rank's beat: the one unchanged for
    longer than a live rank's ever is, Timing.named after the failure, is the rank that closed it."""
    assert (Timing(60.0).named, Timing(2.0).named) == (4.0, 2.5)  # three beats and a second
    facts = _facts(RUN, rank=0, world_size=3, gathered=True, watching=True, failed_at=100.0, now=101.0,
                   silences={1: 2.0, 2: 0.5})
    assert decide(facts, TIMING).until == 100.0 + TIMING.named
    later = replace(facts, now=100.0 + TIMING.named)
    named = decide(replace(later, silences={1: TIMING.guess + 0.1, 2: TIMING.guess - 0.1}), TIMING)
    assert named == Decision(_diagnosis.closed(1), publish=True, readers=True, skip=1, stop_peers=True)
    assert decide(replace(later, silences={1: 5.0, 2: 5.0}), TIMING).cause.rank == -1  # two stopped: no name
    assert decide(replace(later, silences={1: 1.0, 2: 1.0}), TIMING).cause.rank == -1
    assert decide(replace(facts, silences={}), TIMING).until is None  # no beats read: nothing to wait for


def test_a_closed_connection_that_names_no_rank_is_not_published_by_a_rank_other_than_0():
    """Rank 0 names the rank; the others wake it (they stop their peers), wait for its cause, which their heartbeat
    reads, and publish none: it comes Timing.named after rank 0's failure, or when rank 0's heartbeat names the
    silent rank, at the latest."""
    facts = _facts(RUN, rank=2, world_size=3, gathered=True, watching=True, failed_at=100.0, now=101.0,
                   silences={0: 0.5})
    assert decide(facts, TIMING) == Decision(until=100.0 + LIMIT + TIMING.named, stop_peers=True)
    assert TIMING.told == LIMIT + 3 * TIMING.beat + 1.0
    assert not decide(replace(facts, phase=JOIN), TIMING).stop_peers
    late = decide(replace(facts, now=100.0 + TIMING.told), TIMING)
    assert late.cause.rank == -1 and not late.publish and late.stop_peers
    assert decide(replace(facts, heartbeat=_diagnosis.closed(1)), TIMING).cause == _diagnosis.closed(1)
    assert decide(replace(facts, watching=False), TIMING).until is None


@pytest.mark.parametrize('world_size', [1, 2])
def test_a_ctrl_c_the_main_thread_did_not_take_is_this_ranks_own_cause_told_to_its_peers(world_size):
    """The Ctrl-C watcher asks too: its rank's own cause, published and its collective failed where peers wait."""
    state, actions = _fold(Event(INTERRUPTED), rank=0, world_size=world_size)
    mine = _diagnosis.interrupted(0)
    assert actions == ([(PUBLISH, mine, False), (WAKE, False)] if world_size > 1 else []) and state.heartbeat is None
    assert mine.line() == 'rank 0 failed: KeyboardInterrupt: interrupted (SIGINT)'


def test_the_main_threads_stop_folds_its_error_the_stores_answers_and_its_readers():
    """A peer killed: rank 0 catches gloo's closed connection, reads the store until its heartbeat's sample of
    /proc sees the peer gone, publishes that, stops the peers, waits for its readers and raises; later facts
    change nothing. Rank 1 first asks whether the master's port accepts: refused, rank 0 is gone."""
    error = dist.DistNetworkError('Connection closed by peer')
    alive, gone = Memory(awake=100.0, resumed=0.0), Memory(awake=100.2, resumed=0.0, dead={1: 100.1})
    state, actions = _fold(Event(CAUGHT, 100.0, alive, error=error, phase=RUN), rank=0)
    assert actions == [(READ, False)] and state.until == 100.0 + Timing.CAUSE_WAIT
    state, actions = _fold(Event(TOLD, 100.05, alive), state=state)
    assert actions == [(WAIT,), (READ, False)]  # nothing yet: read again
    state, actions = _fold(Event(TOLD, 100.25, gone), state=state)
    died = _diagnosis.died([1])
    assert actions == [(PUBLISH, died, False), (STOP_PEERS,), (READERS, (), False)]
    assert _fold(Event(TOLD, 100.3, gone, read=True), state=state)[1] == [(RAISE, died)]
    assert _fold(Event(TOLD, 100.3, gone), state=state)[1] == [(WAIT,), (READERS, (), False)]  # not yet read
    assert _fold(Event(TOLD, 100.25 + Timing.READERS, gone), state=state)[1] == [(RAISE, died)]  # waited enough
    assert _fold(Event(FOUND, 100.4, gone, cause=SILENT), state=state)[1] == []
    state, actions = _fold(Event(CAUGHT, 100.0, alive, error=error, phase=RUN), rank=1)
    assert actions == [(READ, True)]
    # rank 2 of 3: a closed connection names no rank; it stops its peers once (rank 0 then decides too), and waits
    state, _ = _fold(Event(CAUGHT, 100.0, alive, error=error, phase=RUN), rank=2, world_size=3)
    state, actions = _fold(Event(TOLD, 100.0 + Timing.CAUSE_WAIT, alive), state=state)
    assert actions == [(STOP_PEERS,), (WAIT,)] and _fold(Event(TICK, 103.1, alive), state=state)[1] == [(WAIT,)]
    gone_master = _diagnosis.master_gone(_env())
    assert _fold(Event(TOLD, 100.1, alive, master='refused'), state=state)[1] == [
        (STOP_PEERS,), (RAISE, gone_master)]


def test_no_module_but_the_fold_names_a_cause():
    """How a reader checks that no failure cause is chosen outside the fold: every :class:`~._diagnosis.Cause` is
    made by :mod:`._decision` (or by the words themselves), and only the applier and the rendezvous (a peer's
    published cause, which the fold then classifies as REPORTED) turn one into a PeerFailedError."""
    import ast
    import pathlib

    import torchbearer_dist
    makers = {name for name, value in vars(_diagnosis).items()
              if callable(value) and getattr(value, '__module__', None) == _diagnosis.__name__} - {
        'publish', 'read_cause', 'describe', 'is_guess', '_named'}
    root = pathlib.Path(torchbearer_dist.__file__).parent
    made, raised = set(), set()
    for path in sorted(root.rglob('*.py')):
        where = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in makers:
                made.add(where)  # imported by name (the words' own module aside)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in makers and ast.unparse(node.func.value) in ('_diagnosis', 'causes'):
                    made.add(where)
                if node.func.attr == 'from_cause':
                    raised.add(where)
    assert 'Cause' in makers and made - {'runtime/_diagnosis.py'} == {'runtime/_decision.py'}, made
    assert raised == {'runtime/_live.py', 'runtime/rendezvous.py'}, raised
