"""One replica of the fault-tolerant tests: a small Trial whose every step goes through torchft's Manager.

Started by a launcher of several ranks (``torchrun --nproc-per-node k``), it is one rank of a replica group of k:
its process group is the group's, and it trains shard ``replica * k + rank`` of ``replicas * k``. With ``--launch k``
it is that launcher itself: ``torchbearer_dist.launch`` of k ranks, ``--max-restarts R``.

Prints ``STEP epoch batch`` after each step, and ``BUFFERS <buffers hash>`` then ``DONE <weights hash> <heals> <pid>
<metrics>`` at the end; an error ends it with one line on stderr and status 1. With ``--record PATH`` the user's own
callbacks sit around ours (:class:`ClipGradients` before, :class:`Record` after) and what they saw is saved to ``PATH``.
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time

# One line per error, as the example (examples/distributed_data_parallel.py) does: torch's C++ log otherwise adds
# its own, e.g. 'setSequenceNumberForGroup() is deprecated' once a process when torchft configures its first process
# group, after the replica's line where a signal landed before (test_signals). Set before torch is imported.
os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')

import torch  # noqa: E402
import torchbearer  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist as tbd


def say(*words):
    """One line on stdout in one write: the ranks of a group (torchrun's workers, srun's tasks) share the file, and
    ``print``'s separate writes of each word interleave there (a DONE line cut by another rank's BUFFERS line)."""
    sys.stdout.write(' '.join(str(word) for word in words) + '\n')
    sys.stdout.flush()


class Progress(Callback):
    """Prints each step and sleeps ``sleep`` s; at the run's ``gate_step``-th step (counted from the run's start,
    as every replica counts it, whenever this one joined) waits for the file ``gate``."""

    def __init__(self, sleep, gate=None, gate_step=None):
        super().__init__()
        self.sleep, self.gate, self.gate_step = sleep, gate, gate_step

    def on_step_training(self, state):
        say('STEP', state[torchbearer.EPOCH], state[torchbearer.BATCH])
        step = state[torchbearer.EPOCH] * state[torchbearer.STEPS] + state[torchbearer.BATCH] + 1
        if self.gate is not None and step >= self.gate_step:
            gate, self.gate = self.gate, None
            end = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.05)
        time.sleep(self.sleep)


def dataset(samples, seed=0):
    """The replicas' data (the same on every replica; each trains its DistributedSampler's shard)."""
    x = torch.randn(samples, 20, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def model(replica, hidden, batchnorm=False, rank=0):
    """The replicas' model; ``batchnorm``: a BatchNorm1d after the first layer (running statistics as buffers)."""
    torch.manual_seed(100 + replica + 1000 * rank)  # different initial weights: the first step's init_sync aligns
    # the replicas, the group's start its ranks
    norm = [torch.nn.BatchNorm1d(hidden)] if batchnorm else []
    return torch.nn.Sequential(torch.nn.Linear(20, hidden), *norm, torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def digest(tensors):
    """A hash of ``tensors``' values, bit for bit."""
    return hashlib.sha256(b''.join(t.detach().cpu().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


class StopAt(Callback):
    """A user's callback that stops this process's training after the step at ``(epoch, batch)`` (None: never),
    as a time budget or TerminateOnNaN on one replica would: every replica must stop after the same step."""

    def __init__(self, at):
        super().__init__()
        self.at = tuple(at) if at else None

    def on_step_training(self, state):
        if (state[torchbearer.EPOCH], state[torchbearer.BATCH]) == self.at:
            say('STOP asked at', *self.at)
            state[torchbearer.STOP_TRAINING] = True


class ExitAt(Callback):
    """Ends the process at once (``os._exit``, as a kill would: no cleanup) after the run's ``step``-th training
    step, counted from this process's start, after every other callback of that step (None: never)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.steps = step, 0

    def on_step_training(self, state):
        self.steps += 1
        if self.steps == self.step:
            print('EXIT', state[torchbearer.EPOCH], state[torchbearer.BATCH], flush=True)
            os._exit(3)


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


def exit_in_meeting(k):
    """End the process (``os._exit(3)``) in its ``k``-th DiLoCo meeting, after the quorum and the count of who
    trained, before the pseudo-gradients travel: a replica lost during that meeting, which its survivors drop."""
    from torchbearer_dist.sync import meeting
    real, calls = meeting.meet, [0]

    def meet(engine, group, commit):
        calls[0] += 1
        if calls[0] == k:
            print('EXIT in meeting', k, flush=True)
            os._exit(3)
        return real(engine, group, commit)
    meeting.meet = meet



def ready_at_the_first_quorum():
    """Print ``READY`` as this process asks the lighthouse for its first quorum (its Manager up, a late replica's
    request about to wait there), not before its (slow under load) start-up: a test that releases the others on
    ``READY`` then has this replica in their next quorum."""
    from torchbearer_dist.ft.replica import Replica
    original = Replica.start_quorum

    def start_quorum(self, *args, **kwargs):
        if not getattr(self, 'asked', False):
            self.asked = True
            say('READY')
        return original(self, *args, **kwargs)
    Replica.start_quorum = start_quorum

def stop_in_quorum(count):
    """SIGSTOP this process as it enters its ``count``-th quorum call to torchft (its timeout already set), as a
    machine paused there would be: the call's deadline passes while it is stopped."""
    import torchft
    original, calls = torchft.Manager.start_quorum, []

    def start_quorum(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == count:
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, *args, **kwargs)
    torchft.Manager.start_quorum = start_quorum


def signal_in_callback(count, signum):
    """From its ``count``-th collective on, send itself ``signum`` from inside a callback of a future that torchft
    wraps (``Manager.wrap_future``, as its ``Manager.allreduce`` does each collective), run by the main thread
    (once): torchft turns what the handler raises there into the step's error. The package's own collectives
    start on the process group directly; a program's own through the Manager meet this."""
    import threading

    from torchbearer_dist.sync import group
    original, calls, sent = group._QuorumWork.wait, [], []

    def callback(fut):
        if threading.current_thread() is threading.main_thread() and not sent:
            sent.append(1)
            say('SIGNALLED', time.time())
            os.kill(os.getpid(), signum)
            time.sleep(1)  # the handler runs here
        return fut.value()

    def wait(self):
        calls.append(1)
        if len(calls) >= count and not sent:
            done = torch.futures.Future()
            done.set_result(None)
            self.manager.wrap_future(done.then(callback), None).wait()  # a done future: the callback runs here
        return original(self)
    group._QuorumWork.wait = wait


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
    parser.add_argument('--stop-in-quorum', type=int, default=None, help='SIGSTOP itself in its N-th quorum call')
    parser.add_argument('--sigterm-in-callback', type=int, default=None,
                        help="SIGTERM itself inside torchft's future callbacks from its N-th collective on")
    parser.add_argument('--checkpoint', type=str, help="this replica's checkpoint file (Checkpoint, every epoch)")
    parser.add_argument('--min-replicas', type=int, default=1)
    parser.add_argument('--record', type=str, help="save what the user's callbacks saw here (torch.save)")
    parser.add_argument('--batch-size', type=int, default=10)
    parser.add_argument('--then-epochs', type=int, help='after the run of --epochs, run() again up to these epochs')
    parser.add_argument('--local-steps', type=int, help="DiLoCo's H: meetings through torchft every H steps")
    parser.add_argument('--batchnorm', action='store_true', help='a BatchNorm1d in the model')
    parser.add_argument('--every-steps', type=int, help="--checkpoint's step checkpoints: every this many steps")
    parser.add_argument('--resume', type=str, help='load_checkpoint this file before the run')
    parser.add_argument('--stop-at', type=int, nargs=2, metavar=('EPOCH', 'BATCH'),
                        help="a callback of this replica's rank 0 stops training after that step")
    parser.add_argument('--exit-at', type=int, help="end the process (os._exit(3)) after this process's N-th step")
    parser.add_argument('--exit-in-meeting', type=int, help='end the process in its N-th DiLoCo meeting (its quorum '
                        'formed, nothing sent)')
    parser.add_argument('--launch', type=int, help='start this many ranks, one replica group, with launch()')
    parser.add_argument('--max-restarts', type=int, default=0, help="--launch's max_restarts")
    parser.add_argument('--device', type=str, default='cpu', help="where the Trial trains (cuda:0, say): torchft's "
                        'gloo group carries its gradients from there; cuda: each rank its current GPU (nccl sets it)')
    parser.add_argument('--backend', type=str, help="--launch's process group backend (nccl: a GPU a rank)")
    parser.add_argument('--evaluate', type=int, help='after the runs, evaluate() and predict() this many test samples '
                        '(each replica its shard, no shuffle)')
    args = parser.parse_args()
    if args.launch:  # launch()'s restarts: each new rank finds its start in TORCHELASTIC_RESTART_COUNT
        tbd.launch(launched, args.launch, args=(args,), max_restarts=args.max_restarts, backend=args.backend)
    elif tbd.resolve().world_size > 1:  # one rank of a replica group: its launcher's process group (torchrun's,
        # launch()'s, or an srun of several tasks: SLURM_NTASKS, no WORLD_SIZE)
        with tbd.process_group():
            train(args, tbd.get_world_size(), tbd.get_rank())
    else:
        train(args)


def launched(args):
    """A rank of ``--launch``, inside the process group launch() made."""
    train(args, tbd.get_world_size(), tbd.get_rank())


def train(args, group_size=1, rank=0):
    if args.exit_in_meeting:
        exit_in_meeting(args.exit_in_meeting)
    torch.set_num_threads(1)
    data = dataset(args.samples)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(
        data, num_replicas=args.replicas * group_size, rank=args.replica * group_size + rank, seed=0))
    net = model(args.replica, args.hidden, args.batchnorm, rank)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    callbacks = tbd.distributed_callbacks(fault_tolerant=args.lighthouse, replica_id='r{}'.format(args.replica),
                                          timeout=args.timeout, min_replicas=args.min_replicas,
                                          local_steps=args.local_steps)
    ft = next(c for c in callbacks if isinstance(c, tbd.FaultTolerantAllReduce))
    if args.checkpoint:
        callbacks.append(tbd.Checkpoint(args.checkpoint, every_steps=args.every_steps))
    before, after = (ClipGradients(0.25), Record()) if args.record else (Callback(), Callback())
    trial = Trial(net, optimizer, torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=[Progress(args.sleep, args.gate, args.gate_step), before, *callbacks, after,
                             ExitAt(args.exit_at), StopAt(args.stop_at if rank == 0 else None)])
    trial.with_generators(loader)
    device = 'cuda:{}'.format(torch.cuda.current_device()) if args.device == 'cuda' else args.device
    trial.to(device)  # the model, the optimizer's state, each batch
    if args.resume:
        tbd.load_checkpoint(args.resume, trial=trial)
    ready_at_the_first_quorum()
    if args.stop_in_quorum:
        stop_in_quorum(args.stop_in_quorum)
    if args.sigterm_in_callback:
        signal_in_callback(args.sigterm_in_callback, signal.SIGTERM)
    try:
        history = trial.run(args.epochs, verbose=0)
    finally:  # the main thread unwound (the helper's end at the grace skips this)
        if args.sigterm_in_callback:
            say('UNWOUND')
    if args.then_epochs:
        history = trial.run(args.then_epochs, verbose=0)
    evaluated = evaluate(trial, args, group_size, rank) if args.evaluate else {}
    if args.record:
        diloco = next((c for c in callbacks if isinstance(c, tbd.DiLoCo)), None)
        torch.save({'initial': initial, 'start': after.start, 'final': net.state_dict(), 'losses': after.losses,
                    'clipped': before.norms, 'norms': after.norms, 'history': history,
                    'anchor': diloco and diloco.engine.anchor, 'outer_steps': diloco and diloco.engine.steps,
                    'buffer_anchor': diloco and diloco.engine.buffer_anchor, **evaluated},
                   args.record if group_size == 1 else '{}.rank{}'.format(args.record, rank))  # a group: each rank's
    say('EPOCHS', len(history), 'RESTARTS', ft.restarts)
    say('BUFFERS', digest(net.buffers()))
    say('DONE', digest(net.parameters()), ft.heals, os.getpid(), json.dumps(history[-1], sort_keys=True))


def evaluate(trial, args, group_size, rank):
    """``evaluate()`` then ``predict()`` on ``--evaluate`` test samples, this process's shard of them; prints ``EVAL
    <figures>`` and returns the figures and predictions (``--record`` saves them)."""
    test = dataset(args.evaluate, seed=1)
    trial.with_test_generator(DataLoader(test, batch_size=args.batch_size, sampler=DistributedSampler(
        test, num_replicas=args.replicas * group_size, rank=args.replica * group_size + rank, shuffle=False)))
    figures = trial.evaluate(verbose=0, data_key=torchbearer.TEST_DATA)
    predictions = trial.predict(verbose=0)
    say('EVAL', json.dumps(figures, sort_keys=True))
    return {'evaluated': figures, 'predictions': predictions}


if __name__ == '__main__':
    try:
        main()
    except (RuntimeError, ValueError) as e:
        print('error: {}'.format(e), file=sys.stderr, flush=True)
        sys.exit(1)
