"""Who am I: rank, world size and master address from arguments or the environment, checked before any
socket is opened, so that a bad value fails at once with one line, not a network timeout on another machine.
"""
import os
from dataclasses import dataclass, replace
from datetime import timedelta

from torchbearer_dist.runtime import _mpi, _slurm, network
from torchbearer_dist.runtime._variables import env_int as _env_int
from torchbearer_dist.runtime.backends import check_backend, default_backend

#: The default bounds on each collective and on meeting the ranks or a peer's silence (the second's
#: default capped at the first): docs/api/process_group.rst says what each bounds and how to override it.
DEFAULT_TIMEOUT = timedelta(minutes=30)
DEFAULT_RENDEZVOUS_TIMEOUT = timedelta(seconds=60)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """The resolved description of one process of a job.

    Attributes:
        rank (int): global rank in ``[0, world_size)``
        world_size (int): number of processes in the job
        local_rank (int): rank among the processes on this machine (selects the GPU)
        host (str): address of rank 0, where the rendezvous store listens
        port (int): port of the rendezvous store
        backend (str): ``'gloo'``, ``'nccl'`` or ``'mpi'``
        timeout (datetime.timedelta): bound for every collective
        init_method (str or None): a ``file://`` URL when the job meets through a shared file
        source (str): where the values came from: ``'arguments'``, ``'torchrun'``, ``'openmpi'``, ``'pmi'``,
            ``'slurm'`` or ``'default'`` (no launcher: a job of one)
        rendezvous_timeout (datetime.timedelta or None): bound for meeting the other ranks and for a
            peer's silence; None until ``with_rendezvous_timeout()`` sets it (then ``timeout`` is used)
        local_world_size (int or None): the processes the launcher started on this machine, where an
            mpirun or srun says so; smaller than ``world_size`` when the job spans several machines
    """
    rank: int
    world_size: int
    local_rank: int
    host: str
    port: int
    backend: str
    timeout: timedelta
    init_method: str = None
    source: str = 'arguments'
    rendezvous_timeout: timedelta = None
    local_world_size: int = None

    @property
    def address(self):
        """str: ``host:port`` of the rendezvous store, as it appears in messages."""
        return '{}:{}'.format(self.host, self.port)

    @property
    def meet_timeout(self):
        """datetime.timedelta: the rendezvous timeout, or ``timeout`` where none was set."""
        return self.timeout if self.rendezvous_timeout is None else self.rendezvous_timeout


def _as_int(name, value, flag):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError('{} should be an integer, but given {!r}; pass {} as a whole number'.format(name, value, flag))


