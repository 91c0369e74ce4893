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
