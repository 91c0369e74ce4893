"""A hand-started rank (``_fault_rank.py``) that says where it is in the handshake, so a test can stop it there.

The held rank (``HANDSHAKE_HOLD``, rank 1 by default) prints ``held in the handshake`` once it has
claimed its rank and before it says where it runs or its world size, and stays there until a signal
ends it, or, with ``HANDSHAKE_HOLD_RELEASE`` set to a path, until that file exists; the other ranks
print ``waiting for rank <held>`` when they wait for its world size. A test that has read all three
lines knows, without racing the handshake, that every rank is inside it. With
``HANDSHAKE_RELEASE_<rank>`` set to a path, that rank then waits until the file exists before it polls
the store: a rank slowed by a loaded machine. Run as ``_fault_rank.py`` is.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _until(path, seconds=600):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (path and os.path.exists(path)):
        time.sleep(0.05)


def main():
    os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')  # before torch is imported, as _fault_rank's main does
    from torchbearer_dist.runtime import _peers, rendezvous

    import _fault_rank
    rank = int(sys.argv[sys.argv.index('--rank') + 1])
    hold = int(os.environ.get('HANDSHAKE_HOLD', '1'))
    identity, wait = _peers.identity, rendezvous._wait

    def held():
        if rank == hold:
            print('held in the handshake', flush=True)
            _until(os.environ.get('HANDSHAKE_HOLD_RELEASE'))
        return identity()

    def waiting(store, keys, *args, **kwargs):
        if keys == ['world_size/{}'.format(hold)]:
            print('waiting for rank {}'.format(hold), flush=True)
            release = os.environ.get('HANDSHAKE_RELEASE_{}'.format(rank))
            if release:  # a slow rank: it polls only once told to
                _until(release)
        return wait(store, keys, *args, **kwargs)

    _peers.identity, rendezvous._wait = held, waiting
    _fault_rank.main()


if __name__ == '__main__':
    main()
