"""(private) What a replica sends to one that heals from it, and how the healing one takes it.

A Trial's state, as a step checkpoint holds it (:mod:`torchbearer_dist.checkpoint.files`): every model and
optimizer the Trial holds, the callbacks' states (DiLoCo's anchor among them) and schedulers, the history, and
the position in the epoch, so that the healed replica goes on with its healer's next batch. torchft's Manager
carries it: nothing here touches a file or a process group.
"""
import torch
import torchbearer

from torchbearer_dist.callbacks._held import held_modules, optimizer_objects
from torchbearer_dist.checkpoint import files

#: Marks a heal payload of this package, and its layout version.
FORMAT = 'torchbearer_dist.ft/1'


def optimizers(state):
    """Every distinct optimizer object the Trial's state holds, ``state[OPTIMIZER]`` first (see ``_held``)."""
    return [item for _, item in optimizer_objects(state) if callable(getattr(item, 'step', None))]


def _layout(module_states):
    return {label: {name: (tuple(t.shape), str(t.dtype)) for name, t in sd.items() if isinstance(t, torch.Tensor)}
            for label, sd in module_states.items()}


def capture(state, position):
    """The payload :func:`restore` loads: the Trial's ``state`` at a step boundary, with ``position`` (``epoch``,
    ``batches`` trained in it, and ``batch_size``, ``world_size`` for ``resume_epoch``)."""
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
    }


def _check_same_model(mine, theirs, source):
    for label in sorted(set(mine) | set(theirs)):
        here, there = mine.get(label), theirs.get(label)
        if here is None or there is None:
            raise RuntimeError('this replica cannot heal from {}: {} holds {} there and {} here; start every replica '
                               'with the same program and package version'.format(
                                   source, label, 'nothing' if there is None else 'a module',
                                   'nothing' if here is None else 'a module'))
        for name in sorted(set(here) | set(there)):
            if here.get(name) != there.get(name):
                raise RuntimeError('this replica cannot heal from {}: {}.{} is {} there and {} here; start every '
                                   'replica with the same model'.format(
                                       source, label, name, _say(there.get(name)), _say(here.get(name))))


def _say(entry):
    return 'missing' if entry is None else '{} {}'.format(list(entry[0]), entry[1].replace('torch.', ''))


def restore(state, payload, source):
    """Load the healer's :func:`capture` into this replica's ``state``; return the healer's position.

    A RuntimeError (``source`` names the healer) where the payload is not this package's or its models or
    optimizers differ from this replica's (named): the healthy replicas are left alone.
    """
    if not isinstance(payload, dict) or payload.get('format') != FORMAT:
        raise RuntimeError('this replica cannot heal from {}: it sent no {} state (another package version?); start '
                           'every replica with the same torchbearer_dist'.format(source, FORMAT))
    modules = dict(held_modules(state))
    _check_same_model(_layout({label: m.state_dict() for label, m in modules.items()}), payload['layout'], source)
    mine = optimizers(state)
    if len(mine) != len(payload['optimizers']):
        raise RuntimeError('this replica cannot heal from {}: it holds {} optimizers there and {} here; start every '
                           'replica with the same program'.format(source, len(payload['optimizers']), len(mine)))
    for label, module in modules.items():
        module.load_state_dict(payload['modules'][label])
    for optimizer, saved in zip(mine, payload['optimizers']):
        optimizer.load_state_dict(saved)
    history = state[torchbearer.HISTORY]
    history[:] = [dict(entry) for entry in payload['history']]  # the Trial's own list: run() counts epochs from it
    trial = state.get(torchbearer.SELF)
    if trial is not None and payload['callbacks']:
        files._restore_callbacks(trial, payload['callbacks'])
    return payload['position']
