"""How the Trial's loss combines its samples, a mean or a sum: gradients and loss figures combine over ranks alike."""
import torch
import torchbearer


def loss_is_summed(state, loss_reduction):
    """Whether the Trial's loss is a sum over the batch: ``loss_reduction``, or for ``'auto'`` the criterion's own.

    ``'auto'`` recognises a torch loss module with ``reduction='sum'``; a loss function it cannot
    inspect counts as a mean, as one process at N x B averages over its batch.
    """
    if loss_reduction != 'auto':
        return loss_reduction == 'sum'
    criterion = state.get(torchbearer.CRITERION)
    return isinstance(criterion, torch.nn.Module) and getattr(criterion, 'reduction', None) == 'sum'


def check_loss_reduction(loss_reduction):
    """Raise ValueError, naming the value, unless ``loss_reduction`` is 'auto', 'mean' or 'sum'."""
    if loss_reduction not in ('auto', 'mean', 'sum'):
        raise ValueError("loss_reduction should be 'auto', 'mean' or 'sum', but given {!r}".format(loss_reduction))
