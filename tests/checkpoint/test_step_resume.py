"""Long jobs lose nothing (issue 17, items 1-5): step checkpoints, exact mid-epoch resume, pre-emption.

(a) kill -9 of one rank at a random step under ``torchrun --max-restarts``: the job finishes with the
parameters of an uninterrupted run; (b) SIGTERM to every rank mid-epoch (ranks started by hand, as
srun does): every rank exits 75, and a second start ends bit-identical, having trained the same
batches in the same order; (c) a step checkpoint write killed at random leaves the kept checkpoints
loadable; (d) a checkpoint written at world size 2 resumes at 3 with the rest of the epoch resharded.
The job is ``long_job.py`` beside this file.
"""
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import long_job
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import torchbearer_dist as tbd
from torchbearer_dist import data

from _dist import LOAD_SLACK, ROOT, child_env, free_port, kill_session, run_workers  # noqa: I001 (tests/ on sys.path)

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'long_job.py')
EPOCHS = 3
STEPS_AT_2 = 10  # 150 samples, 75 a rank, batches of 8
#: Seconds each rank sleeps after each step of the SIGTERM run: SIGTERM lands inside an epoch.
STEP_SLEEP = 0.15


def _worker(directory, epochs, every_steps=None, fault_at=None):
    return long_job.train(directory, epochs, every_steps, fault_at)


def _equal(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _max_difference(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """An uninterrupted run at world size 2: its parameters and each rank's batches, in order."""
    directory = str(tmp_path_factory.mktemp('reference'))
    params = run_workers(_worker, 2, args=(directory, EPOCHS))[0]
    return params, [[row[1:] for row in long_job.seen(directory, r)] for r in range(2)]


def _start_by_hand(directory, world_size, *extra):
    """Start ``world_size`` ranks of long_job.py, each its own process and session, as srun would."""
    port = free_port()
    ranks = []
    for rank in range(world_size):
        env = child_env(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size,
                        MASTER_ADDR='127.0.0.1', MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, JOB, '--dir', directory, '--epochs', str(EPOCHS), *extra],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True, cwd=ROOT))
    return ranks


def _wait(ranks, timeout):
    try:
        return [p.communicate(timeout=timeout) + (p.returncode,) for p in ranks]
    finally:
        for p in ranks:
            kill_session(p.pid)
            p.wait()


@pytest.fixture(scope='module')
def sigterm_run(tmp_path_factory):
    """Two ranks started by hand, each sent SIGTERM in the middle of epoch 2; the time to the last exit."""
    directory = str(tmp_path_factory.mktemp('sigterm'))
    ranks = _start_by_hand(directory, 2, '--sleep', str(STEP_SLEEP))
    try:
        deadline = time.monotonic() + 60
        seen = os.path.join(directory, 'seen.0')
        while time.monotonic() < deadline:
            lines = open(seen).read().count('\n') if os.path.exists(seen) else 0
            if lines >= STEPS_AT_2 + 3 or any(p.poll() is not None for p in ranks):
                break
            time.sleep(0.02)
        signalled = time.monotonic()
        for p in ranks:
            os.kill(p.pid, signal.SIGTERM)
        for p in ranks:
            p.wait(max(1, deadline - time.monotonic()))
        elapsed = time.monotonic() - signalled
    finally:
        outcomes = _wait(ranks, 10)
    saved = os.path.join(directory, 'saved.pt')
    shutil.copy(os.path.join(directory, 'run.pt'), saved)
    return directory, outcomes, elapsed


