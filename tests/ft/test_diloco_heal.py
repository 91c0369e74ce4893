"""DiLoCo in the fault-tolerant mode with BatchNorm: buffers heal, survive a dropped meeting, and resume from a
checkpoint written between two meetings (issue 42, item 1).

Real replica processes (tests/ft/_replica.py, ``--batchnorm``) on loopback, a torchft lighthouse in this process.
Every replica that ends must hold the same parameters *and* buffers, bit for bit, and the values the meetings
define: the anchor and the buffers as of the last meeting (running statistics averaged over the replicas that
trained, ``num_batches_tracked`` the first one's).
"""
import os
import re
import signal
import time

import pytest
import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler

import torchbearer_dist as tbd

from _dist import STARTUP, run_workers

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replica import ClipGradients, Record, dataset, model  # noqa: E402
from _replicas import Replicas, late_joiner, train_together  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: The model's parameters and buffers by name (tests/ft/_replica.py's model with a BatchNorm1d at index 1).
PARAMS = ('0.weight', '0.bias', '1.weight', '1.bias', '3.weight', '3.bias')
BUFFERS = ('1.running_mean', '1.running_var', '1.num_batches_tracked')


def _line(replicas, i, key):
    """The value of replica ``i``'s ``KEY value`` line."""
    found = re.search(r'^{} (\S+)$'.format(key), replicas.out(i), re.M)
    return found and found.group(1)


def _assert_same(a, b, names):
    for name in names:
        assert torch.equal(a[name], b[name]), name


def _assert_at_the_anchor(seen, tensors):
    """The model ``tensors`` (a state_dict) holds the anchor and the buffers as of the last meeting, bit for bit."""
    for name, value in zip(PARAMS, seen['anchor']):
        assert torch.equal(tensors[name], value), name
    for name, value in zip(BUFFERS, seen['buffer_anchor']):
        assert torch.equal(tensors[name], value), name


