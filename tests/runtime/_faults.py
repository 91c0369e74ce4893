"""Helpers of the fault tests: start hand-started ranks (``_fault_rank.py``), wait for their lines and
exits, and check that nothing is left running with the master port bindable again.
"""
import os
import select
import socket
import subprocess
import sys
import time

from _dist import CAUSE_WAIT, LOAD_SLACK, ROOT, child_env, kill_session, session
from _fault_rank import HERE, RENDEZVOUS_TIMEOUT, TIMEOUT

#: Seconds between heartbeats (runtime/_watchdog.py).
BEAT = 1
#: A dead peer ends the job: at worst its heartbeat is missed, then the cause is read; on a loaded machine.
DEAD_PEER_BOUND = RENDEZVOUS_TIMEOUT + BEAT + CAUSE_WAIT + LOAD_SLACK
#: Ctrl-C on a rank inside a collective: the watcher's grace (interrupts.py), then the cause is read; on a
#: loaded machine.
INTERRUPT_GRACE = 2
STOP_BOUND = INTERRUPT_GRACE + CAUSE_WAIT + BEAT + LOAD_SLACK
#: launch()'s grace between SIGTERM and SIGKILL, plus a second for the kernel to reap.
LAUNCH_STOP_BOUND = 3 + 1


def _start_rank(rank, port, *extra, world_size=2, host='127.0.0.1', timeout=TIMEOUT, env=None):
    command = [sys.executable, HERE, '--rank', str(rank), '--world-size', str(world_size), '--host', host,
               '--port', str(port), '--timeout', str(timeout), *map(str, extra)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env() if env is None else env, cwd=ROOT)


def _start_job(port, *extra, timeout=TIMEOUT):
    """Start ranks 0 and 1 with ``extra`` and return them once each has printed ``ready`` (training
    runs); kill both if one does not."""
    ranks = [_start_rank(r, port, *extra, timeout=timeout) for r in range(2)]
    try:
        for process in ranks:
            _wait_for_line(process, 'ready', timeout=90)
    except BaseException:
        _kill_all(ranks)
        raise
    return ranks


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
    """The lines of ``stderr`` that report an error: the rank program's ``error: ...``, and the line a rank
    says as it ends itself while gloo connects (``torchbearer_dist: error: ...``, group._end_a_stuck_connect),
    which no test counted before."""
    return [line for line in stderr.splitlines() if line.startswith(('error: ', 'torchbearer_dist: error: '))]


def _assert_gone(processes, port, within=None):
    """No process of the sessions of ``processes`` is left, and ``port`` binds again on 127.0.0.1."""
    deadline = time.monotonic() + (STOP_BOUND if within is None else within)
    while time.monotonic() < deadline and any(session(p.pid) for p in processes):
        time.sleep(0.05)
    left = {p.pid: session(p.pid) for p in processes if session(p.pid)}
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



def _start_launcher(port, start_method=None):
    command = [sys.executable, HERE, '--launch', '2', '--port', str(port), '--timeout', str(TIMEOUT)]
    if start_method is not None:
        command += ['--start-method', start_method]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env(TORCH_CPP_LOG_LEVEL='FATAL'), cwd=ROOT)


def _wait_for_ranks(launcher, count, timeout=90):
    """Wait until ``count`` ranks of the launcher's session are blocked in their collective."""
    deadline = time.monotonic() + timeout
    fd = launcher.stdout.fileno()
    seen = b''
    while seen.count(b'ready') < count:  # ranks print concurrently: lines may interleave
        if launcher.poll() is not None:
            raise AssertionError('the launcher ended with status {} before {} ranks were ready: {!r}; its stderr: '
                                 '{}'.format(launcher.returncode, count, seen, launcher.stderr.read()))
        assert time.monotonic() < deadline, 'ranks not ready: {!r}'.format(seen)
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 4096)
    time.sleep(0.5)
