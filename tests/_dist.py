"""The multi-process helpers of the test suite: real ranks over real gloo on loopback.

:func:`run_workers` is distilled from PyTorch's ``MultiProcessTestCase`` and shares no code with the
package's own :func:`torchbearer_dist.launch`, so that a launcher bug fails the launcher's tests
(tests/runtime/test_launch.py) instead of failing or masking every multi-rank test: the port is
chosen in the parent, every rank is a fresh process that joins with ``torch.distributed`` itself,
the first failure kills every rank and is re-raised with that rank's traceback, and a hard deadline
kills every rank so a hang fails one test instead of stalling the suite.
"""
import contextlib
import ctypes
import datetime
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing import connection, get_context

import pytest

import torchbearer_dist

#: Collective and rendezvous timeout inside tests, seconds: short, so faults end fast.
PG_TIMEOUT = 10
#: Seconds the library's fault path may add after a fault is noticed: a peer waits up to 3 s for the
#: published cause, rank 0 up to 3 s more until the others have read it (see runtime/_diagnosis.py).
CAUSE_WAIT = 6
#: Seconds to start ranks that import torch, on a loaded 2-core machine.
STARTUP = 30
#: Seconds a machine loaded about 6x its cores may add to a fault's own bound (its timeout, its waits):
#: threads woken late, processes that exit and are reaped slowly. Bounds are the fault's plus this, never
#: a guess at the machine's speed.
LOAD_SLACK = 8
def _cuda_devices():
    import torch
    return torch.cuda.device_count()


#: Where the one-GPU tests train (tests/e2e/test_gpu.py, tests/ft/test_cuda.py): ``cuda`` (cuda:0 for every rank or
#: replica) or ``cpu``, to check their bodies on a machine without a GPU.
DEVICE = os.environ.get('TORCHBEARER_DIST_TEST_DEVICE', 'cuda')
ON_GPU = DEVICE.split(':')[0] == 'cuda'
#: The one-GPU tests' marks: gpu where they train on CUDA (skipped, saying so, without one); plain slow tests on
#: the CPU (nothing skips them).
ONE_DEVICE = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_devices(), reason='needs 1 GPU')] \
    if ON_GPU else [pytest.mark.slow]
#: Hard bound on one multi-process test, seconds: a hang (no CPU used) fails at it; see :class:`HangGuard`.
DEADLINE = 60
#: How far past its deadline a guarded test may run while its processes still use the CPU (a loaded
#: machine slows a healthy test several times over; a hang uses no CPU and fails at the deadline).
STRETCH = 4
#: Progress: the guarded processes used at least PROGRESS_CPU CPU-seconds in the last PROGRESS_WINDOW s.
PROGRESS_CPU, PROGRESS_WINDOW = 0.5, 10.0
#: Whether soak tests (many repeats of one scenario) run: CI sets it in a step of its own.
SOAK = os.environ.get('TORCHBEARER_DIST_TEST_SOAK') == '1'

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: torchrun itself, found through this Python whether or not the venv's bin is on PATH.
TORCHRUN = [sys.executable, '-m', 'torch.distributed.run']


class WorkerFailed(RuntimeError):
    """A rank of :func:`run_workers` raised; the message holds that rank's traceback."""

    def __init__(self, rank, text):
        super().__init__('rank {} failed:\n{}'.format(rank, text))
        self.rank, self.text = rank, text


