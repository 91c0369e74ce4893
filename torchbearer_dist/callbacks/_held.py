"""What a Trial holds: every model and optimizer reachable from its state, under any key.

torchbearer keeps the model and optimizer under ``state[MODEL]`` and ``state[OPTIMIZER]``, but programs
keep more: a GAN stores its discriminator and both optimizers under keys of its own and steps them
from a closure. Every callback that synchronises models or gradients asks this module, so that what
the package can find, it synchronises, whatever key holds it. The order is the same on every rank:
``state[MODEL]`` and ``state[OPTIMIZER]`` first, then the other keys sorted by name.
"""
import torch
import torchbearer
from torch.nn.parallel import DistributedDataParallel


def _label(key):
    return 'state[{}]'.format(key)


def _ordered_items(state):
    first = [torchbearer.MODEL, torchbearer.OPTIMIZER, torchbearer.CRITERION]
    items = [(key, state[key]) for key in first if key in state]
    rest = sorted((key for key in state.keys() if key not in first), key=str)
    return items + [(key, state[key]) for key in rest]


def _values(label, value, depth=0):
    """``(label, value)`` of ``value`` and, one or two levels down, of the items of lists, tuples and dicts."""
    yield label, value
    if depth >= 2:
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _values('{}[{}]'.format(label, i), item, depth + 1)
    elif isinstance(value, dict) and not isinstance(value, torchbearer.State):
        for name in sorted(value, key=str):
            yield from _values('{}[{!r}]'.format(label, name), value[name], depth + 1)


def _param_groups(value):
    """The ``param_groups`` of an optimizer, or of an optimizer wrapper's ``.optimizer``; None for anything else."""
    if isinstance(value, torch.nn.Module):
        return None
    for candidate in (value, getattr(value, 'optimizer', None)):
        groups = getattr(candidate, 'param_groups', None)
        if isinstance(groups, list) and all(isinstance(g, dict) and 'params' in g for g in groups):
            return groups
    return None


def held_modules(state):
    """``(label, module)`` of every distinct ``nn.Module`` that the state holds, ``state[model]`` first.

    Args:
        state (dict): a Trial's state

    Returns:
        list: pairs such as ``('state[model]', generator)``, ``('state[disc_model]', discriminator)``
    """
    found, seen = [], set()
    for key, value in _ordered_items(state):
        for label, item in _values(_label(key), value):
            if isinstance(item, torch.nn.Module) and id(item) not in seen:
                seen.add(id(item))
                found.append((label, item))
    return found


def optimizer_objects(state):
    """``(label, optimizer)`` of every distinct optimizer that the state holds, ``state[optimizer]`` first."""
    found, seen = [], set()
    for key, value in _ordered_items(state):
        for label, item in _values(_label(key), value):
            groups = _param_groups(item)
            if groups is not None and id(groups) not in seen:
                seen.add(id(groups))
                found.append((label, item))
    return found


def held_optimizers(state):
    """``(label, param_groups)`` of every distinct optimizer that the state holds, ``state[optimizer]`` first."""
    return [(label, _param_groups(item)) for label, item in optimizer_objects(state)]


def parameter_names(modules):
    """``id(parameter) -> 'state[key].name'`` for every parameter of ``modules``, the first holder's name."""
    names = {}
    for label, module in modules:
        for name, p in module.named_parameters():
            names.setdefault(id(p), '{}.{}'.format(label, name))
    return names


def trainable(state):
    """``(name, parameter)`` of every parameter whose gradient is averaged: the model's, then every optimizer's.

    These are the trainable parameters of ``state[MODEL]`` and every parameter that any optimizer in
    the state steps (the discriminator of a GAN, a learnable term of the loss), each once. The
    names say where the parameter lives, e.g. ``fc.weight`` (in ``state[MODEL]``),
    ``state[disc_model].fc.weight`` or ``state[optimizer] param_groups[0] #1``.
    """
    model = state.get(torchbearer.MODEL)
    named, seen = [], set()
    if isinstance(model, torch.nn.Module):
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    names = parameter_names(held_modules(state))
    for label, groups in held_optimizers(state):
        for g, group in enumerate(groups):
            for i, p in enumerate(group['params']):
                if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    named.append((names.get(id(p), '{} param_groups[{}] #{}'.format(label, g, i)), p))
    return named


def parameters(state):
    """``(name, parameter)`` of every parameter the state holds, trainable or not, each once, named as in
    :func:`trainable`.

    The parameters of ``state[MODEL]`` first, then those of the other modules, then the optimizers'
    that no module holds: the same list on every rank that holds the same models and optimizers.
    """
    model = state.get(torchbearer.MODEL)
    modules = held_modules(state)
    named, seen = [], set()
    for label, module in modules:
        prefix = '' if module is model else label + '.'
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((prefix + name, p))
    names = parameter_names(modules)
    for label, groups in held_optimizers(state):
        for g, group in enumerate(groups):
            for i, p in enumerate(group['params']):
                if isinstance(p, torch.Tensor) and id(p) not in seen:
                    seen.add(id(p))
                    named.append((names.get(id(p), '{} param_groups[{}] #{}'.format(label, g, i)), p))
    return named


class TrainableWatch:
    """A cheap sign that the trainable set may have changed: every held parameter's ``requires_grad``
    and the size of every optimizer's param groups, compared with what they were when it was made.

    ``changed()`` reads one flag per parameter and one length per param group (no walk of the
    state): cheap enough for every forward pass. A parameter or optimizer placed in the state under a
    new key is not seen; it is found at the next run's start.

    Args:
        state (dict): a Trial's state
    """

    def __init__(self, state):
        self.params = [p for _, p in parameters(state)]
        self.groups = [groups for _, groups in held_optimizers(state)]
        self.flags = [p.requires_grad for p in self.params]
        self.sizes = self._sizes()

    def _sizes(self):
        return [len(groups) for groups in self.groups] + [len(g['params']) for groups in self.groups for g in groups]

    def changed(self):
        """Whether a parameter's ``requires_grad`` or an optimizer's param groups changed since the watch was made."""
        return any(p.requires_grad != flag for p, flag in zip(self.params, self.flags)) or \
            self._sizes() != self.sizes


def synchronised(state):
    """``(name, tensor)`` of every parameter and buffer that the ranks keep identical, each tensor once.

    Every module's ``state_dict`` entries (named ``name`` in ``state[MODEL]``, ``state[key].name``
    elsewhere), then the optimizers' parameters that no module holds.
    """
    model = state.get(torchbearer.MODEL)
    entries, seen = [], set()
    for label, module in held_modules(state):
        prefix = '' if module is model else label + '.'
        for name, tensor in module.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                seen.add(id(tensor))
                entries.append((prefix + name, tensor))
    for name, p in trainable(state):
        if id(p) not in seen:
            seen.add(id(p))
            entries.append((name, p))
    return entries


def buffers(state):
    """Every buffer of every module the state holds, each once, in the same order on every rank."""
    seen, found = set(), []
    for _, module in held_modules(state):
        for buffer in module.buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                found.append(buffer)
    return found


def ddp_parameters(state):
    """ids of the parameters that a DistributedDataParallel model in the state averages itself."""
    return {id(p) for _, module in held_modules(state) if isinstance(module, DistributedDataParallel)
            for p in module.parameters()}
