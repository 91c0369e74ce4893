"""The example carries on under ``torchrun --max-restarts`` after a rank is SIGKILLed (issue 17, item 4).

A rank of the MNIST example is killed with SIGKILL once its first step checkpoint is on disk; torchrun
restarts the worker group, the example resumes from its checkpoint directory by itself, and the model
it saves at the end equals, bit for bit, the one of an uninterrupted run started by ``launch``.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from _dist import ROOT, child_env, children, kill_session, run_command

EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
ARGS = ('--epochs', '2', '--threads', '1', '--batch-size', '64')


@pytest.mark.slow
def test_the_example_resumes_by_itself_after_a_rank_is_killed_under_torchrun(tmp_path):
    reference = run_command([sys.executable, EXAMPLE, *ARGS, '--save', str(tmp_path / 'straight.pt')], timeout=120,
                            cwd=str(tmp_path))
    assert reference.returncode == 0, reference.stderr[-3000:]
    checkpoints = tmp_path / 'ckpt'
    checkpoints.mkdir()
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
                '--max-restarts', '3', '--monitor-interval', '0.2']
    process = subprocess.Popen([*torchrun, EXAMPLE, *ARGS, '--save', str(tmp_path / 'restarted.pt'),
                                '--checkpoint-dir', str(checkpoints), '--checkpoint-steps', '5'],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                               start_new_session=True, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 90
        while not (checkpoints / 'mnist_mlp.ckpt').exists() and process.poll() is None:
            assert time.monotonic() < deadline, 'no checkpoint after 90 s'
            time.sleep(0.02)
        workers = children(process.pid)
        assert workers, 'torchrun has no workers'
        os.kill(workers[-1], signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=150)
    finally:
        kill_session(process.pid)
        process.wait()
    assert process.returncode == 0, stderr[-4000:]
    straight = torch.load(str(tmp_path / 'straight.pt'), weights_only=True)
    restarted = torch.load(str(tmp_path / 'restarted.pt'), weights_only=True)
    difference = max((straight[k] - restarted[k]).abs().max().item() for k in straight)
    print('killed and restarted vs uninterrupted, largest parameter difference:', difference)
    assert all(torch.equal(straight[k], restarted[k]) for k in straight)
    shutil.rmtree(checkpoints)


def test_no_resume_and_a_missing_checkpoint_dir(tmp_path):
    result = run_command([sys.executable, EXAMPLE, '--checkpoint-dir', str(tmp_path / 'nowhere')], timeout=60,
                         cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == 'error: --checkpoint-dir {} does not exist; create it first (see --help)\n'.format(
        tmp_path / 'nowhere')
