"""(private) The one place that reads torchft's internals (torchft 0.2.0) and a detail of ``concurrent.futures``.

tests/ft/test_torchft_internals.py fails if one of them moves:

- :data:`DASHBOARD_TITLE`: a torchft lighthouse serves an HTML dashboard at ``/`` besides its gRPC service, and
  that page is how it is told from something else listening at its address: its gRPC service has no call
  without effect (a heartbeat or a quorum would register a replica that does not exist, and stall the quorums
  of the live ones).
- :func:`heal_server`: ``HTTPTransport._server``, the HTTP server that sends this replica's state to a replica
  that heals from it (its access lines and broken pipes are quietened there, see :mod:`~torchbearer_dist.ft._quiet`).
- :func:`wake_quorum_wait`: ``Manager._quorum_future``, the quorum in flight, waited for by the main thread in
  ``Manager.start_quorum`` (``future.result()``), while torchft's quorum thread is inside a Rust call that
  nothing interrupts for up to three ``timeout``\\ s.
- :func:`quorum_id`: ``Manager._quorum_id``, the lighthouse's number of the last quorum this replica joined (it
  changes with the quorum's membership): the replicas of a new one compare their configurations once
  (:mod:`~torchbearer_dist.ft._vote`); torchft has no public accessor for it.
- :func:`load_heal`: ``Manager._healing`` and ``Manager._apply_pending_state_dict``: a heal that an asynchronous
  quorum staged, loaded at once, as torchft's synchronous ``start_quorum`` does (else it waits for
  ``should_commit``), so that a replica joining at the start of its run begins at its healer's position.
- :func:`members`: the rank that torchft's ``ProcessGroupWrapper`` holds for the quorum (``_rank``; its ``rank()``
  is its base class's 0) and whether it holds a group (``_pg``): this replica's place among every replica of the
  quorum, those that heal in it too.
"""
import concurrent.futures

#: The title of a torchft lighthouse's dashboard (the page it serves at ``/``).
DASHBOARD_TITLE = 'Lighthouse Dashboard - torchft'


def heal_server(transport):
    """The ``socketserver`` HTTP server of torchft's ``HTTPTransport`` ``transport``."""
    return transport._server


def wake_quorum_wait(manager):
    """Make the main thread's wait for ``manager``'s quorum in flight end now, in a ``TimeoutError`` raised out of
    ``Manager.start_quorum``; False where no quorum is in flight.

    The future is left as it is: torchft's quorum thread completes it when its Rust call returns (completing it
    here would make that thread fail, with a traceback from ``concurrent.futures``).
    """
    future = getattr(manager, '_quorum_future', None)
    if not isinstance(future, concurrent.futures.Future) or future.done():
        return False
    with future._condition:  # Future.result() waits on it; woken with the future still running, it raises
        future._condition.notify_all()
    return True


def quorum_id(manager):
    """The id of the last quorum ``manager`` joined (the same on every replica of it; new when its membership is)."""
    return manager._quorum_id


def load_heal(manager):
    """Load now the heal ``manager``'s last quorum staged (its load function runs here); True where it did. The
    replica still counts for nothing in that quorum's step, as torchft decided when the quorum formed."""
    if not manager._healing:
        return False
    manager._apply_pending_state_dict()
    manager._healing = False
    return True


def members(group):
    """``(rank, size)`` of this replica in the process group of its Manager's quorum (a
    ``torchft.ProcessGroupWrapper``); ``(None, 0)`` where it holds none (its configuration for the quorum failed:
    torchft then fails the step)."""
    if group._pg is None:
        return None, 0
    return group._rank, group.size()