def cpu_seconds(pids=(), session=None):
    """CPU time, user and system, that processes ``pids`` and every process of session ``session`` have
    used (their reaped children included); processes already gone count no more."""
    if session is not None:
        pids = set(pids) | {int(name) for name in os.listdir('/proc') if name.isdigit()}
    total = 0
    for pid in pids:
        try:
            with open('/proc/{}/stat'.format(pid)) as f:
                fields = f.read().rsplit(')', 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue
        if session is None or int(fields[3]) == session:
            total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return total / os.sysconf('SC_CLK_TCK')


class HangGuard:
    """A multi-process test's deadline that bounds a hang, not the machine's speed.

    Past ``deadline`` seconds the guard expires unless the guarded processes still use the CPU
    (:data:`PROGRESS_CPU` in the last :data:`PROGRESS_WINDOW` s): a rank blocked on a peer or in a
    deadlock uses none and fails at the deadline, as before, while a healthy test that a machine
    loaded 6x its cores slows down runs on, up to :data:`STRETCH` times the deadline.
    """

    def __init__(self, deadline, pids=(), session=None):
        self.deadline, self.pids, self.session = deadline, list(pids), session
        self.started = time.monotonic()
        self._samples = []  # (time, CPU-seconds), one a second at most

    def expired(self):
        """Whether the guarded processes are past their deadline and no longer progress."""
        now = time.monotonic()
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, cpu_seconds(self.pids, self.session)))
            while len(self._samples) > 2 and self._samples[1][0] <= now - PROGRESS_WINDOW:
                self._samples.pop(0)
        elapsed = now - self.started
        if elapsed <= self.deadline:
            return False
        if elapsed > STRETCH * self.deadline:
            return True
        (then, before), (_, latest) = self._samples[0], self._samples[-1]
        return now - then >= PROGRESS_WINDOW and latest - before < PROGRESS_CPU

    def describe(self):
        """Why it expired, for the failure's message."""
        elapsed = time.monotonic() - self.started
        if elapsed > STRETCH * self.deadline:
            return 'after {:.0f} s, {}x the {:g} s deadline, still using the CPU'.format(
                elapsed, STRETCH, self.deadline)
        return 'after the {:g} s deadline, using under {:g} CPU-s in the last {:g} s (a hang)'.format(
            self.deadline, PROGRESS_CPU, PROGRESS_WINDOW)


def run_workers(fn, world_size=2, args=(), kwargs=None, timeout=None, deadline=DEADLINE, backend='gloo',
                group='torch'):
    """Run module-level ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return each rank's result in rank order.

    Args:
        fn: a module-level function (it is pickled by name)
        world_size (int): how many ranks
        timeout (float): the process group's collective timeout, seconds; by default :data:`PG_TIMEOUT`
            stretched by the machine's load (:func:`loaded`): a healthy test's rank may wait that long
            for a peer that the load slowed, and a fault test passes its own
        deadline (float): seconds after which every rank is killed and the test fails, unless the ranks
            still use the CPU (:class:`HangGuard`)
        backend (str): ``'gloo'`` or ``'nccl'``
        group (str): ``'torch'`` joins with :func:`torch.distributed.init_process_group` only, as a
            user's own script would; ``'package'`` joins with :func:`torchbearer_dist.process_group`,
            for tests of what the package's group adds (its timeouts, its environment); ``'none'``
            joins no group: ``fn`` makes its own (its environment is set as torchrun sets it)

    Raises:
        WorkerFailed: a rank raised (the first to report), with its traceback
        AssertionError: a rank died without a report, or the deadline passed
    """
    timeout = loaded(PG_TIMEOUT) if timeout is None else timeout
    context = _context()
    port = free_port()
    pipes, processes = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=False)
            process = context.Process(target=_rank_main, name='rank-{}'.format(rank), args=(
                fn, rank, world_size, port, backend, timeout, group, args, kwargs or {}, child_end))
            process.start()
            child_end.close()
            pipes.append(parent_end)
            processes.append(process)
        return _collect(processes, pipes, deadline)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join()
        for pipe in pipes:
            pipe.close()


#: What the ranks' forkserver imports once: every rank is forked from it with these already imported,
#: instead of importing torch afresh (about 2 CPU-seconds a rank, most of a small test's cost).
PRELOAD = ['torch', 'torch.distributed', 'torchbearer', 'torchbearer_dist']


def _context():
    """multiprocessing's forkserver, preloading :data:`PRELOAD`: a rank starts in milliseconds.

    The server is a process of its own that imported nothing else and started no thread, so a fork
    of it is as clean as a spawned interpreter; the ranks are its children, and die with it.
    """
    context = get_context('forkserver')
    context.set_forkserver_preload(PRELOAD)
    return context


