"""The GPU path: nccl DistributedDataParallel through wrap_ddp. Skips without CUDA (see conftest.py)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial

import torchbearer_dist

from _dist import run_workers

pytestmark = pytest.mark.gpu


def _worker_ddp_trial():
    torch.set_num_threads(1)
    torch.manual_seed(dist.get_rank())  # replicas start apart: DDP broadcasts rank 0's weights
    model = torchbearer_dist.wrap_ddp(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator))
    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=torchbearer_dist.distributed_callbacks(ddp=True), verbose=0).to(model.device)
    initial = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    history = trial.with_train_generator(loader).run(2)
    return {'backend': dist.get_backend(), 'device': str(model.device), 'history': history, 'initial': initial,
            'params': {k: v.detach().cpu() for k, v in model.module.state_dict().items()}}


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason='needs 1 GPU')
def test_one_rank_nccl_ddp_trains_in_a_trial():
    (result,) = run_workers(_worker_ddp_trial, 1, backend='nccl', deadline=120)
    assert result['backend'] == 'nccl' and result['device'] == 'cuda:0'
    history = result['history']
    assert len(history) == 2 and history[1]['loss'] < history[0]['loss'], history  # it trained: the loss fell
    for name, value in result['params'].items():
        assert not torch.equal(value, result['initial'][name]), '{} never changed'.format(name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs')
def test_two_ranks_nccl_ddp_end_with_identical_parameters():
    rank0, rank1 = run_workers(_worker_ddp_trial, 2, backend='nccl', deadline=120)
    assert rank0['device'] == 'cuda:0' and rank1['device'] == 'cuda:1'
    assert rank0['history'] == rank1['history']
    for name in rank0['params']:
        assert torch.equal(rank0['params'][name], rank1['params'][name]), name
