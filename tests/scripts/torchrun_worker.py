"""A rank started by torchrun: joins through the environment, trains, saves its parameters.

Usage: torchrun --nproc-per-node N torchrun_worker.py OUT_DIR [--fail-first-attempt]
"""
import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial

import torchbearer_dist as tbd


def main(out, fail_first_attempt):
    torch.set_num_threads(1)
    with tbd.process_group(timeout=20) as env:
        torch.manual_seed(env.rank)  # replicas start different; BroadcastParameters makes them equal
        x = torch.randn(256, 10, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(x, (x.sum(dim=1) > 0).long())
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.nn.CrossEntropyLoss(),
                      metrics=['loss', 'acc'], callbacks=tbd.distributed_callbacks(), verbose=0)
        trial.with_generators(DataLoader(data, batch_size=16, sampler=DistributedSampler(data)))
        if fail_first_attempt and env.rank == 1 and os.environ.get('TORCHELASTIC_RESTART_COUNT') == '0':
            raise ValueError('rank 1 fails on the first attempt')
        history = trial.run(2)
        torch.save(model.state_dict(), os.path.join(out, 'rank{}.pt'.format(env.rank)))
        print('source={} rank={} world_size={} acc={}'.format(env.source, env.rank, env.world_size, history[-1]['acc']))


if __name__ == '__main__':
    main(sys.argv[1], '--fail-first-attempt' in sys.argv)
