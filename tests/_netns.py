"""Two "hosts" on one Linux machine: network namespaces joined by a veth pair (needs root and iproute2).

Each run picks its own namespace and link names and a private /24 that exists only inside the two
namespaces, so parallel runs never collide and no traffic leaves them. Everything is deleted on exit.
The name prefix and the /16 the /24 is drawn from come from ``TORCHBEARER_DIST_TEST_NETNS_PREFIX``
(default ``tbd``) and ``TORCHBEARER_DIST_TEST_NETNS_SUBNET`` (default ``10.231``), so that several
suites on one machine can keep apart.

Example:

    .. code-block:: python

        with TwoHosts() as hosts:                      # skips the test where namespaces can't be made
            subprocess.run(hosts.command(0, ['python', 'train.py', '--host', hosts.address(0)]))
            hosts.link_down(1)                         # host 1 drops off the network
"""
import os
import random
import shutil
import subprocess

import pytest


def _ip(*args, check=True):
    result = subprocess.run(['ip', *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise RuntimeError('ip {} failed: {}'.format(' '.join(args), result.stderr.strip()))
    return result


def unavailable():
    """Why namespaces can't be made here, or None when they can."""
    if os.geteuid() != 0:
        return 'network namespaces need root'
    if shutil.which('ip') is None:
        return 'network namespaces need the ip command (apt-get install iproute2)'
    return None


class TwoHosts:
    """Two network namespaces ``<prefix><id>h0`` and ``<prefix><id>h1`` with addresses ``<subnet>.N.1`` and ``.2``.

    Args:
        prefix (str): namespace name prefix, at most 4 characters; by default from the environment
        subnet (str): the first two octets, e.g. ``'10.231'``; by default from the environment
    """

    def __init__(self, prefix=None, subnet=None):
        prefix = prefix or os.environ.get('TORCHBEARER_DIST_TEST_NETNS_PREFIX', 'tbd')
        subnet = subnet or os.environ.get('TORCHBEARER_DIST_TEST_NETNS_SUBNET', '10.231')
        tag = '{:x}{:03x}'.format(os.getpid() % 0x10000, random.randrange(0x1000))
        self.namespaces = ['{}{}h{}'.format(prefix, tag, i) for i in range(2)]
        self.links = ['{}{}l{}'.format(prefix[:4], tag, i) for i in range(2)]  # at most 15 characters
        third = random.randrange(256)
        self.addresses = ['{}.{}.{}'.format(subnet, third, i + 1) for i in range(2)]
        self._made = []

    def __enter__(self):
        reason = unavailable()
        if reason:
            pytest.skip(reason)
        try:
            self._create()
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            self.delete()
            pytest.skip('cannot make network namespaces here: {}'.format(error))
        return self

    def __exit__(self, *exc):
        self.delete()

    def _create(self):
        for name in self.namespaces:
            _ip('netns', 'add', name)
            self._made.append(name)
        _ip('link', 'add', self.links[0], 'type', 'veth', 'peer', 'name', self.links[1])
        for name, link, address in zip(self.namespaces, self.links, self.addresses):
            _ip('link', 'set', link, 'netns', name)
            _ip('-n', name, 'addr', 'add', address + '/24', 'dev', link)
            _ip('-n', name, 'link', 'set', link, 'up')
            _ip('-n', name, 'link', 'set', 'lo', 'up')

    def delete(self):
        """Delete both namespaces, and with them the veth pair."""
        for name in self._made:
            _ip('netns', 'del', name, check=False)
        self._made = []
        _ip('link', 'del', self.links[0], check=False)  # left in the root namespace if creation failed

    def address(self, host):
        """The address of host 0 or 1."""
        return self.addresses[host]

    def command(self, host, argv):
        """``argv`` run inside host 0 or 1."""
        return ['ip', 'netns', 'exec', self.namespaces[host], *argv]

    def link_down(self, host):
        """Take host 0's or 1's link down: its peer stops hearing from it, with no error on either side."""
        _ip('-n', self.namespaces[host], 'link', 'set', self.links[host], 'down')
