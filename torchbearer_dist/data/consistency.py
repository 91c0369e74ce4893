"""The data sentinel: :func:`check_same_data` stops every rank, before the first step, when the ranks were
given different data or overlapping shards."""
import random
import sys

import torch
import torch.distributed as dist

from torchbearer_dist.data.loaders import distributed_samplers
from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.fingerprint import _MODULUS, fingerprint

_LOADERS = ('training', 'validation', 'test')
_MAX_SAMPLERS = 4
_FIELDS = 7 + 2 * _MAX_SAMPLERS  # per loader: see _loader_row


def _length(value):
    try:
        return len(value)
    except TypeError:
        return -1


def _index_prints(dataset, depth=4):
    """Fingerprints of the index lists along a dataset's chain: a Subset's ``indices``, torchbearer's ``ids``."""
    prints = []
    for name in ('indices', 'ids'):
        indices = getattr(dataset, name, None)
        if indices is not None and not isinstance(indices, (str, bytes)):
            try:
                prints.append(int(fingerprint(torch.as_tensor(list(indices), dtype=torch.int64))[1]))
            except (TypeError, ValueError, RuntimeError):
                pass
    if depth > 0:
        inner = getattr(dataset, 'dataset', None)
        if inner is not None:
            prints += _index_prints(inner, depth - 1)
        for inner in getattr(dataset, 'datasets', None) or []:
            prints += _index_prints(inner, depth - 1)
    return prints


def _value_print(value):
    if isinstance(value, torch.Tensor):
        return int(fingerprint(value.cpu())[1])
    if isinstance(value, (list, tuple)):
        return _combine([_value_print(v) for v in value])
    if isinstance(value, dict):
        return _combine([collectives._hash(str(k)) + _value_print(value[k]) for k in sorted(value, key=str)])
    if isinstance(value, (bool, int, float, str, bytes)):
        return collectives._hash(repr(value))
    array = getattr(value, '__array__', None)
    if array is not None:  # numpy arrays, PIL images
        try:
            return int(fingerprint(torch.as_tensor(array()))[1])
        except (TypeError, ValueError, RuntimeError):
            pass
    return collectives._hash(type(value).__name__)


def _combine(values):
    total = 0
    for i, v in enumerate(values):
        total = (total * 1000003 + (2 * i + 1) * int(v)) % _MODULUS
    return total