@pytest.mark.timeout(240)
def test_a_meeting_dropped_at_the_runs_end_leaves_every_survivor_at_the_anchor_buffers_included(tmp_path):
    # 3 replicas, 12 steps an epoch, 2 epochs, H = 5: meetings at the start (the first quorum's, where nobody trained
    # yet), after steps 5, 10, 15, 20 and at the run's end (24). Replica 2 ends inside the last one, after its
    # quorum: the survivors drop it, and go back to the anchor of the meeting at 20. Before, only the parameters went
    # back: each survivor kept its own running statistics, a fork at exit 0 that the end-of-run check (parameters
    # only) did not see.
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    args = ('--replicas', '3', '--samples', '360', '--epochs', '2', '--local-steps', '5', '--batchnorm',
            '--timeout', '5')
    with Lighthouse(bind='127.0.0.1:0', min_replicas=3, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            survivors = [replicas.start(r, *args, '--record', str(paths[r])) for r in range(2)]
            lost = replicas.start(2, *args, '--exit-in-meeting', '6')
            replicas.wait_for(lambda: all(replicas.done(i) for i in survivors), STARTUP + 90)
            assert [replicas.process(i).wait(30) for i in survivors] == [0, 0], replicas.describe()
            assert replicas.process(lost).wait(30) == 3 and 'EXIT in meeting 6' in replicas.out(lost)
        finally:
            replicas.kill_all()
    for i in survivors:
        assert 'dropped the meeting at epoch 1, batch 11' in replicas.err(i), replicas.describe()
    seen = [torch.load(p, weights_only=False) for p in paths]
    assert seen[0]['outer_steps'] == seen[1]['outer_steps'] == 4  # after 5, 10, 15 and 20: not 24's
    _assert_same(seen[0]['final'], seen[1]['final'], PARAMS + BUFFERS)
    assert _line(replicas, survivors[0], 'BUFFERS') == _line(replicas, survivors[1], 'BUFFERS')
    for s in seen:
        _assert_at_the_anchor(s, s['final'])
    assert seen[0]['final']['1.num_batches_tracked'].item() == 20  # as of the meeting at 20


@pytest.mark.timeout(240)
def test_a_replica_paused_past_the_heartbeat_heals_mid_run_and_ends_with_the_healers_buffers(tmp_path):
    # As tests/ft/test_heal_mid_run.py's DiLoCo case, with BatchNorm: replica 1 stopped 8 s (past the heartbeat and
    # the collectives' timeout) heals mid-run at a meeting and ends with replica 0's parameters and buffers.
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    args = ('--replicas', '2', '--epochs', '3', '--samples', '1200', '--sleep', '0.05', '--timeout', '3',
            '--local-steps', '16', '--batchnorm')
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            started = [replicas.start(r, *args, '--record', str(paths[r])) for r in range(2)]
            replicas.wait_for(lambda: min(replicas.position(i) for i in started) >= 20, STARTUP + 60)
            os.kill(replicas.process(started[1]).pid, signal.SIGSTOP)
            time.sleep(8)
            os.kill(replicas.process(started[1]).pid, signal.SIGCONT)
            replicas.wait_for(lambda: all(replicas.done(i) for i in started), STARTUP + 120)
            assert [replicas.process(i).wait(30) for i in started] == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    assert 'healed mid-run' in replicas.err(started[1]), replicas.describe()
    seen = [torch.load(p, weights_only=False) for p in paths]
    _assert_same(seen[0]['final'], seen[1]['final'], PARAMS + BUFFERS)
    assert replicas.done(started[0])[0] == replicas.done(started[1])[0]
    assert replicas.done(started[0])[3] == replicas.done(started[1])[3]  # the same last metrics
    for s in seen:
        _assert_at_the_anchor(s, s['final'])  # the run ended with a meeting of both
    assert seen[0]['final']['1.num_batches_tracked'].item() == 3 * 60


@pytest.mark.timeout(150)
def test_a_replica_started_late_heals_at_a_pass_start_and_ends_with_the_same_buffers(tmp_path):
    # 6 steps an epoch, H = 4 (as test_fault_tolerant_diloco's late start): replica 1 starts while replica 0 waits
    # at its 8th step, heals at the start of epoch 2 (a round begins there) and trains its six batches beside it.
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    replicas, late = late_joiner(tmp_path, 4, 8, first=('--batchnorm', '--record', str(paths[0])),
                                 late=('--batchnorm', '--record', str(paths[1])))
    assert replicas.steps(late) == 6, replicas.describe()
    seen = [torch.load(p, weights_only=False) for p in paths]
    _assert_same(seen[0]['final'], seen[1]['final'], PARAMS + BUFFERS)
    for s in seen:
        _assert_at_the_anchor(s, s['final'])
    # The last meeting averaged both replicas' statistics; num_batches_tracked is replica 0's (the first that trained).
    assert seen[0]['final']['1.num_batches_tracked'].item() == 18


#: The fail-fast reference: 2 ranks, 6 steps an epoch, H = 4, 3 epochs.
H, SAMPLES, EPOCHS = 4, 120, 3


def _worker_fail_fast():
    """tests/ft/_replica.py's Trial with BatchNorm, in the fail-fast mode's DiLoCo, blocking and uncompressed."""
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    data = dataset(SAMPLES)
    loader = DataLoader(data, batch_size=10, sampler=DistributedSampler(data, num_replicas=2, rank=rank, seed=0))
    net = model(rank, 32, batchnorm=True)
    callbacks = tbd.distributed_callbacks(local_steps=H, compression=None, overlap_steps=0, report=False)
    trial = torchbearer.Trial(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                              torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                              callbacks=[ClipGradients(0.25), *callbacks, Record()])
    trial.with_generators(loader).run(EPOCHS, verbose=0)
    return net.state_dict()


@pytest.mark.timeout(150)
def test_two_replicas_with_batchnorm_end_bit_identical_to_the_fail_fast_diloco(tmp_path):
    # What the buffers should be: the fail-fast mode's DiLoCo averages the running statistics at every meeting and
    # copies rank 0's num_batches_tracked; the fault-tolerant meetings must give the same values, bit for bit.
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    replicas = train_together(tmp_path, [('--epochs', str(EPOCHS), '--samples', str(SAMPLES), '--min-replicas', '2',
                                          '--local-steps', str(H), '--batchnorm', '--record', str(p)) for p in paths],
                              STARTUP + 90)
    reference = run_workers(_worker_fail_fast, 2, deadline=STARTUP + 60)[0]
    seen = [torch.load(p, weights_only=False) for p in paths]
    for s in seen:
        _assert_same(s['final'], reference, PARAMS + BUFFERS)
    assert _line(replicas, 0, 'BUFFERS') == _line(replicas, 1, 'BUFFERS')


#: 2 replicas, 12 steps an epoch, 3 epochs, H = 4: meetings after steps 4, 8, ..., 36.
RESUME_ARGS = ('--replicas', '2', '--samples', '240', '--epochs', '3', '--local-steps', '4', '--batchnorm')


def _run_two(tmp_path, name, *extra):
    """Replicas 0 and 1 of RESUME_ARGS at a lighthouse of theirs (both in every quorum), each with ``extra`` in
    which ``{r}`` is its number, in ``tmp_path/name``; every one ended (its status not checked)."""
    directory = tmp_path / name
    directory.mkdir()
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(directory, server.address)
        try:
            started = [replicas.start(r, *RESUME_ARGS, *(e.format(r=r) for e in extra)) for r in range(2)]
            replicas.wait_for(lambda: all(replicas.process(i).poll() is not None for i in started), STARTUP + 90)
        finally:
            replicas.kill_all()
    return replicas


@pytest.mark.timeout(400)
def test_a_checkpoint_written_between_two_meetings_resumes_every_replica_from_the_anchor_at_its_batch(tmp_path):
    # Every replica stops (os._exit, as a kill) after step 18, two steps after the meeting at 16; the replica that
    # writes (the quorum's first) wrote its step checkpoint there. Both start again from that one file. It holds the
    # writer's own weights and inner optimizer, not the other's: the round's local progress cannot come back. What it
    # must be: both replicas resume at the same batch (epoch 1, batch 6) from the anchor and the buffers as of the
    # meeting at 16, the round starting again there (meetings 4 steps apart from it), and end bit-identical to each
    # other. Before, the second replica's heal from the first at their first quorum dropped the checkpoint's
    # position (it began epoch 1 from its first batch, its meetings met the other's at other steps), and the
    # buffers were the writer's own.
    record = str(tmp_path / '{name}{{r}}.pt')
    whole = _run_two(tmp_path, 'whole', '--record', record.format(name='whole'), '--checkpoint',
                     str(tmp_path / 'whole{r}.ckpt'))
    assert [whole.process(i).wait() for i in range(2)] == [0, 0], whole.describe()
    cut = _run_two(tmp_path, 'cut', '--record', record.format(name='cut'), '--checkpoint',
                   str(tmp_path / 'cut{r}.ckpt'), '--every-steps', '6', '--exit-at', '18')
    assert [cut.process(i).wait() for i in range(2)] == [3, 3], cut.describe()
    written = [p for p in (tmp_path / 'cut0.ckpt', tmp_path / 'cut1.ckpt') if p.exists()]
    assert len(written) == 1  # one live replica writes
    saved = torch.load(written[0], weights_only=False)
    assert saved['position']['epoch'] == 1 and saved['position']['batches'] == 6
    diloco = next(e['state'] for e in saved['callbacks'] if e['type'].endswith('DiLoCo'))
    assert diloco['inner_steps'] == 2 and diloco['local'] is None  # mid-round; no other replica's own state
    anchor = {'anchor': diloco['engine']['anchor'], 'buffer_anchor': diloco['engine']['buffer_anchor']}

    resumed = _run_two(tmp_path, 'resumed', '--record', record.format(name='resumed'), '--checkpoint',
                       str(tmp_path / 'resumed{r}.ckpt'), '--every-steps', '6', '--resume', str(written[0]))
    assert [resumed.process(i).wait() for i in range(2)] == [0, 0], resumed.describe()
    seen = [torch.load(tmp_path / 'resumed{}.pt'.format(r), weights_only=False) for r in range(2)]
    reference = [torch.load(tmp_path / 'whole{}.pt'.format(r), weights_only=False) for r in range(2)]
    for i, s in enumerate(seen):
        assert resumed.out(i).split()[1:4] == ['STEP', '1', '6'] and resumed.steps(i) == 18, resumed.describe()
        assert 'dropped' not in resumed.err(i), resumed.describe()
        _assert_at_the_anchor(anchor, s['start'])  # the first step began from the meeting at 16, buffers included
        assert s['outer_steps'] == 4 + 5  # the checkpoint's, then after resumed steps 4, 8, 12, 16 and at the end
        assert len(s['history']) == 3 and s['history'][0] == reference[0]['history'][0]  # epoch 0: the checkpoint's
    _assert_same(seen[0]['final'], seen[1]['final'], PARAMS + BUFFERS)
    assert resumed.done(0)[0] == resumed.done(1)[0] and resumed.done(0)[3] == resumed.done(1)[3]
    assert _line(resumed, 0, 'BUFFERS') == _line(resumed, 1, 'BUFFERS')
    # Not the uninterrupted run: the two local steps after the meeting at 16 are lost, and the meetings fall at
    # other steps since. The docs (fault_tolerance.rst) say so.
    assert not torch.equal(seen[0]['final']['0.weight'], reference[0]['final']['0.weight'])
