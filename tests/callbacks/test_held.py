"""What the callbacks find without being told, checked in one process: models and optimizers under any state
key, samplers inside wrapper loaders, summed losses, and the fingerprint the sentinels compare."""
import pytest
import torch
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks.gradients import loss_is_summed
from torchbearer_dist.data import describe_search, distributed_samplers
from torchbearer_dist.sync.fingerprint import fingerprint

DISC = torchbearer.state_key('held_disc')
DISC_OPT = torchbearer.state_key('held_disc_opt')
PAIR = torchbearer.state_key('held_pair')


def _gan_state():
    generator, discriminator, extra = nn.Linear(2, 3), nn.Linear(3, 1), nn.Linear(1, 1)
    state = torchbearer.State()
    term = nn.Parameter(torch.zeros(2))
    state.update({torchbearer.MODEL: generator,
                  torchbearer.OPTIMIZER: torch.optim.SGD(list(generator.parameters()) + [term], lr=0.1),
                  DISC: discriminator, DISC_OPT: torch.optim.Adam(discriminator.parameters()),
                  PAIR: [extra, {'again': generator}], torchbearer.CRITERION: nn.MSELoss(reduction='sum')})
    return state, generator, discriminator, extra


def test_every_model_and_optimizer_under_any_key_is_found_once_with_its_key():
    state, generator, discriminator, extra = _gan_state()
    modules = _held.held_modules(state)
    assert [label for label, _ in modules] == ['state[model]', 'state[criterion]', 'state[held_disc]',
                                              'state[held_pair][0]']
    assert [m for _, m in modules][0] is generator and modules[2][1] is discriminator and modules[3][1] is extra
    assert [label for label, _ in _held.held_optimizers(state)] == ['state[optimizer]', 'state[held_disc_opt]']
    assert [name for name, _ in _held.trainable(state)] == [
        'weight', 'bias', 'state[optimizer] param_groups[0] #2', 'state[held_disc].weight', 'state[held_disc].bias']
    names = [name for name, _ in _held.synchronised(state)]
    assert names == ['weight', 'bias', 'state[held_disc].weight', 'state[held_disc].bias',
                     'state[held_pair][0].weight', 'state[held_pair][0].bias', 'state[optimizer] param_groups[0] #2']


def test_a_summed_torch_loss_is_recognised_and_a_function_follows_the_option():
    state, *_ = _gan_state()
    assert loss_is_summed(state, 'auto') and not loss_is_summed(state, 'mean')
    state[torchbearer.CRITERION] = nn.functional.mse_loss
    assert not loss_is_summed(state, 'auto') and loss_is_summed(state, 'sum')


class _Zip:
    def __init__(self, *loaders):
        self.loaders = {'pair': list(loaders)}


def test_samplers_inside_a_wrapper_loader_are_found_and_the_search_is_described():
    data = TensorDataset(torch.randn(8, 2))
    samplers = [DistributedSampler(data, num_replicas=2, rank=0) for _ in range(2)]
    zipped = _Zip(*(DataLoader(data, sampler=s) for s in samplers))
    assert distributed_samplers(zipped) == samplers
    plain = DataLoader(data, batch_size=2)
    assert distributed_samplers(plain) == []
    assert describe_search(plain) == 'DataLoader, SequentialSampler, BatchSampler'
    assert describe_search(zip([1], [2])) == 'a zip that holds no loader or sampler'


@pytest.mark.parametrize('tensor', [torch.randn(5, 3), torch.randn(7).double(), torch.randn(3).half(),
                                    torch.randn(4, dtype=torch.complex64), torch.tensor([True, False, True]),
                                    torch.arange(6), torch.randn(11)[1:]])
def test_fingerprint_is_the_same_for_equal_values_and_changes_with_one_bit(tensor):
    assert torch.equal(fingerprint(tensor), fingerprint(tensor.clone()))
    changed = tensor.clone().reshape(-1)
    if changed.dtype == torch.bool:
        changed[-1] = not changed[-1]
    elif changed.is_floating_point() or changed.is_complex():
        changed.view(torch.uint8)[-1] ^= 1  # the lowest bit of the last byte
    else:
        changed[-1] += 1
    assert not torch.equal(fingerprint(tensor), fingerprint(changed.reshape(tensor.shape)))
    assert fingerprint(tensor).dtype == torch.int64 and bool((fingerprint(tensor) >= 0).all())


@pytest.mark.parametrize('size, first, second', [(8, 0, 7), (64, 2, 40), (3 * 2 ** 20 + 5, 7, 2 ** 21 + 7)])
def test_fingerprint_changes_when_values_swap_places(size, first, second):
    """Equal sums, other order: word-sums alone missed a swap within one half of the tensor."""
    values = torch.arange(size, dtype=torch.int64)
    swapped = values.clone()
    swapped[[first, second]] = swapped[[second, first]]
    assert values.sum() == swapped.sum()
    assert not torch.equal(fingerprint(values), fingerprint(swapped))
    assert not torch.equal(fingerprint(torch.arange(10.0)), fingerprint(torch.arange(10.0).flip(0)))