def _collect(processes, pipes, deadline):
    results, guard = {}, HangGuard(deadline, pids=[process.pid for process in processes])
    while len(results) < len(processes):
        for rank, pipe in enumerate(pipes):
            if rank in results or not pipe.poll():
                continue
            try:
                status, value = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):
                continue  # the rank died; its exit code says so below
            if status == 'error':
                raise _root_failure(rank, value, pipes, processes)
            results[rank] = value
        for rank, process in enumerate(processes):
            if rank not in results and process.exitcode is not None and not pipes[rank].poll():
                raise AssertionError('rank {} exited with status {} before reporting a result'.format(
                    rank, process.exitcode))
        if guard.expired():
            raise AssertionError('ranks {} still running {}; killed every rank'.format(
                [r for r in range(len(processes)) if r not in results], guard.describe()))
        connection.wait([p.sentinel for p in processes] + [p for r, p in enumerate(pipes) if r not in results],
                        timeout=0.2)
    return [results[rank] for rank in range(len(processes))]


#: What a rank reports when a peer died under it: the peer's own error is the root cause.
_PEER_GONE = ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe')


def _root_failure(rank, text, pipes, processes, wait=3.0):
    """The first rank's error, unless it only says a peer went away: then that peer's own report, if it
    comes within ``wait`` seconds (the peer may report a moment after its death reached this rank)."""
    if not any(marker in text for marker in _PEER_GONE):
        return WorkerFailed(rank, text)
    until = time.monotonic() + wait
    while time.monotonic() < until:
        for other, pipe in enumerate(pipes):
            if other != rank and pipe.poll():
                try:
                    status, value = pickle.loads(pipe.recv_bytes())
                except (EOFError, OSError):
                    continue
                if status == 'error' and not any(marker in value for marker in _PEER_GONE):
                    return WorkerFailed(other, value)
        connection.wait([p for r, p in enumerate(pipes) if r != rank], timeout=0.1)
    return WorkerFailed(rank, text)


