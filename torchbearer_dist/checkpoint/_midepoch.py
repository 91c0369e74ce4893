"""(private) The state of a Trial in the middle of an epoch: RNG states, and going on from a saved step.

torchbearer has no notion of a position inside an epoch: its training pass runs
``for state[BATCH] in range(state[STEPS])`` over an iterator made just before ``on_start_training``.
This module is the one place that works under that loop, through state keys only (no Trial method is
replaced): in ``on_start_training`` of the resumed epoch it swaps ``state[ITERATOR]`` for one over the
batches not yet seen, sets ``state[STEPS]`` to their number (the loop's ``range`` is made right after
``on_start_training``), and wraps ``state[SAMPLER]`` so that from the first batch on every callback sees
the epoch's true batch index and step count again.

That loop is torchbearer's internal contract, not an API: ``tests/checkpoint/test_private_midepoch.py``
fails on the pinned torchbearer if it moved, and a resumed epoch that sees it moved (the iterator
missing, the loop counting from another index or past the batches left) warns once (:data:`LOST`).
"""
import random

import numpy
import torch
import torch.distributed as dist
import torchbearer
from torch.utils.data import BatchSampler, DataLoader

from torchbearer_dist import data
from torchbearer_dist._once import warn_once
from torchbearer_dist.sync import collectives

LOST = ('torchbearer_dist: torchbearer {} no longer runs its training pass as ``for state[BATCH] in '
        'range(state[STEPS]): state[SAMPLER](state)`` over state[ITERATOR] made before on_start_training ({}); '
        'an epoch resumed from a step checkpoint may train again batches trained before the interruption: '
        'resume from epoch checkpoints (Checkpoint without every_steps or every_seconds)')


def _lost(what):
    warn_once(LOST.format(torchbearer.__version__, what))


def rng_state(epoch_torch=None):
    """This process's RNG states (torch, numpy, python) as tensors and plain values that ``weights_only`` loads.

    Args:
        epoch_torch (torch.Tensor): torch's state at the start of the epoch (it seeds the loader's iterator)
    """
    kind, keys, pos, has_gauss, cached = numpy.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        'torch': torch.get_rng_state(),
        'epoch_torch': epoch_torch,
        'numpy': {'kind': str(kind), 'keys': torch.from_numpy(keys.astype(numpy.int64)), 'pos': int(pos),
                  'has_gauss': int(has_gauss), 'cached_gaussian': float(cached)},
        'python': {'version': int(version), 'internal': torch.tensor(internal, dtype=torch.int64),
                   'gauss_next': gauss_next},
    }


def set_rng_state(saved):
    """Restore what :func:`rng_state` returned (torch's state as of the step, not the epoch start)."""
    torch.set_rng_state(saved['torch'])
    n = saved['numpy']
    numpy.random.set_state((n['kind'], n['keys'].numpy().astype(numpy.uint32), n['pos'], n['has_gauss'],
                            n['cached_gaussian']))
    p = saved['python']
    random.setstate((p['version'], tuple(int(v) for v in p['internal'].tolist()), p['gauss_next']))


def _pack(state):
    """:func:`rng_state` as one float64 tensor of a fixed length (every value is exact in float64)."""
    n, p = state['numpy'], state['python']
    epoch = state['epoch_torch']
    parts = [state['torch'].double(), torch.tensor([0.0 if epoch is None else 1.0]),
             torch.zeros_like(state['torch'], dtype=torch.float64) if epoch is None else epoch.double(),
             n['keys'].double(), torch.tensor([n['pos'], n['has_gauss'], n['cached_gaussian'], p['version']],
                                              dtype=torch.float64),
             p['internal'].double(), torch.tensor([0.0 if p['gauss_next'] is None else 1.0, p['gauss_next'] or 0.0],
                                                  dtype=torch.float64)]
    return torch.cat(parts)


