"""(private) Who may train in a new quorum: every replica's configuration, compared by all at once.

At each quorum whose membership is new, every replica of it contributes one row (:func:`row`) to one small
all-reduce, and every replica decides the same way from the same table (:func:`decide`): a replica whose
``replica_id`` another live replica holds, or whose configuration differs from the replicas training (those
that trained before this quorum; where none did, as at a run's first quorum, the configuration most of them
hold) is refused, in one line that names what differs. The replicas training are never the ones refused; a
replica that merely came first (the source of torchft's first-step synchronisation) is refused where most
replicas disagree with it. A heal still checks its payload in detail (:mod:`~torchbearer_dist.ft._heal`): the
vote settles who is right, the heal's words say how they differ.
"""
import hashlib

import torch

#: The row's columns, in order. ``id``, ``versions``, ``model`` and ``optimizers`` are hashes; the others values.
COLUMNS = ('id', 'trained', 'shards', 'batch_size', 'local_steps', 'versions', 'model', 'optimizers')
#: The columns that must agree, with what each is and what to do where it does not (as ``_heal`` says them).
AGREE = {
    'shards': ("shard count (the DistributedSampler's num_replicas, the example's --replicas)",
               'start every replica with the same shard count'),
    'batch_size': ('batch size', 'start every replica with the same batch size'),
    'local_steps': ("local_steps (DiLoCo's; None: averaging at every step)", 'start every replica with the same '
                    'local_steps'),
    'versions': ('torchbearer_dist and torch version', 'install the same versions on every machine'),
    'model': ('model (the names, shapes and dtypes of the modules\' tensors)', 'start every replica with the same '
              'model'),
    'optimizers': ('optimizers (their types and parameter groups)', 'start every replica with the same program'),
}
#: ``None`` (not known here) in a row.
NONE = -1


def _hash(value):
    """A 56-bit hash of ``repr(value)``: the same on every machine and Python (no ``hash()`` salt)."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], 'big')


def row(config, trained, model, optimizers):
    """This replica's row of the vote.

    Args:
        config (dict): its :func:`~torchbearer_dist.ft._heal.config`
        trained (bool): it took part in a committed step before this quorum
        model: the layout of its modules (any value with a stable ``repr``)
        optimizers: the layout of its optimizers (the same)

    Returns:
        list: one int per :data:`COLUMNS` entry
    """
    def plain(value):
        return NONE if value is None else int(value)
    return [_hash(config['replica_id']), int(bool(trained)), plain(config['shards']), plain(config['batch_size']),
            plain(config['local_steps']), _hash(config['versions']), _hash(model), _hash(optimizers)]


def table(rows_count, rank, mine):
    """The all-reduce's tensor before the sum: ``rows_count`` rows of zeros, this replica's at ``rank``."""
    rows = torch.zeros(rows_count, len(COLUMNS), dtype=torch.int64)
    rows[rank] = torch.tensor(mine, dtype=torch.int64)
    return rows


def decide(rows, replica_id):
    """Which ranks of the quorum are refused, and why, the same on every replica.

    Args:
        rows (list): every rank's :func:`row`, summed (each rank filled its own)
        replica_id (str): this replica's, for the words

    Returns:
        dict: ``{rank: the one line that rank raises}`` (empty: every replica trains)
    """
    column = {name: i for i, name in enumerate(COLUMNS)}
    refused, first_of = {}, {}
    trained = [r for r in range(len(rows)) if rows[r][column['trained']]]
    for r in sorted(range(len(rows)), key=lambda r: (r not in trained, r)):  # a training replica keeps its name
        taken = first_of.setdefault(rows[r][column['id']], r)
        if taken != r:
            refused[r] = ("this replica cannot join: its replica_id '{}' is the name of another live replica{}; "
                          'stop the other process of that name (a requeue while the old job still runs?) or pass '
                          'another replica_id'.format(replica_id, ', which trains' if taken in trained else ''))
    keys = [tuple(rows[r][column[name]] for name in AGREE) for r in range(len(rows))]
    voters = [r for r in (trained or range(len(rows))) if r not in refused]
    if not voters:
        return refused
    counts = {}
    for r in voters:
        counts[keys[r]] = counts.get(keys[r], 0) + 1
    reference = max(voters, key=lambda r: (counts[keys[r]], -r))  # most voters; among equals, the lowest rank's
    where = 'the replicas training' if trained else '{} of the {} replicas starting'.format(
        counts[keys[reference]], len(rows))
    for r in range(len(rows)):
        if r in refused or keys[r] == keys[reference]:
            continue
        name, (what, remedy) = next((n, AGREE[n]) for i, n in enumerate(AGREE) if keys[r][i] != keys[reference][i])
        here, there = (_say(rows[x][column[name]], name) for x in (r, reference))
        refused[r] = 'this replica cannot join: its {} {} at {}; {}'.format(
            what, 'is {} here and {}'.format(here, there) if here is not None else 'differs from those', where, remedy)
    return refused


def _say(value, name):
    """A column's value in words: None for a hash (not readable), else the value (``None`` where not known)."""
    if name in ('versions', 'model', 'optimizers'):
        return None
    return 'None' if value == NONE else str(value)
