"""What :func:`~torchbearer_dist.runtime.env.resolve` reads of a SLURM step: its host lists, its first node as
rank 0's address, a port from the job id, tasks per node (one module per scheduler, as Lightning's).
"""
import itertools
import re

from torchbearer_dist.runtime._variables import env_int

#: Most names one bracket range of a SLURM host list may stand for (SLURM's own bound is 64k).
_MAX_RANGE = 65536


def _expand_range(text, hostlist):
    """The numbers of one bracket, e.g. ``'01-04,07'``, as strings zero-padded like ``scontrol``."""
    numbers = []
    for part in text.split(','):
        low, dash, high = part.partition('-')
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low) or \
                int(high) - int(low) >= _MAX_RANGE:
            raise ValueError('SLURM host list {!r} has an invalid range {!r}; expected e.g. node[01-04,07]'.format(
                hostlist, part))
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def hostnames(hostlist):
    """The host names of a SLURM host list such as ``'node[01-04,07],gpu[1-2]-ib'``, as ``scontrol show
    hostnames`` gives them; ValueError naming a malformed list. Items are separated by commas or blanks outside
    brackets; a range keeps the width of its low end (``[08-11]``: ``08 09 10 11``); duplicates and order are
    kept; several bracket groups expand in ``scontrol``'s order (the last fastest, then the first, the second,
    ...); text after the last bracket is a suffix, as newer SLURM releases keep it."""
    names = []
    for item in re.split(r'[,\s]+(?![^\[]*\])', hostlist.strip()):
        if not item:
            continue
        pieces = re.split(r'\[([^\[\]]*)\]', item)  # text, range, text, range, ..., text
        if any('[' in text or ']' in text for text in pieces[::2]) and '[' in item:
            raise ValueError('SLURM host list {!r} has unbalanced brackets in {!r}'.format(hostlist, item))
        texts, ranges = pieces[::2], [_expand_range(r, hostlist) for r in pieces[1::2]]
        if not ranges:
            names.append(item)
            continue
        order = list(range(len(ranges) - 2, -1, -1)) + [len(ranges) - 1]  # slowest first
        for combination in itertools.product(*(ranges[i] for i in order)):
            value = dict(zip(order, combination))
            names.append(''.join(text + value.get(i, '') for i, text in enumerate(texts)))
    return names


def master(environ):
    """``(host, port, nodes)`` of a SLURM step: its first node, a port from the job id, its node count.

    ``host`` is None for a step on one node (loopback serves it) and ``port`` None without a job id.
    The port is ``15000 +`` the job id's last four digits, as PyTorch Lightning's SLURM environment.
    """
    nodes = next((env_int(name, environ) for name in ('SLURM_STEP_NUM_NODES', 'SLURM_JOB_NUM_NODES', 'SLURM_NNODES')
                  if environ.get(name)), None)
    nodelist = next((environ[name] for name in ('SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST', 'SLURM_NODELIST')
                     if environ.get(name)), None)
    hosts = hostnames(nodelist) if nodelist else []
    nodes = (len(set(hosts)) or None) if nodes is None else nodes
    host = hosts[0] if hosts and (nodes or 1) > 1 else None
    job = environ.get('SLURM_JOB_ID', '')
    port = 15000 + int(job[-4:]) if job.isdigit() else None
    return host, port, nodes


def local_world_size(world_size, environ):
    """Tasks of this SLURM step on this node, or None where SLURM does not say."""
    nodes = master(environ)[2]
    if nodes == 1:
        return world_size
    counts = tasks_per_node(environ.get('SLURM_STEP_TASKS_PER_NODE') or environ.get('SLURM_TASKS_PER_NODE') or '')
    node = env_int('SLURM_NODEID', environ)
    if counts and node is not None and node < len(counts):
        return counts[node]
    return None


def tasks_per_node(text):
    """``'2(x3),1'`` -> ``[2, 2, 2, 1]``; ``[]`` for a value that does not parse."""
    counts = []
    for item in filter(None, text.split(',')):
        match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', item.strip())
        if match is None:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
