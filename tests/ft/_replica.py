"""One replica of the fault-tolerant tests: a small Trial whose every step goes through torchft's Manager.

Prints ``STEP epoch batch`` after each step and ``DONE <weights hash> <heals> <pid> <metrics>`` at the end;
an error ends it with one line on stderr and status 1.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist as tbd


class Progress(Callback):
    """Prints each step and sleeps ``sleep`` s; at its ``gate_step``-th step waits for the file ``gate``."""

    def __init__(self, sleep, gate=None, gate_step=None):
        super().__init__()
        self.sleep, self.gate, self.gate_step, self.steps = sleep, gate, gate_step, 0

    def on_step_training(self, state):
        print('STEP', state[torchbearer.EPOCH], state[torchbearer.BATCH], flush=True)
        self.steps += 1
        if self.gate is not None and self.steps == self.gate_step:
            end = time.monotonic() + 120
            while not os.path.exists(self.gate) and time.monotonic() < end:
                time.sleep(0.05)
        time.sleep(self.sleep)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--lighthouse', type=str, required=True)
    parser.add_argument('--replica', type=int, required=True)
    parser.add_argument('--replicas', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--samples', type=int, default=1800)
    parser.add_argument('--hidden', type=int, default=32)
    parser.add_argument('--sleep', type=float, default=0.0)
    parser.add_argument('--timeout', type=float, default=10.0)
    parser.add_argument('--gate', type=str, help='a file to wait for at the --gate-step-th step of this process')
    parser.add_argument('--gate-step', type=int, default=0)
    parser.add_argument('--checkpoint', type=str, help="this replica's checkpoint file (Checkpoint, every epoch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(100 + args.replica)  # different initial weights: the first step's init_sync aligns them
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 20, generator=generator)
    dataset = TensorDataset(x, (x[:, :3].sum(1) > 0).long())
    loader = DataLoader(dataset, batch_size=10, sampler=DistributedSampler(
        dataset, num_replicas=args.replicas, rank=args.replica, seed=0))
    model = torch.nn.Sequential(torch.nn.Linear(20, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    callbacks = tbd.distributed_callbacks(fault_tolerant=args.lighthouse, replica_id='r{}'.format(args.replica),
                                          timeout=args.timeout)
    ft = callbacks[-1]
    if args.checkpoint:
        callbacks.append(tbd.Checkpoint(args.checkpoint))
    trial = Trial(model, optimizer, torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=[Progress(args.sleep, args.gate, args.gate_step), *callbacks])
    trial.with_generators(loader)
    print('READY', flush=True)
    history = trial.run(args.epochs, verbose=0)
    digest = hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print('DONE', digest, ft.heals, os.getpid(), json.dumps(history[-1], sort_keys=True), flush=True)


if __name__ == '__main__':
    try:
        main()
    except (RuntimeError, ValueError) as e:
        print('error: {}'.format(e), file=sys.stderr, flush=True)
        sys.exit(1)
