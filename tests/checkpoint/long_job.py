"""A small long job for the step checkpoint tests: a module of worker functions, and a torchrun script.

Its Trial uses every kind of state a mid-epoch resume must restore: dropout (torch's RNG), input noise
from numpy's and python's RNGs, SGD momentum, a per-batch StepLR, ScaleLearningRate's warm-up (which
reads the batch index), and a shuffling DistributedSampler. Each input's first column is the sample's
index, which the model ignores and the tests read back to see which samples each rank trained.

    torchrun --standalone --nproc-per-node 2 tests/checkpoint/long_job.py --dir D --epochs 3
"""
import argparse
import os
import random
import signal
import time
import warnings

import numpy
import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial
from torchbearer.callbacks.torch_scheduler import StepLR

import torchbearer_dist as tbd

SAMPLES = 150  # world 2: 75 a rank, 10 batches of 8; world 3: 50 a rank, 7 batches
BATCH_SIZE = 8


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x[:, 1:])


class _NoiseAndRecord(Callback):
    """Add noise from numpy's and python's RNGs; record the sample indices of every training batch."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def on_sample(self, state):
        x = state[torchbearer.X]
        noise = torch.from_numpy(numpy.random.randn(x.shape[0], x.shape[1] - 1).astype('float32'))
        state[torchbearer.X] = torch.cat([x[:, :1], x[:, 1:] + 0.01 * noise * random.random()], dim=1)
        if self.record is not None:
            with open(self.record, 'a') as f:
                f.write('{} {} {} {}\n'.format(os.getpid(), state[torchbearer.EPOCH], state[torchbearer.BATCH],
                                               ','.join(str(int(i)) for i in x[:, 0].tolist())))


class _Fault(Callback):
    """At global step ``at`` of this rank, send this process ``signum``; sleep ``sleep`` seconds each step."""

    def __init__(self, at, signum, sleep=0.0):
        super().__init__()
        self.at, self.signum, self.sleep = at, signum, sleep

    def on_step_training(self, state):
        time.sleep(self.sleep)
        step = state[torchbearer.EPOCH] * state[torchbearer.STEPS] + state[torchbearer.BATCH] + 1
        if self.at is not None and step == self.at:
            os.kill(os.getpid(), self.signum)


def data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator)
    x[:, 0] = torch.arange(SAMPLES, dtype=torch.float32)
    return TensorDataset(x, (x[:, 1:].sum(dim=1) > 0).long() + (x[:, 1] > 1).long())


def _refuse_object_collectives():
    """Step checkpoints gather RNG states with fixed-shape tensors: any pickling collective fails the job."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError('a pickle-based object collective was called')

    for name in ('all_gather_object', 'gather_object', 'broadcast_object_list', 'scatter_object_list'):
        setattr(dist, name, refuse)
        setattr(dist.distributed_c10d, name, refuse)


def train(directory, epochs, every_steps=None, fault_at=None, signum=signal.SIGTERM, resume=True, record=True,
          sleep=0.0):
    """Train on this rank; resume from ``directory/run.pt`` if it is there. Returns the parameters.

    Args:
        fault_at (dict): rank to the global step at which that rank sends itself ``signum``
    """
    torch.set_num_threads(1)
    if tbd.get_world_size() > 1:  # a rank's own process (never the test runner's)
        _refuse_object_collectives()
    torch.manual_seed(0)
    numpy.random.seed(0)
    random.seed(0)
    rank = tbd.get_rank()
    dataset = data()
    loader = DataLoader(dataset, batch_size=BATCH_SIZE,
                        sampler=DistributedSampler(dataset, tbd.get_world_size(), rank, shuffle=True, seed=3))
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(directory, 'run.pt')
    record = os.path.join(directory, 'seen.{}'.format(rank)) if record else None
    callbacks = [_NoiseAndRecord(record), _Fault((fault_at or {}).get(rank), signum, sleep),
                 StepLR(step_size=4, gamma=0.9, step_on_batch=True), tbd.ScaleLearningRate(warmup_epochs=1),
                 tbd.Checkpoint(path, every_steps=every_steps, keep=2), *tbd.distributed_callbacks()]
    trial = Trial(model, optimizer, torch.nn.functional.cross_entropy, metrics=['loss'], callbacks=callbacks,
                  verbose=0).with_generators(loader)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torchbearer warns that per-batch schedulers may not resume: they do here
        if resume:
            tbd.load_checkpoint(path, trial=trial, missing_ok=True)
        trial.run(epochs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def seen(directory, rank):
    """``(pid, epoch, batch, [indices])`` for every training batch this rank recorded, in order."""
    rows = []
    with open(os.path.join(directory, 'seen.{}'.format(rank))) as f:
        for line in f:
            pid, epoch, batch, indices = line.split()
            rows.append((int(pid), int(epoch), int(batch), [int(i) for i in indices.split(',')]))
    return rows


def _launched(directory, epochs, sleep):
    return train(directory, epochs, sleep=sleep)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dir', type=str, required=True)
    parser.add_argument('--write-forever', action='store_true', help='one process, a checkpoint every step')
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--every-steps', type=int, default=None)
    parser.add_argument('--kill-rank', type=int, default=None, help='this rank SIGKILLs itself, first attempt only')
    parser.add_argument('--kill-at', type=int, default=None, help='at this global step')
    parser.add_argument('--sleep', type=float, default=0.0, help='seconds to sleep after each step')
    parser.add_argument('--launch', type=int, default=None, help='start this many ranks with launch()')
    args = parser.parse_args()
    if args.write_forever:
        return write_forever(args.dir)
    tbd.watch_preemption()
    if args.launch is not None:  # a Preempted from launch() exits 75
        tbd.launch(_launched, args.launch, args=(args.dir, args.epochs, args.sleep), timeout=30, rendezvous_timeout=20)
        return
    first = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
    fault = {args.kill_rank: args.kill_at} if first and args.kill_rank is not None else None
    with tbd.process_group(timeout=30, rendezvous_timeout=20):
        params = train(args.dir, args.epochs, args.every_steps, fault, signal.SIGKILL, sleep=args.sleep)
        if tbd.is_main_process():
            torch.save(params, os.path.join(args.dir, 'final.pt'))



def write_forever(directory):
    """Resume, then train a 2 MB model in one process with a step checkpoint every step, keeping 3, until killed."""
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    dataset = TensorDataset(torch.randn(64, 256), torch.randn(64, 256))
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, 1, 0, shuffle=True))
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=1e-4), torch.nn.functional.mse_loss,
                  callbacks=[tbd.Checkpoint(os.path.join(directory, 'run.pt'), every_steps=1, keep=3),
                             tbd.SetSamplerEpoch()], verbose=0).with_generators(loader)
    tbd.load_checkpoint(os.path.join(directory, 'run.pt'), trial=trial, missing_ok=True)
    print('writing', flush=True)
    trial.run(10 ** 6)


if __name__ == '__main__':
    main()
