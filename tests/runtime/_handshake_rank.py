"""A hand-started rank (``_fault_rank.py``) that says where it is in the handshake, so a test can stop it there.

Rank 1 prints ``held in the handshake`` once it has claimed its rank and before it says where it runs
or its world size, and stays there until a signal ends it; the other ranks print ``waiting for rank 1``
when they wait for rank 1's world size. A test that has read all three lines knows, without racing
the handshake, that every rank is inside it. With ``HANDSHAKE_RELEASE_<rank>`` set to a path, that rank
then waits until the file exists before it polls the store: a rank slowed by a loaded machine. Run as
``_fault_rank.py`` is.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')  # before torch is imported, as _fault_rank's main does
    from torchbearer_dist.runtime import _peers, rendezvous

    import _fault_rank
    rank = int(sys.argv[sys.argv.index('--rank') + 1])
    identity, wait = _peers.identity, rendezvous._wait

    def held():
        if rank == 1:
            print('held in the handshake', flush=True)
            time.sleep(600)
        return identity()

    def waiting(store, keys, *args, **kwargs):
        if keys == ['world_size/1']:
            print('waiting for rank 1', flush=True)
            release = os.environ.get('HANDSHAKE_RELEASE_{}'.format(rank))
            while release and not os.path.exists(release):  # a slow rank: it polls only once told to
                time.sleep(0.05)
        return wait(store, keys, *args, **kwargs)

    _peers.identity, rendezvous._wait = held, waiting
    _fault_rank.main()


if __name__ == '__main__':
    main()
