"""The fault-tolerant mode's options and its missing extra: one-line errors, before any process or quorum."""
import subprocess

import pytest

import torchbearer_dist as tbd

from _dist import STARTUP, child_env, python


@pytest.mark.parametrize('kwargs, message', [
    (dict(fault_tolerant='nohost'), r"the lighthouse should be an address \"HOST:PORT\", but given 'nohost'"),
    (dict(fault_tolerant=3), r'the lighthouse should be an address "HOST:PORT", but given 3'),
    (dict(fault_tolerant='h:1', min_replicas=0), r'min_replicas should be an integer >= 1, but given 0'),
    (dict(fault_tolerant='h:1', timeout=-1), r'timeout should be a positive number of seconds, but given -1'),
    (dict(fault_tolerant='h:1', replica_id='a:b'), r"replica_id should be a non-empty string without \":\", but "
                                                   r"given 'a:b'"),
    (dict(fault_tolerant='h:1', local_steps=8, compression='int8'),
     r"fault_tolerant meetings block and travel in fp32: leave out compression and overlap_steps \(or pass None and "
     r"0\), not compression='int8', overlap_steps=None"),
    (dict(fault_tolerant='h:1', local_steps=8, overlap_steps=2), r'not compression=None, overlap_steps=2'),
    (dict(local_steps=8, meetings=object()), r"meetings through torchft block and travel in fp32: pass "
                                             r"compression=None and overlap_steps=0, not 'int4' and None"),
    (dict(fault_tolerant='h:1', ddp=True), r'ddp=True does not combine with fault_tolerant yet'),
])
def test_bad_options_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tbd.distributed_callbacks(**kwargs)


def test_fault_tolerant_true_reads_the_environment(monkeypatch):
    monkeypatch.delenv('TORCHFT_LIGHTHOUSE', raising=False)
    with pytest.raises(ValueError, match='fault_tolerant=True needs the lighthouse address'):
        tbd.distributed_callbacks(fault_tolerant=True)
    monkeypatch.setenv('TORCHFT_LIGHTHOUSE', 'lighthouse.example:29510')
    callbacks = tbd.distributed_callbacks(fault_tolerant=True, flatten_images=True)
    assert [type(c).__name__ for c in callbacks] == ['SetSamplerEpoch', 'FlattenImages', 'FaultTolerantAllReduce',
                                                     'ReduceMetrics']
    assert callbacks[2].lighthouse == 'http://lighthouse.example:29510'
    assert callbacks[3].group == callbacks[2].group  # the figures reduced over the replica's live group


def test_local_steps_put_diloco_after_the_replica_its_meetings_go_through():
    callbacks = tbd.distributed_callbacks(fault_tolerant='h:1', local_steps=8, outer_lr=0.7, timeout=5,
                                          compression=None)
    assert [type(c).__name__ for c in callbacks] == ['SetSamplerEpoch', 'FaultTolerantAllReduce', 'ReduceMetrics',
                                                     'DiLoCo']
    replica, _, diloco = callbacks[1:]
    assert diloco.meetings is replica and not replica.every_step and replica.timeout == 5
    assert (diloco.local_steps, diloco.overlap_steps, diloco.options['compression']) == (8, 0, None)
    assert diloco.options['outer_lr'] == 0.7
    assert tbd.distributed_callbacks(fault_tolerant='h:1')[1].every_step


def test_the_fail_fast_mode_stays_the_default():
    names = [type(c).__name__ for c in tbd.distributed_callbacks()]
    assert names[-1] == 'AllReduceGradients' and 'FaultTolerantAllReduce' not in names
    assert [type(c).__name__ for c in tbd.distributed_callbacks(fault_tolerant=False)] == names


def test_without_torchft_the_mode_says_how_to_install_it():
    code = ("import sys; sys.modules['torchft'] = None\n"  # torchft not importable, as where it is not installed
            "import torch, torchbearer, torchbearer_dist as tbd\n"
            "trial = torchbearer.Trial(torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), 0.1),"
            " callbacks=tbd.distributed_callbacks(fault_tolerant='127.0.0.1:1'))\n"
            "trial.for_train_steps(1).run(1)\n")
    result = subprocess.run(python('-c', code), capture_output=True, text=True, timeout=2 * STARTUP, env=child_env())
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "RuntimeError: the fault-tolerant mode needs torchft, which is not importable (import of torchft halted; None "
        'in sys.modules); install it with pip install "torchbearer_dist[ft]"')
