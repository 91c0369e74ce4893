"""What :func:`~torchbearer_dist.runtime.env.resolve` asks of MPI for a job that mpirun or mpiexec started
across machines with no address given: rank 0's address and a free port, sent through mpi4py where installed.
"""
import socket

from torchbearer_dist.runtime import network

_cache = {}


def address(port):
    """``(host, port)`` of rank 0 sent to every rank through MPI (mpi4py), or None without mpi4py.

    Rank 0 gathers every rank's IPv4 addresses, picks the one of its own that the kernel routes to the first
    rank of another machine, and a free port there when ``port`` is None, and broadcasts both. A collective,
    called once: the answer is kept, so later calls in the same process return it without communicating.
    """
    if 'address' in _cache:
        return _cache['address']
    try:
        from mpi4py import MPI
    except (ImportError, OSError, RuntimeError):
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:  # an mpi4py built for another MPI than the one that started us
        return None
    # this machine's IPv4 addresses other than loopback, one per interface
    everyone = comm.gather([a for _, a in network.interface_addresses() if not a.startswith('127.')], root=0)
    answer = None
    if comm.Get_rank() == 0:
        host = _pick_address(everyone)
        answer = (host, network.free_port(host) if port is None else port)
    answer = comm.bcast(answer, root=0)
    _cache['address'] = answer
    return answer


def _pick_address(everyone):
    """Rank 0's address that routes to the first rank of another machine (another set of addresses)."""
    own = everyone[0]
    for theirs in everyone[1:]:
        if theirs == own:
            continue
        for address in theirs:
            source = network.route_source(address, 9)
            if source is not None and source in own:
                return source
    return own[0] if own else socket.gethostname()