def test_sigterm_to_every_rank_mid_epoch_then_a_second_start_ends_bit_identical(reference, sigterm_run):
    directory, outcomes, elapsed = sigterm_run
    print('SIGTERM to the last rank exit: {:.2f} s'.format(elapsed))
    for rank, (_, stderr, status) in enumerate(outcomes):
        assert status == tbd.EXIT_PREEMPTED, 'rank {} exited {}:\n{}'.format(rank, status, stderr[-3000:])
    # the stop rides the next step's all-reduce (two steps at most), then the checkpoint and the exit
    assert elapsed < 2 * STEP_SLEEP + LOAD_SLACK
    position = torch.load(os.path.join(directory, 'run.pt'), weights_only=True)['position']
    assert position['epoch'] == 1 and 0 < position['batches'] < STEPS_AT_2, position
    assert position['world_size'] == 2 and position['batch_size'] == long_job.BATCH_SIZE
    outcomes = _wait(_start_by_hand(directory, 2), 60)
    for rank, (_, stderr, status) in enumerate(outcomes):
        assert status == 0, 'rank {} exited {} on the second start:\n{}'.format(rank, status, stderr[-3000:])
    params = torch.load(os.path.join(directory, 'final.pt'), weights_only=True)
    expected, batches = reference
    print('resumed vs uninterrupted, largest parameter difference:', _max_difference(params, expected))
    assert _equal(params, expected)
    for rank in range(2):  # the same batches, in the same order, each trained once
        assert [row[1:] for row in long_job.seen(directory, rank)] == batches[rank]


def test_a_checkpoint_written_at_world_size_2_resumes_at_3_with_the_epoch_resharded(reference, sigterm_run,
                                                                                       tmp_path):
    source, _, _ = sigterm_run
    directory = str(tmp_path)
    shutil.copy(os.path.join(source, 'saved.pt'), os.path.join(directory, 'run.pt'))
    position = torch.load(os.path.join(directory, 'run.pt'), weights_only=True)['position']
    before = [row for r in range(2) for row in long_job.seen(source, r)[:STEPS_AT_2 + position['batches']]]
    params = run_workers(_worker, 3, args=(directory, EPOCHS))[0]
    after = [row for r in range(3) for row in long_job.seen(directory, r)]
    # Epoch 2 (index 1): what the two ranks trained before the signal, then the rest over three ranks.
    done = [i for _, epoch, _, indices in before if epoch == 1 for i in indices]
    rest = [i for _, epoch, _, indices in after if epoch == 1 for i in indices]
    assert len(done) == 2 * long_job.BATCH_SIZE * position['batches'] and len(set(done)) == len(done)
    assert set(done) | set(rest) == set(range(long_job.SAMPLES)) and not set(done) & set(rest)
    left = long_job.SAMPLES - len(done)
    assert len(rest) == left + (-left) % 3  # padded to a multiple of 3, as DistributedSampler does
    last = sorted({(r, batch) for r in range(3) for _, epoch, batch, _ in long_job.seen(directory, r) if epoch == 1})
    assert max(batch for _, batch in last) == 6  # 50 a rank at 3: 7 batches, the index goes on to the last
    assert sorted(i for _, epoch, _, indices in after if epoch == 2 for i in indices) == list(
        range(long_job.SAMPLES))
    print('resumed at 3 vs uninterrupted at 2, largest parameter difference: {:.4f} (parameters up to {:.2f})'.format(
        _max_difference(params, reference[0]), max(v.abs().max().item() for v in reference[0].values())))
    assert all(torch.isfinite(v).all() for v in params.values())


