"""A Trial of your own, data-parallel on CPUs: the pieces of the "Your own script" page.

    torchrun --standalone --nproc-per-node 2 examples/own_script.py --epochs 4

It checkpoints every 10 steps and resumes from its checkpoint when it finds one
(--no-resume starts afresh), so torchrun --max-restarts 3 carries on after a
rank is killed, and a SIGTERM (a scheduler's pre-emption) stops every rank at
the next step with a checkpoint and exit status 75: run it again to go on.
"""
import argparse
import os

import torch
from torch.utils.data import TensorDataset
from torchbearer import Trial

import torchbearer_dist as tbd

BASE_LR = 0.05  # tuned for one process at a batch of BATCH_SIZE
BATCH_SIZE = 32  # per rank: a step averages world_size x BATCH_SIZE samples


def threads_per_rank():
    """This machine's cores shared by the ranks torchrun started on it."""
    ranks_here = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def train(epochs, checkpoint, resume=True):
    """Build the Trial inside the process group, resume, and train."""
    torch.set_num_threads(threads_per_rank())
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    data = TensorDataset(x, (x.sum(dim=1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    callbacks = [tbd.ScaleLearningRate(warmup_epochs=2),
                 tbd.Checkpoint(checkpoint, every_steps=10),
                 *tbd.distributed_callbacks()]
    trial = Trial(model, optimizer, torch.nn.CrossEntropyLoss(),
                  metrics=['loss', 'acc'], callbacks=callbacks, verbose=0)
    if resume:  # on every rank; rank 0 reads the file, if there is one
        tbd.load_checkpoint(checkpoint, trial=trial, missing_ok=True)
    loader = tbd.distributed_loader(data, batch_size=BATCH_SIZE,
                                    shuffle=True)
    trial.with_generators(train_generator=loader)
    return trial.run(epochs=epochs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epochs', type=int, default=4, help='total epochs')
    parser.add_argument('--checkpoint', type=str, default='own_script.pt',
                        help='the checkpoint file, written by rank 0')
    parser.add_argument('--no-resume', action='store_true',
                        help='start afresh even if the checkpoint exists')
    args = parser.parse_args()
    tbd.watch_preemption()  # SIGTERM, SIGUSR1: checkpoint at a step, exit 75
    tbd.quiet_peer_failures()  # a peer's failure in one line, not a traceback
    with tbd.process_group():  # torchrun's environment names the rank
        history = train(args.epochs, args.checkpoint, not args.no_resume)
        if tbd.is_main_process():
            print('epochs {}: loss {:.4f} acc {:.4f}'.format(
                len(history), history[-1]['loss'], history[-1]['acc']))


if __name__ == '__main__':
    main()