def _sample_print(dataset, samples=3):
    """A fingerprint of a few samples (first, middle, last), read under one fixed seed on every rank, so that
    random augmentation draws the same on every rank."""
    n = _length(dataset)
    if n <= 0 or not hasattr(dataset, '__getitem__'):
        return 0
    positions = sorted({0, n // 2, n - 1}) if samples >= 3 else [0]
    state = random.getstate()
    numpy = sys.modules.get('numpy')
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            random.seed(0)
            if numpy is not None:
                numpy.random.seed(0)
            return _combine([_value_print(dataset[i]) for i in positions])
    except Exception:  # a dataset that cannot be indexed here: compare its length only
        return 0
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _loader_row(loader):
    """present, datasets, samples, index print, sample print, samplers, sampler settings; then rank, replicas.

    Only data that a DistributedSampler shards is compared: without one, each rank may read a shard of
    its own (its own files), which differs by design.
    """
    row = [0] * _FIELDS
    if loader is None:
        return row
    row[0] = 1
    samplers = distributed_samplers(loader)
    datasets = []
    for sampler in samplers:
        dataset = getattr(sampler, 'dataset', None)
        if dataset is not None and all(d is not dataset for d in datasets):
            datasets.append(dataset)
    settings = [(getattr(s, 'num_replicas', 0), int(getattr(s, 'seed', 0)), int(bool(getattr(s, 'shuffle', False))),
                 int(bool(getattr(s, 'drop_last', False))), _length(getattr(s, 'dataset', ()))) for s in samplers]
    row[1:7] = [len(datasets), sum(_length(d) for d in datasets),
                _combine([p for d in datasets for p in _index_prints(d)]),
                _combine([_sample_print(d) for d in datasets]), len(samplers),
                _combine([collectives._hash(repr(s)) for s in settings])]
    for i, sampler in enumerate(samplers[:_MAX_SAMPLERS]):
        row[7 + 2 * i] = int(getattr(sampler, 'rank', -1))
        row[8 + 2 * i] = int(getattr(sampler, 'num_replicas', 0))
    return row


def check_same_data(loaders):
    """Check that every rank was given the same data, and that the training shards do not overlap.

    For each dataset that a DistributedSampler shards (reachable from each loader, inside a wrapper
    loader too), which must be the same on every rank, the ranks compare its length, a fingerprint
    of the index lists along the dataset's chain (a ``Subset``'s indices, torchbearer's
    ``DatasetValidationSplitter`` ids) and of a few samples, read under one fixed seed. They also
    compare the settings of every DistributedSampler (seed, shuffle, drop_last, dataset length) and
    check that the samplers' ranks are distinct and their ``num_replicas`` is the job's size: the
    shards of an epoch then overlap only by the sampler's padding. A loader without a
    DistributedSampler is not compared (each rank may read its own files). One all-gather of a few
    integers per rank and loader.

    Example:

        .. code-block:: python

            check_same_data({'training': train_loader, 'validation': val_loader, 'test': None})

    Args:
        loaders (dict): ``'training'``, ``'validation'``, ``'test'`` to a loader or None

    Raises:
        RuntimeError: on every rank, naming the loader, what differs and its likely cause

    .. warning:: A synchronization point: every rank must call it.
    """
    size = collectives.world_size()
    if size == 1:
        return
    rows = [_loader_row(loaders.get(name)) for name in _LOADERS]
    local = torch.tensor([v for row in rows for v in row], dtype=torch.int64)
    device = collectives.comm_device(torch.device('cpu'))
    table = [torch.zeros_like(local, device=device) for _ in range(size)]
    dist.all_gather(table, local.to(device))
    table = [t.cpu().reshape(len(_LOADERS), _FIELDS).tolist() for t in table]
    for slot, name in enumerate(_LOADERS):
        mine = [table[r][slot] for r in range(size)]
        _compare_loader(name, mine, size)


def _first_other(values):
    """The first rank whose value differs from rank 0's."""
    return next(r for r, v in enumerate(values) if v != values[0])


def _compare_loader(name, rows, size):
    column = list(zip(*rows))
    if len(set(column[0])) > 1:
        other = _first_other(column[0])
        raise RuntimeError('the {} loader is set on rank {} but not on rank {}; give every rank the same '
                           'loaders'.format(name, 0 if rows[0][0] else other, other if rows[0][0] else 0))
    if not rows[0][0]:
        return
    what = 'the {} loader'.format(name)
    seed = ("seed the split on every rank (DatasetValidationSplitter(..., shuffle_seed=0), "
            "random_split(..., generator=torch.Generator().manual_seed(0)))")
    if len(set(column[1])) > 1 or len(set(column[2])) > 1:
        other = _first_other(list(zip(column[1], column[2])))
        raise RuntimeError('{} holds {} samples on rank 0 but {} on rank {}; build the same dataset on every rank '
                           '(the likely cause: a different file list, or a split that is not seeded: {})'.format(
                               what, column[2][0], column[2][other], other, seed))
    if len(set(column[3])) > 1:
        raise RuntimeError('{} holds different samples on rank 0 and rank {} (the indices of its subset differ); the '
                           'likely cause is a random split that is not seeded: {}'.format(
                               what, _first_other(column[3]), seed))
    if len(set(column[4])) > 1:
        raise RuntimeError('{} holds different sample contents on rank 0 and rank {} (the same positions read '
                           'differently under one seed); the likely cause is a different file list, preprocessing or '
                           'unseeded split on one rank: build the same dataset on every rank'.format(
                               what, _first_other(column[4])))
    if len(set(column[5])) > 1 or len(set(column[6])) > 1:
        raise RuntimeError('{} has DistributedSamplers with different settings on rank 0 and rank {} (seed, shuffle, '
                           'drop_last or dataset length), so the shards of the ranks overlap; give every rank the same '
                           'sampler settings'.format(what, _first_other(list(zip(column[5], column[6])))))
    for i in range(min(rows[0][5], _MAX_SAMPLERS)):
        ranks, replicas = list(column[7 + 2 * i]), list(column[8 + 2 * i])
        if any(n != size for n in replicas):
            raise RuntimeError('{} has a DistributedSampler with num_replicas={} in a job of {} ranks, so the shards '
                               'overlap or leave samples out; build it inside the process group (DistributedSampler('
                               'dataset) or torchbearer_dist.distributed_loader)'.format(
                                   what, replicas[_first_other(replicas + [size]) if replicas[0] == size else 0],
                                   size))
        if sorted(ranks) != list(range(size)):
            twice = next(r for r in ranks if ranks.count(r) > 1)
            holders = [str(k) for k, r in enumerate(ranks) if r == twice]
            raise RuntimeError('{} has a DistributedSampler with rank={} on ranks {}, so their shards of each epoch '
                               'are the same samples; build it inside the process group (DistributedSampler(dataset) '
                               'or torchbearer_dist.distributed_loader)'.format(what, twice,
                                                                 ', '.join(holders[:-1]) + ' and ' + holders[-1]))
