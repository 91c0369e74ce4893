"""Starting and watching processes: who am I (:mod:`.env`), meeting the others (:mod:`.rendezvous`,
the route in :mod:`.network`), the process group's life (:mod:`.group`) and starting ranks (:mod:`.launcher`).

The health machinery (heartbeat, fault diagnosis, the socket fallback) lives in this package's
private modules; what a user sees of it is :class:`~torchbearer_dist.PeerFailedError`.
"""