@pytest.mark.parametrize('step', [12, 27], ids=['after-an-epoch-end', 'mid-epoch'])
def test_kill_9_of_one_rank_under_torchrun_restarts_and_ends_as_uninterrupted(reference, tmp_path, step):
    # Step 12 goes on from the checkpoint of epoch 1's end (step 10), written after the step one of step 8;
    # step 27 from the step checkpoint of step 24.
    print('rank 1 kills itself at step', step)
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
               '--max-restarts', '2', '--monitor-interval', '0.2', JOB, '--dir', str(tmp_path), '--epochs', str(EPOCHS),
               '--every-steps', '4', '--kill-rank', '1', '--kill-at', str(step)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                               start_new_session=True, cwd=ROOT)
    (_, stderr, status), = _wait([process], 90)
    assert status == 0, stderr[-4000:]
    params = torch.load(str(tmp_path / 'final.pt'), weights_only=True)
    print('restarted vs uninterrupted, largest parameter difference:', _max_difference(params, reference[0]))
    assert _equal(params, reference[0])
    rows = long_job.seen(str(tmp_path), 0)
    pids = list(dict.fromkeys(row[0] for row in rows))
    assert len(pids) == 2  # rank 0 ran twice: torchrun restarted it once
    first, = [(epoch * STEPS_AT_2 + batch) for pid, epoch, batch, _ in rows if pid == pids[1]][:1]
    print('the restarted group went on from step', first + 1)
    # From the newest checkpoint before the kill: a step one (every 4 steps) or an epoch's end (every 10).
    assert first == max(4 * ((step - 1) // 4), STEPS_AT_2 * ((step - 1) // STEPS_AT_2))


def test_killing_a_step_checkpoint_write_leaves_every_kept_checkpoint_loadable(tmp_path):
    path = str(tmp_path / 'run.pt')
    rng = random.Random(0)
    progress = []
    for _ in range(4):
        process = subprocess.Popen([sys.executable, JOB, '--dir', str(tmp_path), '--write-forever'],
                                   stdout=subprocess.PIPE, start_new_session=True, env=child_env(), cwd=ROOT)
        try:
            assert process.stdout.readline() == b'writing\n'
            time.sleep(rng.uniform(0.3, 1.5))
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        finally:
            kill_session(process.pid)
            process.wait()
            process.stdout.close()
        kept = [path] + ['{}.{}'.format(path, i) for i in (1, 2)]
        steps = []
        for name in kept:
            if os.path.exists(name):
                saved = tbd.load_checkpoint(name)  # weights_only inside: a torn file raises
                where = saved['position'] or {'epoch': len(saved['history']), 'batches': 0}  # an epoch's end
                steps.append((where['epoch'], where['batches']))
        assert steps and steps == sorted(steps, reverse=True), steps  # path.1 may be path's link, if killed between
        progress.append(steps[0])
    print('newest (epoch, batches) after each kill:', progress)
    assert progress == sorted(progress) and progress[-1] > progress[0]  # each writer resumed from the last
    leftovers = [n for n in os.listdir(tmp_path) if n not in ('run.pt', 'run.pt.1', 'run.pt.2')]
    assert len(leftovers) <= 2, leftovers  # at most the temporaries of the last killed writer


@pytest.mark.parametrize('world_size, now', [(2, 2), (2, 3), (3, 2), (4, 3)])
@pytest.mark.parametrize('drop_last', [False, True])
def test_remaining_indices_continue_the_epoch(world_size, now, drop_last):
    dataset = TensorDataset(torch.arange(23))
    batches = 2  # of 3 samples, per rank
    shards = []
    for r in range(world_size):
        sampler = DistributedSampler(dataset, world_size, r, shuffle=True, seed=5, drop_last=drop_last)
        sampler.set_epoch(4)
        shards.append(list(sampler))
    done = [i for shard in shards for i in shard[:3 * batches]]
    rest = []
    for r in range(now):
        sampler = DistributedSampler(dataset, now, r, shuffle=True, seed=5, drop_last=drop_last)
        sampler.set_epoch(4)
        mine = data.remaining_indices(sampler, 3 * batches, world_size)
        if now == world_size:
            assert mine == shards[r][3 * batches:]  # exactly the rest of this rank's shard
        rest.append(mine)
    assert len({len(mine) for mine in rest}) == 1  # every rank the same number of samples
    flat = [i for mine in rest for i in mine]
    if not drop_last:
        assert set(done) | set(flat) == set(range(23))
    if now != world_size:
        assert not set(done) & set(flat)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"^every_steps should be a positive integer, but given 0$"):
        tbd.Checkpoint('run.pt', every_steps=0)
    with pytest.raises(ValueError, match=r"^every_seconds should be a positive number, but given -1$"):
        tbd.Checkpoint('run.pt', every_seconds=-1)
    with pytest.raises(ValueError, match=r"^keep should be a positive integer, but given 1.5$"):
        tbd.Checkpoint('run.pt', keep=1.5)


def test_a_missing_checkpoint_is_none_with_missing_ok(tmp_path):
    assert tbd.load_checkpoint(str(tmp_path / 'none.pt'), missing_ok=True) is None


def test_under_slurm_a_signal_checkpoints_and_requeues_the_job(tmp_path, monkeypatch):
    """One process as SLURM starts it, pre-emption handling on: a SIGTERM mid-epoch ends run()
    with Preempted (status 75) after a step checkpoint, and rank 0 runs ``scontrol requeue`` (a stand-in here)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    calls = tmp_path / 'scontrol.calls'
    (bin_dir / 'scontrol').write_text('#!/bin/sh\necho "$@" >> {}\n'.format(calls))
    (bin_dir / 'scontrol').chmod(0o755)
    monkeypatch.setenv('PATH', '{}{}{}'.format(bin_dir, os.pathsep, os.environ['PATH']))
    monkeypatch.setenv('SLURM_JOB_ID', '4242')
    monkeypatch.setenv('TORCHBEARER_DIST_REQUEUE', '1')
    directory = str(tmp_path / 'job')
    os.mkdir(directory)
    tbd.watch_preemption()  # asked for: Checkpoint installs no handler, under SLURM neither
    try:
        with pytest.raises(tbd.Preempted, match=r'^pre-empted by SIGTERM in epoch 1 after 7 batches; resumable from '):
            long_job.train(directory, 2, fault_at={0: 7})
        assert tbd.Preempted().code == tbd.EXIT_PREEMPTED == 75
    finally:
        tbd.unwatch_preemption()
    assert calls.read_text() == 'requeue 4242\n'
    position = torch.load(os.path.join(directory, 'run.pt'), weights_only=True)['position']
    assert (position['epoch'], position['batches'], position['world_size']) == (0, 7, 1)


def test_every_seconds_and_keep_in_one_process(tmp_path):
    """every_seconds=tiny checkpoints after every step; keep=3 leaves the epoch's end and the two steps before it."""
    from torch.utils.data import DataLoader
    from torchbearer import Trial

    dataset = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, 1, 0))
    model = torch.nn.Linear(3, 2)
    path = str(tmp_path / 'run.pt')
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                  callbacks=[tbd.Checkpoint(path, every_seconds=1e-9, keep=3)], verbose=0).with_generators(loader)
    trial.run(1)
    kept = [tbd.load_checkpoint(name) for name in (path, path + '.1', path + '.2')]
    assert [saved['position'] for saved in kept[1:]] == [
        {'epoch': 0, 'batches': batches, 'batch_size': 8, 'world_size': 1, 'steps': 5} for batches in (5, 4)]
    assert kept[0]['position'] is None and len(kept[0]['history']) == 1
    assert sorted(os.listdir(tmp_path)) == ['run.pt', 'run.pt.1', 'run.pt.2']


def test_sigterm_to_the_launcher_alone_reaches_its_ranks_and_it_exits_75(tmp_path):
    """launch() forwards a pre-emption signal to its ranks; they checkpoint and it raises Preempted (exit 75)."""
    process = subprocess.Popen([sys.executable, JOB, '--dir', str(tmp_path), '--epochs', str(EPOCHS), '--sleep', '0.15',
                                '--launch', '2'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=child_env(), start_new_session=True, cwd=ROOT)
    try:
        seen, deadline = tmp_path / 'seen.0', time.monotonic() + 60
        while not (seen.exists() and seen.read_text().count('\n') >= 3) and process.poll() is None:
            assert time.monotonic() < deadline, 'no training after 60 s'
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)  # the launcher only, not its ranks
        (_, stderr, status), = _wait([process], 60)
    finally:
        kill_session(process.pid)
        process.wait()
    assert status == tbd.EXIT_PREEMPTED, stderr[-3000:]
    position = torch.load(str(tmp_path / 'run.pt'), weights_only=True)['position']
    assert position['world_size'] == 2 and position['batches'] >= 3, position
