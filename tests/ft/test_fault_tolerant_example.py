"""The example in the fault-tolerant mode, as the docs page runs it: two replicas on loopback, one lighthouse."""
import os
import re
import subprocess

import pytest
import torch

from _dist import ROOT, STARTUP, child_env, kill_session, python, run_command

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from torchbearer_dist import Lighthouse  # noqa: E402

EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
EPOCH_LINE = re.compile(r'^epoch 1/1: loss [\d.]+ acc [\d.]+ val_loss [\d.]+ val_acc ([\d.]+)$', re.M)


def _two_replicas(folder, *extra):
    """The example's two replicas beside one lighthouse, in one folder, both given the same --save file; their
    epoch lines, and the weights that one of them saved."""
    folder.mkdir()
    save = folder / 'model.pt'
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=30.0, heartbeat_timeout=2.0) as lighthouse:
        processes = [subprocess.Popen(python(EXAMPLE, '--download', 'never', '--fault-tolerant', '--lighthouse',
                                             lighthouse.address, '--replica', str(i), '--replicas', '2', '--epochs',
                                             '1', '--threads', '1', '--save', str(save), *extra),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(folder),
                                      start_new_session=True, env=child_env())
                     for i in range(2)]
        try:
            outputs = [p.communicate(timeout=STARTUP + 120) for p in processes]
        finally:
            for p in processes:
                kill_session(p.pid)
                p.wait()
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-3000:]
        assert float(EPOCH_LINE.search(out).group(1)) > 0.8, out
    # One replica saves (the first of the last quorum): no two processes write one file at once.
    assert sum(out.count('saved the model to {}'.format(save)) for out, _ in outputs) == 1, outputs
    weights = torch.load(save, weights_only=True)
    return [EPOCH_LINE.search(out).group(0) for out, _ in outputs], weights


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_train_the_example_to_the_same_weights_every_step_and_with_diloco(tmp_path):
    every_step = _two_replicas(tmp_path / 'every_step')
    diloco = _two_replicas(tmp_path / 'diloco', '--local-steps', '32')
    for lines, weights in (every_step, diloco):
        # min_replicas=2: both trained together from the first replica's weights: the same figures (the replicas'
        # weights agree bit for bit at the end, or the run fails: FaultTolerantAllReduce compares them).
        assert lines[0] == lines[1]
        assert sorted(weights) == ['hidden.bias', 'hidden.weight', 'out.bias', 'out.weight']
    # --local-steps reaches the fault-tolerant mode: DiLoCo's meetings, not an average at every step.
    assert diloco[0][0] != every_step[0][0]
    assert not torch.equal(diloco[1]['out.weight'], every_step[1]['out.weight'])


@pytest.mark.parametrize('args, message', [
    (['--fault-tolerant'], 'error: --fault-tolerant needs --lighthouse HOST:PORT (start one with python -m '
                           'torchbearer_dist.ft) (see --help)'),
    (['--fault-tolerant', '--lighthouse', 'h:1', '--replica', '2', '--replicas', '2'],
     'error: --replica should be between 0 and 1, but given 2 (see --help)'),
])
def test_bad_fault_tolerant_flags_are_one_line_and_status_2(args, message, tmp_path):
    result = run_command(python(EXAMPLE, '--download', 'never', *args), timeout=60, cwd=str(tmp_path))
    assert (result.returncode, result.stderr.splitlines()) == (2, [message])
