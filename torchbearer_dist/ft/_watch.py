"""(private) The lighthouse, watched from each replica: lost, back again, or something else at its address.

torchft's Manager talks to the lighthouse only inside a quorum, which waits up to three ``timeout``\\ s and then
says nothing of why. So a thread of each :class:`~torchbearer_dist.ft.replica.Replica` probes the lighthouse
every :func:`interval`: an HTTP request for its dashboard (:func:`probe`; never a heartbeat nor a quorum, which
would register a replica that does not exist and stall the live ones' quorums). Each probe is one observation:

- ``'lighthouse'``: its dashboard answered;
- ``'unreachable'``: no connection (nothing listens there, or the host is gone);
- ``'foreign'``: something answered, and it is not a torchft lighthouse (another HTTP server, another protocol);
- ``'silent'``: something accepts connections and does not answer.

:class:`Verdict` turns the observations into events, a pure function of them (no clock, thread or socket
inside); :class:`Watch` only samples, and hands each event to its owner.
"""
import http.client
import socket
import threading
import time
from urllib.parse import urlparse

from torchbearer_dist.ft._torchft import DASHBOARD_TITLE

LIGHTHOUSE, UNREACHABLE, FOREIGN, SILENT = 'lighthouse', 'unreachable', 'foreign', 'silent'


def interval(timeout):
    """Seconds between two probes of a replica of ``timeout``: a tenth of it, at most one."""
    return min(1.0, timeout / 10.0)


def probe_timeout(timeout):
    """Seconds one probe waits for a connection, then for an answer: a third of ``timeout``, from a probe's
    interval to two seconds."""
    return max(interval(timeout), min(timeout / 3.0, 2.0))


def probe(url, timeout):
    """What answers at ``url`` (``http://host:port``): a pair (observation, what was seen, in words). The
    connection, then the answer, each wait up to ``timeout`` seconds."""
    parsed = urlparse(url)
    try:
        sock = socket.create_connection((parsed.hostname, parsed.port), timeout=timeout)
    except OSError as e:  # refused, no route, timed out
        return UNREACHABLE, type(e).__name__
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    connection.sock = sock
    try:
        connection.request('GET', '/', headers={'Connection': 'close'})
        response = connection.getresponse()
        body = response.read(8192).decode('utf-8', 'replace')
    except socket.timeout:
        return SILENT, 'no answer within {:g} s'.format(timeout)
    except (ConnectionError, http.client.RemoteDisconnected):
        return FOREIGN, 'it closed the connection without an answer'
    except (OSError, http.client.HTTPException) as e:
        return FOREIGN, 'an answer that is not HTTP: {}'.format(type(e).__name__)
    finally:
        connection.close()
    if response.status == 200 and DASHBOARD_TITLE in body:
        return LIGHTHOUSE, 'a torchft lighthouse'
    return FOREIGN, 'an HTTP server that answered {} {} to GET /'.format(response.status, response.reason)


class Verdict:
    """Events of one lighthouse from its observations, fed in time order by :meth:`observe`.

    Args:
        bound (float): seconds without a ``'lighthouse'`` observation after which it is lost

    An event is ``('lost', observation, what, seconds)`` once, when no probe found the lighthouse for ``bound``
    seconds (``observation``, ``what``: the last probe's), or ``('back', seconds)`` when it answers again after
    at least two probes found nothing listening (a restart; a probe or two without an answer is a busy lighthouse).
    """

    def __init__(self, bound):
        self.bound, self.since, self.lost, self.unreachable = bound, None, False, 0
        self.gap = None  # the last time the lighthouse was missing and found again: (since, found again)

    def observe(self, t, observation, what=''):
        """The event that observation ``observation`` (``what``, in words) at time ``t`` makes, or None."""
        if self.lost:
            return None
        if observation == LIGHTHOUSE:
            since, unreachable, self.since, self.unreachable = self.since, self.unreachable, None, 0
            if since is None:
                return None
            self.gap = (since, t)
            return ('back', t - since) if unreachable >= 2 else None
        if self.since is None:
            self.since = t
        self.unreachable += observation == UNREACHABLE
        if t - self.since >= self.bound:
            self.lost = True
            return 'lost', observation, what, t - self.since
        return None

    def missing_since(self):
        """When the probes stopped finding the lighthouse (None: the last one found it)."""
        return self.since


class Watch:
    """A daemon thread probing the lighthouse at ``url`` every :func:`interval` of ``timeout``, until :meth:`stop`.

    Each event of its :class:`Verdict` (lost after ``timeout``) goes to ``on_event(event)``, on this thread.
    """

    def __init__(self, url, timeout, on_event, name='torchbearer_dist-lighthouse-watch'):
        self.url, self.timeout, self.on_event = url, timeout, on_event
        self.interval, self.probe_timeout = interval(timeout), probe_timeout(timeout)
        # A probe finds a lost lighthouse at most an interval late: the verdict comes `timeout` after the loss.
        self.verdict = Verdict(max(timeout - self.interval, self.interval))
        self.last = None  # the last observation: (time, observation, what)
        self._lock, self._stopped = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stopped.wait(self.interval):
            t = time.monotonic()
            observation, what = probe(self.url, self.probe_timeout)
            if self._stopped.is_set():
                return
            event = self.observe(t, observation, what)
            if event is not None:
                self.on_event(event)

    def observe(self, t, observation, what=''):
        """Feed the verdict one observation, from any thread (the owner's: a quorum the lighthouse formed, which
        shows it alive however slow its dashboard); the event it makes, or None."""
        with self._lock:
            self.last = (t, observation, what)
            return self.verdict.observe(t, observation, what)

    def missing_since(self):
        """When the probes stopped finding the lighthouse, on ``time.monotonic()``; None if the last found it."""
        return self.verdict.missing_since()

    def stop(self):
        """End the thread (at its next wake); idempotent."""
        self._stopped.set()