def _rank_main(fn, rank, world_size, port, backend, timeout, group, args, kwargs, conn):
    try:  # die with the forkserver, which dies with pytest, even if it is SIGKILLed (Linux)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() == 1:  # the forkserver is already gone
        os._exit(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if group == 'package':
            with torchbearer_dist.process_group(rank=rank, world_size=world_size, host='127.0.0.1', port=port,
                                                backend=backend, timeout=timeout):
                result = fn(*args, **kwargs)
        elif group == 'none':
            result = fn(*args, **kwargs)
        else:
            dist.init_process_group(backend, init_method='tcp://127.0.0.1:{}'.format(port), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
            # gloo's connect returns on one rank while its peer may still complete its side: a rank whose
            # ``fn`` then destroyed the group at once failed that peer with "Connection closed by peer"
            # (tests/callbacks' late-group test, 3 in 24 under load; rendezvous.wait_until_connected)
            dist.barrier()
            try:
                result = fn(*args, **kwargs)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        message = ('ok', result)
    except BaseException:
        message = ('error', traceback.format_exc())
    try:
        payload = pickle.dumps(message)  # plain pickle copies tensors instead of sharing them
    except Exception:
        payload = pickle.dumps(('error', 'its result could not be pickled:\n' + traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: torch may abort at exit with threads still alive


@contextlib.contextmanager
def world_of_one(timeout=PG_TIMEOUT):
    """A real gloo process group of one rank in this process: unit tests of collectives, no processes.

    Every collective of a world of one returns its input (a sum over one rank), so what a test sees
    is the engine's own packing, scaling and unpacking around the collective.
    """
    import torch.distributed as dist
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def launch_workers(fn, world_size=2, args=(), kwargs=None, timeout=PG_TIMEOUT, deadline=DEADLINE,
                   start_method='forkserver', **launch_kwargs):
    """Run ``fn`` through the package's own :func:`torchbearer_dist.launch`: for tests of launch itself.

    The ranks fork from multiprocessing's forkserver, the server :func:`run_workers` uses too (torch
    imported once), unless ``start_method`` says otherwise; tests/runtime/test_launch.py runs launch's
    behaviour under spawn too. launch's wall-clock ``deadline`` is stretched by the load (:func:`loaded`): it
    is only a backstop against a hang, never a test's bound; a fault test times the fault from the ranks' own
    monotonic timestamps, with fixed headroom (e.g. tests/runtime/test_faults.py's ``LAUNCH_RAISE_BOUND``).
    """
    return torchbearer_dist.launch(fn, world_size, args=args, kwargs=kwargs, timeout=timeout,
                                   deadline=loaded(deadline), start_method=start_method, **launch_kwargs)


def loaded(seconds):
    """``seconds`` stretched by the machine's load when a wall-clock bound cannot watch for progress (launch's
    own ``deadline=``): as given on an idle machine, up to :data:`STRETCH` times on one loaded 6x its cores."""
    return seconds * min(STRETCH, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


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
    """Environment for a subprocess: one thread per rank and the package importable from the checkout.

    ``PYTHONDONTWRITEBYTECODE`` is dropped: where the machine sets it, every one of the suite's several
    hundred processes compiled the package and the test helpers afresh (0.1 CPU-s each, measured);
    their bytecode now goes to ``__pycache__`` folders, which git ignores.
    """
    env = dict(os.environ)
    env.pop('PYTHONDONTWRITEBYTECODE', None)
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=ROOT + os.pathsep + env.get('PYTHONPATH', ''))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_command(command, timeout=DEADLINE, env=None, **popen_kwargs):
    """Run ``command`` in its own session; kill the whole session on return, or at ``timeout`` seconds
    unless its processes still use the CPU (:class:`HangGuard`).

    Returns:
        subprocess.CompletedProcess: with ``stdout`` and ``stderr`` as text, plus ``elapsed`` seconds
    """
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=child_env() if env is None else env, **popen_kwargs)
    guard = HangGuard(timeout, pids=[process.pid], session=process.pid)
    try:
        while True:
            try:
                stdout, stderr = process.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if guard.expired():
                    kill_session(process.pid)
                    stdout, stderr = process.communicate()
                    raise AssertionError('{} still running {}\nstdout:\n{}\nstderr:\n{}'.format(
                        command, guard.describe(), stdout[-3000:], stderr[-3000:])) from None
    finally:
        kill_session(process.pid)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    result.elapsed = time.monotonic() - started
    return result


def cmdline(pid):
    """The command line of process ``pid``, or '' once it is gone."""
    try:
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            return f.read().replace(b'\0', b' ').decode(errors='replace')
    except OSError:
        return ''


def kill_session(pid):
    """SIGKILL every process of the session led by ``pid``, by process-group id, never by name."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python(*args):
    """A command line running this interpreter."""
    return [sys.executable, *args]


def _ephemeral_start():
    """The first port the kernel hands out to sockets bound to port 0 and to outgoing connections."""
    try:
        with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Ports the tests pick from: the 7,000 below the kernel's ephemeral range. A port picked from that range (bind
#: to port 0) could be taken before the test's server bound it by any of the suite's hundreds of sockets that
#: the kernel numbers from it (gloo's and torchft's connections, port-0 servers): a launcher then failed at
#: once, 'address in use' (CI, test_interrupts, 1 run in about 30). Below it only another free_port can clash.
_PORTS = range(max(1024, _ephemeral_start() - 7000), _ephemeral_start())
_pick = random.Random(os.getpid() ^ time.time_ns())


def free_port(host='127.0.0.1'):
    """A TCP port that is free on ``host`` right now, outside the kernel's ephemeral range (still racy against
    another process's pick: use it at once)."""
    for _ in range(100):
        port = _pick.choice(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def snapshot(model):
    """A detached copy of ``model``'s parameters and buffers, to compare later."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _live_processes():
    """``(pid, stat fields after the command name)`` of every live (not zombie) process, from /proc."""
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open('/proc/{}/stat'.format(entry)) as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except (OSError, IndexError):  # gone, or read empty while it exits
            continue
        if fields[0] != 'Z':
            yield int(entry), fields


def children(pid=None):
    """The live (not zombie) child processes of ``pid`` (this process by default), from /proc."""
    parent = str(os.getpid() if pid is None else pid)
    return [found for found, fields in _live_processes() if fields[1] == parent]


def descendants(pid):
    """``pid`` and its live descendants, from one read of /proc (a launcher's workers lead sessions of their own)."""
    below = {}
    for found, fields in _live_processes():
        below.setdefault(int(fields[1]), []).append(found)
    tree = [pid]
    for parent in tree:  # grows as it is walked
        tree += below.get(parent, [])
    return tree


def session(sid):
    """The live (not zombie) processes of session ``sid`` (a process started with ``start_new_session``)."""
    return [found for found, fields in _live_processes() if int(fields[3]) == sid]
