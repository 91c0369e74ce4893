"""The one multi-process helper of the test suite: real ranks over real gloo on loopback.

Distilled from PyTorch's ``MultiProcessTestCase``: the port is chosen in the parent, every rank is
a spawned process, the first failure stops the others and is re-raised with its rank, and a hard
deadline kills every rank so a hang fails one test instead of stalling the suite.
"""
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

import pytest

import torchbearer_dist

#: Collective and rendezvous timeout inside tests, seconds: short, so faults end fast.
PG_TIMEOUT = 10
#: Seconds the library's fault path may add after a fault is noticed: a peer waits up to 3 s for the
#: published cause, rank 0 up to 3 s more until the others have read it (see diagnosis.py).
CAUSE_WAIT = 6
#: Seconds to start ranks that import torch, on a loaded 2-core machine.
STARTUP = 30
#: Hard bound on one multi-process test, seconds.
DEADLINE = 60

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_workers(fn, world_size=2, args=(), kwargs=None, timeout=PG_TIMEOUT, deadline=DEADLINE, **launch_kwargs):
    """Run module-level ``fn(*args)`` on ``world_size`` ranks; return each rank's result in rank order."""
    return torchbearer_dist.launch(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, deadline=deadline,
                                   **launch_kwargs)


def run_in_step(scenarios):
    """Inside a worker: run ``(name, fn)`` pairs in order, stopping every rank after any rank fails.

    Starting ranks costs seconds, so a test file runs many scenarios in one launch. After each
    scenario the ranks agree whether any of them failed; if one did, no rank runs the next, so a
    failure can never leave the ranks waiting in different collectives.

    Returns:
        dict: name to ``{'value': what fn returned}`` or ``{'error': traceback text}``
    """
    results = {}
    for name, fn in scenarios:
        try:
            results[name] = {'value': fn()}
        except BaseException:
            results[name] = {'error': traceback.format_exc()}
        if torchbearer_dist.sync.collectives.any_rank('error' in results[name]):
            break
    return results


def scenario_values(per_rank, name):
    """Every rank's value of scenario ``name`` from :func:`run_in_step`; fail with a rank's traceback."""
    values = []
    for rank, results in enumerate(per_rank):
        if name not in results:
            pytest.fail('{} was not run: an earlier scenario failed'.format(name))
        if 'error' in results[name]:
            pytest.fail('rank {} failed in {}:\n{}'.format(rank, name, results[name]['error']))
        values.append(results[name]['value'])
    return values


def child_env(**extra):
    """Environment for a subprocess: one thread per rank and the package importable from the checkout."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=ROOT + os.pathsep + env.get('PYTHONPATH', ''))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_command(command, timeout=DEADLINE, env=None, **popen_kwargs):
    """Run ``command`` in its own session; kill the whole session at the deadline or on return.

    Returns:
        subprocess.CompletedProcess: with ``stdout`` and ``stderr`` as text, plus ``elapsed`` seconds
    """
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=child_env() if env is None else env, **popen_kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError('{} still running after {} s\nstdout:\n{}\nstderr:\n{}'.format(
            command, timeout, stdout[-3000:], stderr[-3000:])) from None
    finally:
        kill_session(process.pid)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    result.elapsed = time.monotonic() - started
    return result


def kill_session(pid):
    """SIGKILL every process of the session led by ``pid``, by process-group id, never by name."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python(*args):
    """A command line running this interpreter."""
    return [sys.executable, *args]


def free_port(host='127.0.0.1'):
    """A TCP port that is free on ``host`` right now (racy by nature: use it at once)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def snapshot(model):
    """A detached copy of ``model``'s parameters and buffers, to compare later."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
