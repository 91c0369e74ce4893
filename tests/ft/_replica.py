"""One replica of the fault-tolerant tests: a small Trial whose every step goes through torchft's Manager.

Prints ``STEP epoch batch`` after each step and ``DONE <weights hash> <heals> <pid> <metrics>`` at the end;
an error ends it with one line on stderr and status 1. With ``--record PATH`` the user's own callbacks sit
around ours (:class:`ClipGradients` before, :class:`Record` after) and what they saw is saved to ``PATH``.
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
    """Prints each step and sleeps ``sleep`` s; at the run's ``gate_step``-th step (counted from the run's start,
    as every replica counts it, whenever this one joined) waits for the file ``gate``."""

    def __init__(self, sleep, gate=None, gate_step=None):
        super().__init__()
        self.sleep, self.gate, self.gate_step = sleep, gate, gate_step

    def on_step_training(self, state):
        print('STEP', state[torchbearer.EPOCH], state[torchbearer.BATCH], flush=True)
        step = state[torchbearer.EPOCH] * state[torchbearer.STEPS] + state[torchbearer.BATCH] + 1
        if self.gate is not None and step >= self.gate_step:
            gate, self.gate = self.gate, None
            end = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.05)
        time.sleep(self.sleep)


def dataset(samples):
    """The replicas' data (the same on every replica; each trains its DistributedSampler's shard)."""
    x = torch.randn(samples, 20, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def model(replica, hidden):
    torch.manual_seed(100 + replica)  # different initial weights: the first step's init_sync aligns them
    return torch.nn.Sequential(torch.nn.Linear(20, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


class ClipGradients(Callback):
    """A user's callback at ``on_backward``: records the gradients' norm and clips it to ``max_norm``."""

    def __init__(self, max_norm):
        super().__init__()
        self.max_norm, self.norms = max_norm, []

    def on_backward(self, state):
        params = list(state[torchbearer.MODEL].parameters())
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, self.max_norm)))


class Record(Callback):
    """A user's callback: the weights at the first step, the loss of every step, the clipped gradients' norm."""

    def __init__(self):
        super().__init__()
        self.start, self.losses, self.norms = None, [], []

    def on_sample(self, state):
        if self.start is None:
            self.start = {k: v.clone() for k, v in state[torchbearer.MODEL].state_dict().items()}

    def on_backward(self, state):
        grads = [p.grad.reshape(-1) for p in state[torchbearer.MODEL].parameters()]
        self.norms.append(float(torch.cat(grads).norm()))

    def on_step_training(self, state):
        self.losses.append(float(state[torchbearer.LOSS].detach()))


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
    parser.add_argument('--min-replicas', type=int, default=1)
    parser.add_argument('--record', type=str, help="save what the user's callbacks saw here (torch.save)")
    parser.add_argument('--batch-size', type=int, default=10)
    parser.add_argument('--then-epochs', type=int, help='after the run of --epochs, run() again up to these epochs')
    parser.add_argument('--local-steps', type=int, help="DiLoCo's H: meetings through torchft every H steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = dataset(args.samples)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(
        data, num_replicas=args.replicas, rank=args.replica, seed=0))
    net = model(args.replica, args.hidden)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    callbacks = tbd.distributed_callbacks(fault_tolerant=args.lighthouse, replica_id='r{}'.format(args.replica),
                                          timeout=args.timeout, min_replicas=args.min_replicas,
                                          local_steps=args.local_steps)
    ft = next(c for c in callbacks if isinstance(c, tbd.FaultTolerantAllReduce))
    if args.checkpoint:
        callbacks.append(tbd.Checkpoint(args.checkpoint))
    before, after = (ClipGradients(0.25), Record()) if args.record else (Callback(), Callback())
    trial = Trial(net, optimizer, torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=[Progress(args.sleep, args.gate, args.gate_step), before, *callbacks, after])
    trial.with_generators(loader)
    print('READY', flush=True)
    history = trial.run(args.epochs, verbose=0)
    if args.then_epochs:
        history = trial.run(args.then_epochs, verbose=0)
    if args.record:
        diloco = next((c for c in callbacks if isinstance(c, tbd.DiLoCo)), None)
        torch.save({'initial': initial, 'start': after.start, 'final': net.state_dict(), 'losses': after.losses,
                    'clipped': before.norms, 'norms': after.norms, 'history': history,
                    'anchor': diloco and diloco.engine.anchor, 'outer_steps': diloco and diloco.engine.steps},
                   args.record)
    digest = hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    print('EPOCHS', len(history), 'RESTARTS', ft.restarts, flush=True)
    print('DONE', digest, ft.heals, os.getpid(), json.dumps(history[-1], sort_keys=True), flush=True)


if __name__ == '__main__':
    try:
        main()
    except (RuntimeError, ValueError) as e:
        print('error: {}'.format(e), file=sys.stderr, flush=True)
        sys.exit(1)
