"""(private) What a replica sends to one that heals from it, and how the healing one takes it.

A Trial's state, as a step checkpoint holds it (:mod:`torchbearer_dist.checkpoint.files`): every model and
optimizer the Trial holds, the callbacks' states (DiLoCo's anchor among them) and schedulers, the history, the
position in the epoch, and a checkpoint the healer loaded but has not resumed yet, so that the healed replica goes
on with its healer's next batch. torchft's Manager
carries it: nothing here touches a file or a process group.
"""
from importlib import metadata

import torch
import torchbearer

from torchbearer_dist.callbacks._held import held_modules, optimizer_objects
from torchbearer_dist.checkpoint import files
from torchbearer_dist.ft._vote import AGREE

#: Marks a heal payload of this package, and its layout version.
FORMAT = 'torchbearer_dist.ft/2'


class Refused(RuntimeError):
    """This replica cannot join the replicas training (another model, configuration or version, or its name is
    taken): raised on it alone, at the quorum where it would heal; the replicas training are left alone."""


def config(replica_id, shards, batch_size, local_steps):
    """What the replicas of one run must share, as :func:`capture` sends it and :func:`restore` checks it."""
    return {'replica_id': replica_id, 'shards': shards, 'batch_size': batch_size, 'local_steps': local_steps,
            'versions': 'torchbearer_dist {}, torch {}'.format(_installed('torchbearer_dist'), torch.__version__)}


def _installed(name):
    """The installed version of the distribution ``name`` (this package's own is ``__version__``, which a module
    inside it cannot import), or ``'not installed'`` where it runs from a checkout on ``sys.path``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return 'not installed'


def _check_config(mine, theirs):
    for key in ('shards', 'batch_size', 'local_steps', 'versions'):
        what, remedy = AGREE[key]
        if mine[key] != theirs[key]:
            raise Refused('this replica cannot join: its {} is {} here and {} at the replicas training; {}'.format(
                what, mine[key], theirs[key], remedy))


def optimizers(state):
    """Every distinct optimizer object the Trial's state holds, ``state[OPTIMIZER]`` first (see ``_held``)."""
    return [item for _, item in optimizer_objects(state) if callable(getattr(item, 'step', None))]


def layouts(state):
    """The layout of the Trial's modules (names, shapes, dtypes) and of its optimizers, as :func:`restore` checks
    them: what the replicas of a run must share beyond their :func:`config`."""
    modules = dict(held_modules(state))
    return _layout({label: m.state_dict() for label, m in modules.items()}), \
        [_optimizer_layout(opt) for opt in optimizers(state)]


def _layout(module_states):
    return {label: {name: (tuple(t.shape), str(t.dtype)) for name, t in sd.items() if isinstance(t, torch.Tensor)}
            for label, sd in module_states.items()}


def capture(state, position, sender):
    """The payload :func:`restore` loads: the Trial's ``state`` at a step boundary, with ``position`` (``epoch``,
    ``batches`` trained in it, and ``batch_size``, ``world_size`` for ``resume_epoch``) and the sender's
    :func:`config`."""
    modules = {label: module.state_dict() for label, module in held_modules(state)}
    callbacks = state.get(torchbearer.CALLBACK_LIST)
    return {
        'format': FORMAT,
        'modules': modules,
        'layout': _layout(modules),
        'optimizers': [opt.state_dict() for opt in optimizers(state)],
        'callbacks': files._callback_states(callbacks),
        'history': [{str(k): files._plain(v) for k, v in entry.items()} for entry in state[torchbearer.HISTORY]],
        'position': dict(position),
        'config': dict(sender),
        'optimizer_layout': [_optimizer_layout(opt) for opt in optimizers(state)],
        'resume': [{'position': keeper.pending_position, 'rng': keeper.pending_rng,
                    'schedulers': keeper.pending_schedulers} for keeper in files._keepers(callbacks)],
    }


def _optimizer_layout(optimizer):
    return '{} of {} parameters'.format(type(optimizer).__name__,
                                         [len(group['params']) for group in optimizer.param_groups])


def _check_same_model(mine, theirs, source):
    for label in sorted(set(mine) | set(theirs)):
        here, there = mine.get(label), theirs.get(label)
        if here is None or there is None:
            raise Refused('this replica cannot heal from {}: {} holds {} there and {} here; start every replica '
                          'with the same program and package version'.format(
                                   source, label, 'nothing' if there is None else 'a module',
                                   'nothing' if here is None else 'a module'))
        for name in sorted(set(here) | set(there)):
            if here.get(name) != there.get(name):
                raise Refused('this replica cannot heal from {}: {}.{} is {} there and {} here; start every '
                              'replica with the same model'.format(
                                       source, label, name, _say(there.get(name)), _say(here.get(name))))


def _say(entry):
    return 'missing' if entry is None else '{} {}'.format(list(entry[0]), entry[1].replace('torch.', ''))


def restore(state, payload, source, mine):
    """Load the healer's :func:`capture` into this replica's ``state``; return the healer's position.

    Raises:
        Refused: (``source`` names the healer) the payload is not this package's, or its :func:`config`, models
            or optimizers differ from ``mine`` and this replica's (named): the healthy replicas are left alone
    """
    if not isinstance(payload, dict) or payload.get('format') != FORMAT:
        raise Refused('this replica cannot heal from {}: it sent no {} state (another package version?); start '
                           'every replica with the same torchbearer_dist'.format(source, FORMAT))
    _check_config(mine, payload['config'])
    model, here = layouts(state)
    _check_same_model(model, payload['layout'], source)
    if here != payload['optimizer_layout']:
        raise Refused('this replica cannot heal from {}: it holds the optimizers {} there and {} here; start every '
                      'replica with the same program'.format(source, payload['optimizer_layout'], here))
    for label, module in held_modules(state):
        module.load_state_dict(payload['modules'][label])
    for optimizer, saved in zip(optimizers(state), payload['optimizers']):
        optimizer.load_state_dict(saved)
    history = state[torchbearer.HISTORY]
    history[:] = [dict(entry) for entry in payload['history']]  # the Trial's own list: run() counts epochs from it
    trial = state.get(torchbearer.SELF)
    if trial is not None and payload['callbacks']:
        files._restore_callbacks(trial, payload['callbacks'])
    # A checkpoint the healer loaded and has yet to resume (replicas started again from one checkpoint heal from
    # the first at their first quorum): this replica resumes it as the healer does, at the same batch.
    for keeper, pending in zip(files._keepers(state.get(torchbearer.CALLBACK_LIST)), payload.get('resume', ())):
        keeper.pending_position, keeper.pending_rng = pending['position'], pending['rng']
        if pending['schedulers']:
            keeper.pending_schedulers = pending['schedulers']
    return payload['position']
