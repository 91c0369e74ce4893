"""Canaries for what torchbearer_dist.ft._torchft reads of torchft's internals (torchft 0.2.0): each fails, naming
the detail, if a new torchft moves it. Real torchft objects in this process, a real lighthouse."""
import threading
import time

import pytest

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from torchbearer_dist.ft import Lighthouse, _torchft, _watch  # noqa: E402 (after the skip)
from torchbearer_dist.ft.replica import Replica  # noqa: E402


def test_a_lighthouse_serves_its_dashboard_with_the_title_the_watch_looks_for():
    with Lighthouse(bind='127.0.0.1:0') as lighthouse:
        url = 'http://127.0.0.1:' + lighthouse.address.rsplit(':', 1)[1]
        assert _watch.probe(url, 10.0) == ('lighthouse', 'a torchft lighthouse'), (
            'torchft\'s lighthouse no longer serves "{}" at /: update _torchft.DASHBOARD_TITLE'.format(
                _torchft.DASHBOARD_TITLE))


def test_the_heal_transport_keeps_its_http_server_where_the_quieting_reaches_it():
    from datetime import timedelta

    from torchft.checkpointing import HTTPTransport
    transport = HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0)
    try:
        server = _torchft.heal_server(transport)
        assert hasattr(server, 'RequestHandlerClass') and callable(server.handle_error), (
            'HTTPTransport._server is no longer a socketserver server: update _torchft.heal_server')
        assert callable(getattr(server.RequestHandlerClass, 'log_message', None))
    finally:
        transport.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_a_wait_for_the_quorum_in_flight_ends_at_once_when_woken():
    # Two replicas needed, one there: its quorum waits (up to 3 x 2 s) until woken.
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=1.0, heartbeat_timeout=2.0) as lighthouse:
        url = 'http://127.0.0.1:' + lighthouse.address.rsplit(':', 1)[1]
        replica = Replica(url, 'canary', lambda payload: None, lambda: {}, timeout=2.0, host='127.0.0.1')
        try:
            woken = []
            timer = threading.Timer(0.5, lambda: woken.append(_torchft.wake_quorum_wait(replica.manager)))
            started = time.monotonic()
            timer.start()
            with pytest.raises(TimeoutError):  # from Future.result(), woken with the future still running
                replica.manager.start_quorum()
            assert woken == [True] and time.monotonic() - started < 5.0, (  # unwoken, it waits 6 s
                'Manager._quorum_future is no longer waited for in start_quorum: update _torchft.wake_quorum_wait')
            assert _torchft.wake_quorum_wait(object()) is False  # nothing in flight: nothing to wake
        finally:
            replica.shutdown()


@pytest.mark.timeout(120)
def test_the_quorum_id_is_read_where_torchft_keeps_it_and_stays_while_the_membership_does():
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=1.0, heartbeat_timeout=2.0) as lighthouse:
        url = 'http://127.0.0.1:' + lighthouse.address.rsplit(':', 1)[1]
        replica = Replica(url, 'canary', lambda payload: None, lambda: {}, timeout=5.0, host='127.0.0.1')
        try:
            before = _torchft.quorum_id(replica.manager)
            replica.start_quorum()
            first = _torchft.quorum_id(replica.manager)
            replica.start_quorum()
            assert isinstance(first, int) and first != before and _torchft.quorum_id(replica.manager) == first, (
                'Manager._quorum_id no longer holds the last quorum\'s id: update _torchft.quorum_id')
        finally:
            replica.shutdown()


@pytest.mark.timeout(120)
def test_a_heal_staged_by_a_deferred_quorum_loads_at_once_and_every_replica_has_its_place_in_the_group():
    # Replica a trains two steps alone; b joins: its quorum stages a's state, load_heal loads it before b's
    # start_quorum returns; b counts for nothing in that step, but votes at its own rank of the quorum's group.
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0) as lighthouse:
        url = 'http://127.0.0.1:' + lighthouse.address.rsplit(':', 1)[1]
        loaded, replicas = [], []
        try:
            a = Replica(url, 'a', lambda payload: None, lambda: {'from': 'a'}, timeout=10.0, host='127.0.0.1',
                        deferred=True)
            replicas.append(a)
            for _ in range(2):
                a.start_quorum(wait=False)
                a.finish_quorum()
                assert a.should_commit()
            b = Replica(url, 'b', loaded.append, lambda: {'from': 'b'}, timeout=10.0, host='127.0.0.1', deferred=True)
            replicas.append(b)

            def train_until_joined():  # the lighthouse may form a's next quorum before b asks: a asks again
                for _ in range(100):
                    a.start_quorum(wait=False)
                    a.finish_quorum()
                    if a.members()[1] == 2:
                        return
                    a.should_commit()
            healer = threading.Thread(target=train_until_joined)
            healer.start()
            b.start_quorum()
            healer.join(30)
            assert loaded == [{'from': 'a'}], (
                'Manager._healing / _apply_pending_state_dict no longer load a staged heal: update _torchft.load_heal')
            assert not b.manager.is_participating() and a.manager.num_participants() == 1
            assert sorted([a.members(), b.members()]) == [(0, 2), (1, 2)], (
                'ProcessGroupWrapper._rank or _pg no longer hold the quorum\'s group: update _torchft.members')
        finally:
            for replica in replicas:
                replica.shutdown()
