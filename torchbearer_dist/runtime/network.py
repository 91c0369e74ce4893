"""The route to the master: whether an address is loopback, which interface gloo uses, and the refusal of a job
across machines told to meet at a loopback address. Left to itself gloo takes the interface its host name
resolves to, often loopback, and a job across machines hangs or fails (pytorch issue 42879).
"""
import fcntl
import socket
import struct


def is_loopback(host):
    """Whether ``host`` (an address or name) resolves only to loopback: ``127.x.x.x`` or ``::1``."""
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):  # UnicodeError: a name idna cannot encode (a label over 63 chars)
        return False
    return all(info[4][0].startswith('127.') or info[4][0] == '::1' for info in infos)


def free_port(host='127.0.0.1'):
    """int: a TCP port that is free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def route_source(host, port=29500):
    """This machine's IPv4 address on the route to ``host``, or None: a UDP ``connect`` to any ``port`` asks the
    kernel for the route; no packet is sent."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)[0]
        if family != socket.AF_INET:
            return None
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError:
        return None


def route_interface(host, port=29500):
    """The interface (e.g. ``'eth0'``) this machine reaches ``host`` through, or None when it cannot be told."""
    local_ip = route_source(host, port)
    return next((name for name, address in interface_addresses() if address == local_ip), None)


def interface_addresses():
    """``[(interface name, IPv4 address)]`` of this machine's interfaces that have one, loopback included,
    in the order of :func:`socket.if_nameindex`."""
    siocgifaddr = 0x8915
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(query.fileno(), siocgifaddr, struct.pack('256s', name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            found.append((name, socket.inet_ntoa(packed[20:24])))
    return found


def gloo_interface(env, environ):
    """The interface gloo should use where ``GLOO_SOCKET_IFNAME`` is unset and several ranks meet: ``'lo'``
    for a loopback master, the route's interface, or None to leave gloo's choice."""
    if 'GLOO_SOCKET_IFNAME' in environ or env.world_size == 1 or env.backend != 'gloo':
        return None
    return 'lo' if is_loopback(env.host) else route_interface(env.host, env.port)


#: Each launcher that says how many ranks run here (the only sources checked): its command, and its
#: own way to hand every rank ``MASTER_ADDR``, for the error of a job with no address.
_EXPORT = {'openmpi': ('mpirun', 'mpirun -x MASTER_ADDR=ADDR -x MASTER_PORT=29500 ...'),
           'pmi': ('mpiexec', 'mpiexec -genv MASTER_ADDR ADDR ...'),
           'slurm': ('srun', 'export MASTER_ADDR=ADDR before srun')}


def check_not_loopback(env, given):
    """Fail at once, before any network wait, where a job spans machines but would meet at a loopback address
    (``given``: by ``--host`` or ``MASTER_ADDR``, not by default): one RuntimeError line saying how this
    launcher hands every rank rank 0's address."""
    if env.local_world_size is None or env.local_world_size >= env.world_size or env.init_method is not None \
            or not is_loopback(env.host):
        return
    how, export = _EXPORT[env.source]
    if given:
        raise RuntimeError('rank {} of {} runs on a machine with {} of the job\'s ranks ({} says so) but was told '
                           'to meet rank 0 at {}, a loopback address that is a different machine on each host; '
                           'pass --host (or MASTER_ADDR) an address of rank 0\'s machine, e.g. {}'.format(
                               env.rank, env.world_size, env.local_world_size, how, env.address, export))
    raise RuntimeError('rank {} of {}: {} started the job on several machines ({} of its ranks here) and gives no '
                       'address of rank 0; pass --host ADDR or set MASTER_ADDR on every rank, e.g. {}{}'.format(
                           env.rank, env.world_size, how, env.local_world_size, export,
                           ', or pip install mpi4py to have rank 0\'s address sent through MPI'
                           if env.source in ('openmpi', 'pmi') else ''))