def _unpack(flat, torch_size, keys_size, internal_size):
    sizes = [torch_size, 1, torch_size, keys_size, 4, internal_size, 2]
    t, has_epoch, epoch, keys, numbers, internal, gauss = torch.split(flat, sizes)
    pos, has_gauss, cached, version = numbers.tolist()
    return {
        'torch': t.to(torch.uint8), 'epoch_torch': epoch.to(torch.uint8) if has_epoch.item() else None,
        'numpy': {'kind': 'MT19937', 'keys': keys.to(torch.int64), 'pos': int(pos), 'has_gauss': int(has_gauss),
                  'cached_gaussian': float(cached)},
        'python': {'version': int(version), 'internal': internal.to(torch.int64),
                   'gauss_next': float(gauss[1]) if gauss[0].item() else None},
    }


def gather_rng_states(epoch_torch):
    """Every rank's :func:`rng_state`, gathered on global rank 0 (None elsewhere) in one fixed-shape gather.

    .. warning:: A synchronization point: every rank must call it.
    """
    mine = rng_state(epoch_torch)
    if collectives.world_size() == 1:
        return [mine]
    flat = _pack(mine)
    device = collectives.comm_device(torch.device('cpu'))
    shapes = (len(mine['torch']), len(mine['numpy']['keys']), len(mine['python']['internal']))
    gathered = [torch.empty_like(flat, device=device) for _ in range(collectives.world_size())] \
        if collectives.rank() == 0 else None
    dist.gather(flat.to(device), gathered, dst=0)
    if gathered is None:
        return None
    return [_unpack(g.cpu(), *shapes) for g in gathered]


def _loader_like(loader, batch_sampler):
    """A DataLoader over ``loader``'s dataset with ``batch_sampler``, otherwise configured as ``loader``."""
    kwargs = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                  multiprocessing_context=loader.multiprocessing_context)
    if loader.num_workers > 0:
        kwargs['prefetch_factor'] = loader.prefetch_factor
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


def resume_epoch(state, position, epoch_torch):
    """Go on with the batches of the interrupted epoch not yet trained; call from ``on_start_training``.

    Args:
        state (torchbearer.State): the Trial's state, in ``on_start_training`` of the resumed epoch
        position (dict): the checkpoint's ``'position'``: ``batches`` done (per rank), ``batch_size``,
            ``world_size``
        epoch_torch (torch.Tensor): this rank's torch RNG state at the start of the epoch, or None

    Returns:
        int: the batch index the epoch goes on from (the batches done, at the same world size)
    """
    if state.get(torchbearer.ITERATOR) is None or not callable(state.get(torchbearer.SAMPLER)):
        _lost('no iterator or sampler in state at on_start_training')
    loader, steps = state[torchbearer.GENERATOR], state[torchbearer.STEPS]
    done, saved_world = position['batches'], position['world_size']
    sampler = data.distributed_sampler(loader)
    batch_sampler = getattr(loader, 'batch_sampler', None)
    by_index = (isinstance(loader, DataLoader) and data.resumable(sampler) and type(batch_sampler) is BatchSampler
                and batch_sampler.sampler is sampler and steps == len(loader)
                and position.get('batch_size') == batch_sampler.batch_size)
    load = state[torchbearer.SAMPLER]
    if by_index:
        indices = data.remaining_indices(sampler, done * batch_sampler.batch_size, saved_world)
        rest = BatchSampler(indices, batch_sampler.batch_size, batch_sampler.drop_last)
        if epoch_torch is not None:
            torch.set_rng_state(epoch_torch)  # the iterator draws its workers' base seed as the original did
        state[torchbearer.ITERATOR] = iter(_loader_like(loader, rest))
        skip = steps - len(rest)
    else:
        # Any other loader: draw and drop the batches already trained, from the same iterator.
        skip = min(done, steps)
        for _ in range(skip):
            load(state)
    state[torchbearer.STEPS] = steps - skip  # the training loop's range(), made right after on_start_training
    loaded = [0]

    def load_and_number(state):
        if loaded[0] == 0:
            state[torchbearer.STEPS] = steps
        if state[torchbearer.BATCH] != loaded[0] or loaded[0] >= steps - skip:
            _lost('batch {} loaded as the {}th of the {} left'.format(state[torchbearer.BATCH], loaded[0] + 1,
                                                                     steps - skip))
        loaded[0] += 1
        state[torchbearer.BATCH] += skip  # the loop counts from 0; callbacks see the epoch's own index
        load(state)

    state[torchbearer.SAMPLER] = load_and_number
    return skip