def _timeout(timeout, environ, name='timeout', variable='TORCHBEARER_DIST_TIMEOUT', default=DEFAULT_TIMEOUT):
    if timeout is None:
        seconds = environ.get(variable)
        if seconds is None:
            return default
        try:
            timeout = float(seconds)
        except ValueError:
            raise ValueError('{} should be a number of seconds, but given {!r}; fix or unset it'.format(
                variable, seconds)) from None
    if not isinstance(timeout, timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError('{} should be a number of seconds or a datetime.timedelta, but given {!r}'.format(
                name, timeout))
        timeout = timedelta(seconds=timeout)
    if timeout.total_seconds() <= 0:
        raise ValueError('{} should be positive, but given {} s; pass e.g. {}=60'.format(
            name, timeout.total_seconds(), name))
    return timeout


def with_rendezvous_timeout(env, rendezvous_timeout=None, environ=None):
    """``env`` with its rendezvous timeout set: short, for meeting the ranks and noticing a silent peer.

    Example: ::

        >>> from torchbearer_dist.runtime.env import resolve, with_rendezvous_timeout
        >>> env = resolve(rank=0, world_size=2, backend='gloo', timeout=600, environ={})
        >>> env = with_rendezvous_timeout(env, environ={})
        >>> env.rendezvous_timeout.total_seconds(), env.timeout.total_seconds()
        (60.0, 600.0)

    Args:
        env (DistEnv): what :func:`resolve` returned
        rendezvous_timeout (float or datetime.timedelta): seconds; by default
            ``TORCHBEARER_DIST_RENDEZVOUS_TIMEOUT`` or :data:`DEFAULT_RENDEZVOUS_TIMEOUT`, at most ``env.timeout``
        environ (dict): the environment to read, ``os.environ`` by default

    Returns:
        DistEnv: a copy with ``rendezvous_timeout`` set

    Raises:
        ValueError: a value that is not a positive number of seconds
    """
    environ = os.environ if environ is None else environ
    given = rendezvous_timeout is not None or 'TORCHBEARER_DIST_RENDEZVOUS_TIMEOUT' in environ
    value = _timeout(rendezvous_timeout, environ, 'rendezvous_timeout', 'TORCHBEARER_DIST_RENDEZVOUS_TIMEOUT',
                     DEFAULT_RENDEZVOUS_TIMEOUT)
    return replace(env, rendezvous_timeout=value if given else min(value, env.timeout))


#: Launchers in the order their variables are trusted: (source, rank, size, local rank, found when). OpenMPI
#: before SLURM: mpirun in an allocation inherits SLURM_*. PMI: MPICH's, Intel MPI's mpiexec, srun --mpi=pmi2.
_LAUNCHERS = (
    ('torchrun', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK', any),
    ('openmpi', 'OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_LOCAL_RANK', any),
    ('pmi', 'PMI_RANK', 'PMI_SIZE', 'MPI_LOCALRANKID', all),
    ('slurm', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID', all),
)


def _from_launcher(environ):
    """``(source, rank, world_size, local_rank)`` from the first launcher whose variables are set."""
    for source, rank, size, local, found in _LAUNCHERS:
        if found(name in environ for name in (rank, size)):
            return source, _env_int(rank, environ), _env_int(size, environ), _env_int(local, environ)
    return 'default', 0, 1, None


#: Launchers' counts of the processes they started on this machine.
_LOCAL_SIZES = {'openmpi': 'OMPI_COMM_WORLD_LOCAL_SIZE', 'pmi': 'MPI_LOCALNRANKS'}


def _local_world_size(source, world_size, environ):
    """Processes the launcher started on this machine, or None where it does not say (torchrun: it sets
    ``MASTER_ADDR`` itself, and several of its agents may share one machine on purpose)."""
    if source in _LOCAL_SIZES:
        return _env_int(_LOCAL_SIZES[source], environ)
    if source == 'slurm':
        return _slurm.local_world_size(world_size, environ)
    return None


def resolve(rank=None, world_size=None, host=None, port=None, backend=None, timeout=None,
            init_method=None, local_rank=None, environ=None):
    """Work out this process's place in the job and check every value, without touching the network.

    Explicit arguments win. Missing values come from the environment that torchrun sets
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), then from OpenMPI's
    ``mpirun`` (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``),
    then from MPICH's PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``), then from SLURM's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``). With none of these the process is a job
    of one: rank 0 of 1. Rank 0's address comes from ``host``, ``MASTER_ADDR``, SLURM's node list, or
    mpi4py under mpirun or mpiexec across machines.

    Example: ::

        >>> from torchbearer_dist.runtime.env import resolve
        >>> env = resolve(rank=1, world_size=2, host='10.0.0.1', port=29500, backend='gloo')
        >>> env.address
        '10.0.0.1:29500'

    Args:
        rank (int): global rank of this process, in ``[0, world_size)``
        world_size (int): number of processes, at least 1
        host (str): address or name of the machine that runs rank 0
        port (int): port of the rendezvous store on ``host``, in 1..65535
        backend (str): ``'gloo'``, ``'nccl'`` or ``'mpi'``; gloo by default, see
            :func:`torchbearer_dist.runtime.backends.default_backend`
        timeout (float or datetime.timedelta): bound on each collective, in seconds; by default
            :data:`DEFAULT_TIMEOUT` or ``TORCHBEARER_DIST_TIMEOUT``
        init_method (str): ``'file:///shared/path'`` to meet through a file on a shared filesystem
            instead of a TCP store; ``'env://'`` and ``'tcp://host:port'`` are also understood
        local_rank (int): rank on this machine; by default the launcher's (``LOCAL_RANK``, ...) or ``rank``
        environ (dict): the environment to read, ``os.environ`` by default

    Returns:
        DistEnv: the checked values

    Raises:
        ValueError: naming the bad value and how to fix it
    """
    environ = os.environ if environ is None else environ
    source = 'arguments'
    if rank is None and world_size is None:
        source, rank, world_size, launched_local = _from_launcher(environ)
        local_rank = launched_local if local_rank is None else local_rank
    if world_size is None:
        world_size = _env_int('WORLD_SIZE', environ)
        if world_size is None:
            raise ValueError('world_size is missing: pass --world-size N (the number of processes) '
                             'or set WORLD_SIZE')
    world_size = _as_int('world_size', world_size, '--world-size')
    if world_size < 1:
        raise ValueError('world_size should be at least 1, but given {}; pass the number of processes '
                         'in the job'.format(world_size))
    if rank is None:
        rank = _env_int('RANK', environ)
        if rank is None:
            raise ValueError('rank is missing: pass --rank i with 0 <= i < {} or set RANK'.format(world_size))
    rank = _as_int('rank', rank, '--rank')
    if not 0 <= rank < world_size:
        raise ValueError('rank should be between 0 and {} (world_size - 1), but given {}; '
                         'give each process a distinct rank in that range'.format(world_size - 1, rank))
    local_rank = rank if local_rank is None else _as_int('local_rank', local_rank, '--local-rank')
    if local_rank < 0:
        raise ValueError('local_rank should be >= 0, but given {}'.format(local_rank))

    if init_method is not None:
        if not isinstance(init_method, str) or init_method.split('://')[0] not in ('file', 'env', 'tcp'):
            raise ValueError("init_method should be 'file:///path', 'env://' or 'tcp://host:port', "
                             "but given {!r}".format(init_method))
        if init_method.startswith('tcp://'):
            netloc = init_method[len('tcp://'):].rstrip('/')
            if ':' in netloc:
                host_part, port_part = netloc.rsplit(':', 1)
                host = host_part if host is None else host
                port = port_part if port is None else port
            init_method = None
        elif init_method.startswith('env://'):
            init_method = None
        elif len(init_method) <= len('file://'):  # 'file://', or a scheme with no '://'
            raise ValueError("init_method {!r} names no file; use 'file:///shared/dir/rendezvous'".format(init_method))

    local_world_size = _local_world_size(source, world_size, environ)
    given = host is not None or bool(environ.get('MASTER_ADDR'))
    host = environ.get('MASTER_ADDR') if host is None else host
    port = _env_int('MASTER_PORT', environ) if port is None else port
    if host is None and source == 'slurm':
        slurm_host, slurm_port = _slurm.master(environ)[:2]
        port = slurm_port if port is None else port  # the job's own, on one node too: two jobs may share a node
        if slurm_host is not None:
            host, given = slurm_host, True
    if host is None and source in _LOCAL_SIZES and local_world_size is not None and local_world_size < world_size \
            and init_method is None:
        sent = _mpi.address(port)
        if sent is not None:
            host, port, given = sent[0], sent[1], True
    host = '127.0.0.1' if host is None else host
    if not isinstance(host, str) or not host.strip():
        raise ValueError('host should be the address of rank 0, but given {!r}; pass --host ADDR'.format(host))
    host = host.strip().strip('[]')
    port = _as_int('port', DEFAULT_PORT if port is None else port, '--port')
    if not 1 <= port <= 65535:
        raise ValueError('port should be between 1 and 65535, but given {}; pass a free port with --port'.format(port))

    backend = check_backend(default_backend() if backend is None else backend)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, host=host, port=port,
                  backend=backend, timeout=_timeout(timeout, environ), init_method=init_method, source=source,
                  local_world_size=local_world_size)
    network.check_not_loopback(env, given)
    return env


#: The live process group of this process (a ``_live.LiveGroup``), or None: the one reference to live state,
#: set by :mod:`.group`; here, below everything that reads it, so that no import goes upward.
_live = None


def current_env():
    """The :class:`~torchbearer_dist.runtime.env.DistEnv` of the live process group, or None outside one."""
    return _live.env if _live is not None else None
