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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_train_the_example_to_the_same_weights(tmp_path):
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=30.0, heartbeat_timeout=2.0) as lighthouse:
        processes = [subprocess.Popen(python(EXAMPLE, '--download', 'never', '--fault-tolerant', '--lighthouse',
                                             lighthouse.address, '--replica', str(i), '--replicas', '2', '--epochs',
                                             '1', '--threads', '1', '--save', str(tmp_path / 'r{}.pt'.format(i))),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                                      start_new_session=True, env=child_env())
                     for i in range(2)]
        try:
            outputs = [p.communicate(timeout=STARTUP + 180) for p in processes]
        finally:
            for p in processes:
                kill_session(p.pid)
                p.wait()
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-3000:]
        assert float(EPOCH_LINE.search(out).group(1)) > 0.8, out
    # min_replicas=2: both trained every step together, from the first replica's weights: the same model.
    assert EPOCH_LINE.search(outputs[0][0]).group(0) == EPOCH_LINE.search(outputs[1][0]).group(0)
    first, second = (torch.load(tmp_path / 'r{}.pt'.format(i), weights_only=True) for i in range(2))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize('args, message', [
    (['--fault-tolerant'], 'error: --fault-tolerant needs --lighthouse HOST:PORT (start one with python -m '
                           'torchbearer_dist.ft) (see --help)'),
    (['--fault-tolerant', '--lighthouse', 'h:1', '--replica', '2', '--replicas', '2'],
     'error: --replica should be between 0 and 1, but given 2 (see --help)'),
])
def test_bad_fault_tolerant_flags_are_one_line_and_status_2(args, message, tmp_path):
    result = run_command(python(EXAMPLE, '--download', 'never', *args), timeout=60, cwd=str(tmp_path))
    assert (result.returncode, result.stderr.splitlines()) == (2, [message])
