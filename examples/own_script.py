"""A Trial of your own, data-parallel on CPUs: the pieces of the "Your own script" page.

    torchrun --standalone --nproc-per-node 2 examples/own_script.py --epochs 4

Run it again with more epochs and it resumes from its checkpoint.
"""
import argparse
import os

import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist as tbd

BASE_LR = 0.05  # tuned for one process at a batch of BATCH_SIZE
BATCH_SIZE = 32  # per rank: a step averages world_size x BATCH_SIZE samples


def threads_per_rank():
    """This machine's cores shared by the ranks torchrun started on it."""
    ranks_here = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def make_loader(dataset, shuffle):
    """A loader that gives this rank its share of ``dataset``."""
    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=0)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)


class WarmUp(Callback):
    """Raise the learning rate from BASE_LR to world_size x BASE_LR.

    Linearly over the first ``epochs`` epochs, step by step (Goyal et
    al. 2017); it counts global epochs, so a resumed run goes on where
    the warm-up was.
    """

    def __init__(self, world_size, epochs=2):
        super().__init__()
        self.world_size, self.epochs = world_size, epochs

    def on_sample(self, state):
        steps = state[torchbearer.TRAIN_STEPS]
        done = state[torchbearer.EPOCH] * steps + state[torchbearer.BATCH]
        progress = min(1.0, done / (self.epochs * steps))
        scale = 1 + (self.world_size - 1) * progress
        for group in state[torchbearer.OPTIMIZER].param_groups:
            group['lr'] = BASE_LR * scale


def train(epochs, checkpoint):
    """Build the Trial inside the process group, resume, and train."""
    torch.set_num_threads(threads_per_rank())
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    data = TensorDataset(x, (x.sum(dim=1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    callbacks = [WarmUp(tbd.get_world_size()), tbd.Checkpoint(checkpoint),
                 *tbd.distributed_callbacks()]
    trial = Trial(model, optimizer, torch.nn.CrossEntropyLoss(),
                  metrics=['loss', 'acc'], callbacks=callbacks, verbose=0)
    if os.path.exists(checkpoint):
        tbd.load_checkpoint(checkpoint, trial=trial)  # on every rank
    trial.with_generators(train_generator=make_loader(data, shuffle=True))
    return trial.run(epochs=epochs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epochs', type=int, default=4, help='total epochs')
    parser.add_argument('--checkpoint', type=str, default='own_script.pt',
                        help='the checkpoint file, written by rank 0')
    args = parser.parse_args()
    with tbd.process_group():  # torchrun's environment names the rank
        history = train(args.epochs, args.checkpoint)
        if tbd.is_main_process():
            print('epochs {}: loss {:.4f} acc {:.4f}'.format(
                len(history), history[-1]['loss'], history[-1]['acc']))


if __name__ == '__main__':
    main()
