"""The fault-tolerant tests' common fixtures: a torchft lighthouse in this process, and replica processes beside it.

The lighthouse (Rust threads of this process) is shut down and every replica's session killed when its test
ends, so nothing outlives a test. torchft is imported only when a test asks for them (it is an optional extra:
the test files skip without it).
"""
import pytest
from _replicas import Replicas


@pytest.fixture
def lighthouse():
    """The address of a lighthouse of ``min_replicas=1`` that drops a replica silent for 2 s."""
    from torchbearer_dist.ft import Lighthouse
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        yield server.address


@pytest.fixture
def replicas(tmp_path, lighthouse):
    """Replica processes of tests/ft/_replica.py at :func:`lighthouse`, all killed when the test ends."""
    started = Replicas(tmp_path, lighthouse)
    yield started
    started.kill_all()
