"""The lighthouse seen from the replicas: lost mid-run, restarted on its address, or something else there.

First the watch's verdict (a pure function of observations) and its probe (real servers in this process); then
real replica processes (tests/ft/_replica.py) beside a lighthouse in a process of its own
(tests/ft/_lighthouse.py), which is killed, restarted or replaced. Every process and server is ended when its
test ends.
"""
import http.server
import os
import re
import socket
import subprocess
import threading
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, child_env, free_port, kill_session, python

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import HERE, Replicas  # noqa: E402

from torchbearer_dist.ft import _watch  # noqa: E402 (after the skip)
from torchbearer_dist.ft.replica import GRACE, QUORUM_TIMEOUTS, check_lighthouse  # noqa: E402

START = 'python -m torchbearer_dist.ft --min-replicas N'


# --- the verdict: a pure function of the probes' observations ----------------------------------------------------

def test_the_verdict_is_lost_once_after_its_bound_and_a_shorter_gap_is_back():
    verdict = _watch.Verdict(bound=3.0)
    assert verdict.observe(0.0, 'lighthouse') is None
    assert verdict.observe(0.3, 'unreachable') is None  # missing from here
    assert verdict.observe(2.0, 'unreachable') is None
    assert verdict.observe(2.3, 'lighthouse') == ('back', pytest.approx(2.0))
    assert verdict.gap == (0.3, 2.3) and verdict.missing_since() is None
    # A busy lighthouse (a probe or two unanswered, or one refused connection) is no event.
    for observations in (['silent', 'silent', 'silent'], ['unreachable']):
        for k, observation in enumerate(observations):
            assert verdict.observe(3.0 + k * 0.3, observation) is None
        assert verdict.observe(4.0, 'lighthouse') is None and verdict.gap == (3.0, 4.0)
    for t in (5.0, 6.0, 7.9):
        assert verdict.observe(t, 'unreachable') is None
    # What the last probe saw is what the line names: here something else took the address.
    assert verdict.observe(8.0, 'foreign', 'an HTTP server') == ('lost', 'foreign', 'an HTTP server', 3.0)
    assert verdict.observe(8.3, 'foreign') is None and verdict.observe(9.0, 'lighthouse') is None  # once, for good


def test_the_watch_finds_a_lost_lighthouse_within_its_timeout():
    events, lost = [], threading.Event()
    started = time.monotonic()
    watch = _watch.Watch('http://127.0.0.1:{}'.format(free_port()), 1.0, lambda e: (events.append(e), lost.set()))
    try:
        assert lost.wait(1.0 + LOAD_SLACK)
    finally:
        watch.stop()
    # Its first probe an interval late at most, the verdict at the timeout after the loss.
    assert events == [('lost', 'unreachable', 'ConnectionRefusedError', pytest.approx(0.9, abs=0.5))]
    assert time.monotonic() - started >= 0.9


# --- the probe, against what may listen at a lighthouse's address ---------------------------------------------

class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'hello')

    def log_message(self, *args):
        pass


