"""A MODEL, not a measurement: projected throughput of the bucketed all-reduce on N machines.

Inputs are measured on this machine: the single-process step time split into forward, backward,
optimizer and framework overhead, and the bucket schedule our callback built. The network is
modelled: each bucket's ring all-reduce costs ``2(N-1)/N * bytes / bandwidth + latency``, with a
per-call latency of ``2(N-1)`` ring hops of :data:`HOP_LATENCY_S` each. Gradients are assumed to
be ready at a uniform rate during backward (proportional to their size); buckets are sent in order,
one at a time, each as soon as it is full and the previous one is sent, overlapping what remains of
backward. Compute per machine is assumed to stay what it is here (one core, batch 64).
"""

#: Seconds of latency per ring hop (one message between neighbours on TCP over Ethernet).
HOP_LATENCY_S = 25e-6
MACHINES = (2, 4, 8, 16, 32, 64)
LINKS_GBIT = (1, 10, 100)


def ring_seconds(nbytes, machines, gbit, hop_latency=HOP_LATENCY_S):
    """Modelled seconds of one ring all-reduce of ``nbytes`` over ``machines`` at ``gbit`` Gbit/s."""
    if machines < 2:
        return 0.0
    return 2.0 * (machines - 1) / machines * nbytes / (gbit * 1e9 / 8) + 2 * (machines - 1) * hop_latency


def step_seconds(phases, step, buckets, machines, gbit, bytes_per_value=4):
    """Modelled seconds of one data-parallel step.

    Args:
        phases (dict): measured seconds of ``forward``, ``backward`` and ``optimizer``
        step (float): measured seconds of a whole single-process Trial step (adds framework overhead)
        buckets (list of int): values per bucket, in sending order
        machines (int): number of machines, one rank each
        gbit (float): link bandwidth in Gbit/s
        bytes_per_value (int): 4 for fp32, 2 for fp16 compression

    Returns:
        float: seconds per step
    """
    forward, backward = phases['forward'], phases['backward']
    total = float(sum(buckets)) or 1.0
    ready, done, filled = forward, forward, 0
    for values in buckets:
        filled += values
        ready = forward + backward * filled / total
        done = max(ready, done) + ring_seconds(values * bytes_per_value, machines, gbit)
    exposed = max(0.0, done - (forward + backward))
    return step + exposed


def project(phases, step, buckets, batch):
    """Rows of the projection: for each link, machine count and wire dtype, samples/s and scaling efficiency."""
    rows = []
    for gbit in LINKS_GBIT:
        for wire, nbytes in (('fp32', 4), ('fp16', 2)):
            for machines in MACHINES:
                seconds = step_seconds(phases, step, buckets, machines, gbit, nbytes)
                rows.append(dict(link_gbit=gbit, wire=wire, machines=machines, step_ms=1e3 * seconds,
                                 samples_per_s=machines * batch / seconds, scaling_efficiency=step / seconds))
    return rows


#: Share of a link's rate left for gloo's payload: TCP/IP and Ethernet headers (66 bytes per 1,448), measured
#: on the shaped links by the qdisc counters (see multihost.py).
PAYLOAD_FRACTION = 1448 / 1514
#: DDP's bucket capacities: 1 MiB for the first bucket, 25 MiB after (torch's defaults).
DDP_FIRST_BYTES, DDP_CAP_BYTES = 2 ** 20, 25 * 2 ** 20


def ddp_buckets(sizes, bytes_per_value=4):
    """DDP's buckets over parameters of ``sizes`` (registration order): reverse order, each closed *after*
    the tensor that reaches its capacity. Returns lists of registration positions."""
    buckets, current, filled, cap = [], [], 0, DDP_FIRST_BYTES
    for position in reversed(range(len(sizes))):
        current.append(position)
        filled += sizes[position] * bytes_per_value
        if filled >= cap:
            buckets.append(current)
            current, filled, cap = [], 0, DDP_CAP_BYTES
    if current:
        buckets.append(current)
    return buckets


def powersgd_values(shapes, rank, min_rate=2.0):
    """(uncompressed values, P values, Q values) PowerSGD sends for parameters of ``shapes`` at ``rank``."""
    dense = p = q = 0
    for shape in shapes:
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        r = min(n, m, rank)
        if len(shape) >= 2 and n * m > min_rate * r * (n + m):
            p, q = p + n * r, q + m * r
        else:
            dense += n * m
    return dense, p, q


def schedule_seconds(phases, step, sends, machines, gbit):
    """Modelled seconds of a step whose collectives ``sends`` = [(ready seconds after backward starts, bytes)]
    run one at a time in order, each once ready and once the previous is done; what ends after backward adds."""
    backward = phases['backward']
    done = 0.0
    for ready, nbytes in sends:
        done = max(ready, done) + ring_seconds(nbytes, machines, gbit * PAYLOAD_FRACTION)
    return step + max(0.0, done - backward)


def contender_sends(name, extra, powersgd_rank=4):
    """The collectives a contender issues per step, as [(ready seconds after backward starts, bytes)], or None."""
    sizes, ready, end = extra['sizes'], extra['ready'], extra['phases']['backward']
    if name.startswith('single'):
        return None
    wire = 2 if 'fp16' in name or 'bf16' in name else 4
    if name == 'per-param-recipe':
        return [(end, s * 4) for s in reversed(sizes)]
    if 'powersgd' in name:
        dense, p, q = powersgd_values(extra['shapes'], powersgd_rank)
        if name.startswith('ddp'):  # torch's hook: per DDP bucket, all after backward on 2 cores in practice
            return [(end, dense * 4), (end, p * 4), (end, q * 4)]
        return [(end, (dense + p + len(sizes) + 1) * 4), (end, q * 4)]
    if name.startswith('ddp'):
        return [(max(ready[i] for i in b), sum(sizes[i] for i in b) * wire) for b in ddp_buckets(sizes)]
    members, overlap = extra.get('members') or [list(reversed(range(len(sizes))))], extra.get('overlap')
    return [(max(ready[i] for i in b) if overlap else end, (sum(sizes[i] for i in b) + len(b)) * wire)
            for b in members]