def _http_server(port=0):
    server = http.server.ThreadingHTTPServer(('127.0.0.1', port), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def http_server():
    server = _http_server()
    yield 'http://127.0.0.1:{}'.format(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_listener():
    """A TCP listener that accepts and never answers."""
    sock = socket.socket()
    sock.bind(('127.0.0.1', 0))
    sock.listen(16)
    yield 'http://127.0.0.1:{}'.format(sock.getsockname()[1])
    sock.close()


def test_the_probe_tells_a_lighthouse_from_what_else_listens_at_its_address(http_server, silent_listener):
    from torchbearer_dist.ft import Lighthouse
    with Lighthouse(bind='127.0.0.1:0') as lighthouse:  # torchft's dashboard, read from _torchft: the canary
        port = lighthouse.address.rsplit(':', 1)[1]
        assert _watch.probe('http://127.0.0.1:' + port, 5.0) == ('lighthouse', 'a torchft lighthouse')
    assert _watch.probe(http_server, 5.0) == ('foreign', 'an HTTP server that answered 200 OK to GET /')
    assert _watch.probe(silent_listener, 0.5) == ('silent', 'no answer within 0.5 s')
    assert _watch.probe('http://127.0.0.1:{}'.format(free_port()), 5.0)[0] == 'unreachable'


@pytest.mark.timeout(180)
def test_something_else_at_the_address_is_named_before_the_first_quorum(http_server, silent_listener):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        check_lighthouse(http_server, 30.0)
    assert str(error.value) == (
        'something at {} answers but is not a torchft lighthouse (an HTTP server that answered 200 OK to GET /); '
        'start the lighthouse there ({}) or pass its address'.format(http_server, START))
    assert time.monotonic() - started < 10  # an answer: no need to wait the timeout
    with pytest.raises(RuntimeError) as error:
        check_lighthouse(silent_listener, 1.0)
    assert str(error.value) == (
        'something at {} accepts connections but did not answer as a torchft lighthouse within 1 s; start the '
        'lighthouse there ({}) or pass its address'.format(silent_listener, START))


# --- real replicas beside a lighthouse process -----------------------------------------------------------------

class LighthouseProcess:
    """tests/ft/_lighthouse.py at ``bind`` (and its ``options``) in a session of its own; ``wait``: binds once that
    file exists."""

    def __init__(self, tmp_path, bind, *options, wait=None):
        self.out = tmp_path / 'lighthouse-{}.out'.format(time.monotonic_ns())
        with open(self.out, 'w') as stdout:
            self.process = subprocess.Popen(
                python(os.path.join(HERE, '_lighthouse.py'), '--bind', bind, *options,
                       *(['--wait', wait] if wait else [])),
                stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True, env=child_env(RUST_LOG='warn'))

    def expect(self, word, deadline=STARTUP + 30):
        end = time.monotonic() + deadline
        while word not in self.out.read_text():
            assert self.process.poll() is None and time.monotonic() < end, self.out.read_text()
            time.sleep(0.05)

    def kill(self):
        kill_session(self.process.pid)
        self.process.wait()


def _said(replicas, i, pattern):
    return [line for line in replicas.err(i).splitlines() if re.fullmatch(pattern, line)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize('then', ['nothing', 'an HTTP server'])
def test_a_lost_lighthouse_stops_every_replica_in_one_line_within_its_timeout(tmp_path, then):
    # A timeout of 5 s: its bound plus the load's slack (13 s) is under the quorum's timeout (15 s), which was the
    # soonest a replica could tell before the watch.
    port, timeout = free_port(), 5
    url = 'http://127.0.0.1:{}'.format(port)
    lighthouse = LighthouseProcess(tmp_path, '127.0.0.1:{}'.format(port))
    replicas, server = Replicas(tmp_path, url), None
    try:
        lighthouse.expect('LISTENING')
        started = [replicas.start(r, '--replicas', '2', '--epochs', '50', '--timeout', str(timeout))
                   for r in range(2)]
        replicas.wait_for(lambda: min(replicas.steps(i) for i in started) >= 10, STARTUP + 60)
        lighthouse.kill()
        lost = time.monotonic()
        if then == 'an HTTP server':
            server = _http_server(port)  # takes the address at once
            line = ('error: something at {} answers but is not a torchft lighthouse (an HTTP server that answered '
                    '200 OK to GET /): the lighthouse was lost; start it there again ({}) and restart every '
                    'replica'.format(url, START))
        else:
            line = ('error: the lighthouse at {} was lost: nothing answered there for 5 s; start it there again ({}) '
                    'and restart every replica (a lighthouse back within 5 s is rejoined)'.format(url, START))
        # Every replica says so, in that one line, within its timeout and the load's slack.
        replicas.wait_for(lambda: all(_said(replicas, i, re.escape(line)) for i in started), timeout + LOAD_SLACK)
        said = time.monotonic() - lost
        # It ends with status 1 once torchft's quorum thread gives up (its Rust call: the quorum's timeout).
        for i in started:
            assert replicas.process(i).wait(QUORUM_TIMEOUTS * timeout + LOAD_SLACK) == 1, replicas.describe()
            assert replicas.err(i).strip().splitlines()[-1] == line, replicas.describe()
            assert 'Traceback' not in replicas.err(i), replicas.describe()
        print('every replica said so {:.1f} s after the lighthouse was lost, and ended {:.1f} s after'.format(
            said, time.monotonic() - lost))
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        replicas.kill_all()
        lighthouse.kill()


@pytest.mark.timeout(240)
def test_a_replica_that_waits_for_no_quorum_is_ended_in_one_line_soon_after(tmp_path):
    # DiLoCo's replicas meet rarely (every 10,000 steps here): the main thread trains on its own when the
    # lighthouse is lost, and never raises the error; the watch writes the line and ends the process.
    port, timeout = free_port(), 3
    url = 'http://127.0.0.1:{}'.format(port)
    lighthouse = LighthouseProcess(tmp_path, '127.0.0.1:{}'.format(port), '--min-replicas', '2')  # start together
    replicas = Replicas(tmp_path, url)
    try:
        lighthouse.expect('LISTENING')
        started = [replicas.start(r, '--replicas', '2', '--epochs', '50', '--timeout', str(timeout),
                                  '--local-steps', '10000', '--sleep', '0.02') for r in range(2)]
        replicas.wait_for(lambda: min(replicas.steps(i) for i in started) >= 10, STARTUP + 60)
        lighthouse.kill()
        lost = time.monotonic()
        line = ('torchbearer_dist: error: the lighthouse at {} was lost: nothing answered there for 3 s; start it '
                'there again ({}) and restart every replica (a lighthouse back within 3 s is rejoined) (replica r{{}} '
                'ends here: its main thread did not come to a quorum within 2 s)'.format(url, START))
        for i in started:
            assert replicas.process(i).wait(timeout + GRACE + LOAD_SLACK) == 1, replicas.describe()
            assert replicas.err(i).strip().splitlines()[-1] == line.format(i), replicas.describe()
        assert time.monotonic() - lost < timeout + GRACE + LOAD_SLACK
    finally:
        replicas.kill_all()
        lighthouse.kill()


@pytest.mark.timeout(300)
def test_a_lighthouse_restarted_on_its_address_within_the_timeout_is_rejoined(tmp_path):
    port = free_port()
    url, bind, timeout = 'http://127.0.0.1:{}'.format(port), '127.0.0.1:{}'.format(port), 5
    # Two replicas a quorum: they start together (one first alone would reach the gate while the other waited).
    first = LighthouseProcess(tmp_path, bind, '--min-replicas', '2')
    go, gate = str(tmp_path / 'go'), str(tmp_path / 'gate')
    replicas, second = Replicas(tmp_path, url), None
    try:
        first.expect('LISTENING')
        # The replicas hold at their 20th step until the second lighthouse is ready to bind (its start takes tens of
        # seconds on a loaded machine, where they would otherwise finish first), then train 280 steps more.
        args = ('--replicas', '2', '--epochs', '5', '--samples', '1200', '--timeout', str(timeout), '--sleep', '0.02',
                '--gate', gate, '--gate-step', '20')
        started = [replicas.start(r, *args) for r in range(2)]
        replicas.wait_for(lambda: min(replicas.position(i) for i in started) >= 20, STARTUP + 60)
        second = LighthouseProcess(tmp_path, bind, '--min-replicas', '2', wait=go)  # imported, waiting to bind
        second.expect('WAITING')
        open(gate, 'w').close()
        first.kill()
        before = [replicas.steps(i) for i in started]
        time.sleep(1.5)  # the replicas' probes find nothing there meanwhile (every 0.5 s)
        open(go, 'w').close()
        second.expect('LISTENING', 10)
        back = time.monotonic()
        # Every replica trains on with the new lighthouse (torchft retried the quorum in flight), within its timeout,
        # and one more where the new lighthouse's quorum numbers, from 1 again, cost a dropped step (a gloo timeout).
        replicas.wait_for(lambda: all(replicas.steps(i) >= before[k] + 10 for k, i in enumerate(started)),
                          2 * timeout + LOAD_SLACK)
        print('both trained 10 more steps {:.1f} s after the lighthouse was back'.format(time.monotonic() - back))
        replicas.wait_for(lambda: all(replicas.done(i) for i in started), STARTUP + 120)
        for i in started:
            assert replicas.process(i).wait(30) == 0, replicas.describe()
            # One line each says the lighthouse was missing and is back.
            assert len(_said(replicas, i, r'torchbearer_dist: replica r{} found the lighthouse at {} again after '
                                          r'[0-9.]+ s without an answer \(restarted\?\); training goes on'.format(
                                              i, re.escape(url)))) == 1, replicas.describe()
            assert 'error:' not in replicas.err(i) and 'Traceback' not in replicas.err(i), replicas.describe()
        # They end as one model: the same weights, bit for bit, and the same metrics.
        assert len({replicas.done(i)[0] for i in started}) == 1, replicas.describe()
        assert len({replicas.done(i)[3] for i in started}) == 1, replicas.describe()
    finally:
        replicas.kill_all()
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.timeout(180)
@pytest.mark.parametrize('what', ['http', 'silent'])
def test_a_replica_started_against_something_else_says_what_in_one_line(tmp_path, what, request):
    url = request.getfixturevalue('http_server' if what == 'http' else 'silent_listener')
    replicas = Replicas(tmp_path, url)
    try:
        i = replicas.start(0, '--timeout', '3')
        assert replicas.process(i).wait(STARTUP + 3 + LOAD_SLACK) == 1, replicas.describe()
        found = ('answers but is not a torchft lighthouse (an HTTP server that answered 200 OK to GET /)'
                 if what == 'http' else 'accepts connections but did not answer as a torchft lighthouse within 3 s')
        assert replicas.err(i).strip().splitlines() == [
            'error: something at {} {}; start the lighthouse there ({}) or pass its address'.format(url, found, START)]
    finally:
        replicas.kill_all()


def test_no_probe_of_the_watch_registers_with_the_lighthouse(tmp_path):
    # The watch asks for the dashboard: the lighthouse counts no heartbeating replica that would stall quorums.
    from torchbearer_dist.ft import Lighthouse
    with Lighthouse(bind='127.0.0.1:0') as lighthouse:
        url = 'http://127.0.0.1:' + lighthouse.address.rsplit(':', 1)[1]
        events = []
        watch = _watch.Watch(url, 1.0, events.append)
        try:
            time.sleep(1.0)
        finally:
            watch.stop()
        import urllib.request
        with urllib.request.urlopen(url + '/status', timeout=10) as response:
            status = response.read().decode()
        assert '[0 heartbeating]' in status, status
        assert watch.last is not None and watch.last[1] == 'lighthouse' and events == []

