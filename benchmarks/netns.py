"""Several "hosts" on one Linux machine: network namespaces on a private switch, links shaped with tbf.

Needs root and iproute2. Every host ``tbdb<tag>h<i>`` has one veth link to a bridge that lives in
its own namespace ``tbdb<tag>sw``, and an address ``10.233.<net>.<i + 1>/24`` that exists only
inside these namespaces, so no traffic leaves them. :meth:`Hosts.shape` puts a ``tbf`` qdisc on each
host's sending side (a full-duplex link of that rate per host); ``None`` removes it. Everything is
deleted on exit, also when the run fails.

Example:

    .. code-block:: python

        with Hosts(2) as hosts:
            hosts.shape('100mbit')
            subprocess.run(hosts.command(0, ['python', 'train.py', '--host', hosts.address(0)]))
"""
import os
import random
import shutil
import subprocess

#: The namespace prefix and the /16 of the benchmark; tests use others, so the two never collide.
PREFIX, SUBNET = 'tbdb', '10.233'


def _ip(*args, check=True):
    result = subprocess.run(['ip', *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError('ip {} failed: {}'.format(' '.join(args), result.stderr.strip()))
    return result


def unavailable():
    """Why namespaces can't be made here, or None when they can."""
    if os.geteuid() != 0:
        return 'network namespaces need root'
    for tool, package in (('ip', 'iproute2'), ('tc', 'iproute2')):
        if shutil.which(tool) is None:
            return 'network namespaces need the {} command (apt-get install {})'.format(tool, package)
    return None


def tbf_burst(rate_bit):
    """Bucket size of a tbf at ``rate_bit`` bit/s: the issue's 1 Mbit, or 2 ms of traffic on faster links."""
    return max(10 ** 6, int(rate_bit * 0.002))


class Hosts:
    """``count`` network namespaces joined by a bridge, each with a shapeable link.

    Args:
        count (int): number of hosts

    Raises:
        RuntimeError: the namespaces could not be made (the reason is in the message)
    """

    def __init__(self, count):
        tag = '{:04x}'.format((os.getpid() * 7919 + random.randrange(1 << 16)) % (1 << 16))
        self.switch = '{}{}sw'.format(PREFIX, tag)
        self.namespaces = ['{}{}h{}'.format(PREFIX, tag, i) for i in range(count)]
        self.links = ['tbdb{}e{}'.format(tag, i) for i in range(count)]  # host side; at most 15 characters
        self.ports = ['tbdb{}p{}'.format(tag, i) for i in range(count)]  # switch side
        net = random.randrange(256)
        self.addresses = ['{}.{}.{}'.format(SUBNET, net, i + 1) for i in range(count)]
        self._made = []

    def __enter__(self):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        try:
            self._create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc):
        self.delete()

    def _create(self):
        for name in [self.switch] + self.namespaces:
            _ip('netns', 'add', name)
            self._made.append(name)
        _ip('-n', self.switch, 'link', 'add', 'br0', 'type', 'bridge')
        _ip('-n', self.switch, 'link', 'set', 'br0', 'up')
        for name, link, port, address in zip(self.namespaces, self.links, self.ports, self.addresses):
            _ip('-n', self.switch, 'link', 'add', port, 'type', 'veth', 'peer', 'name', link, 'netns', name)
            _ip('-n', self.switch, 'link', 'set', port, 'master', 'br0')
            _ip('-n', self.switch, 'link', 'set', port, 'up')
            _ip('-n', name, 'addr', 'add', address + '/24', 'dev', link)
            _ip('-n', name, 'link', 'set', link, 'up')
            _ip('-n', name, 'link', 'set', 'lo', 'up')

    def delete(self):
        """Delete every namespace, and with them their links and the bridge."""
        for name in reversed(self._made):
            _ip('netns', 'del', name, check=False)
        self._made = []

    def shape(self, rate):
        """Shape every host's sending side to ``rate`` (a tc rate such as ``'100mbit'``), or unshape with None."""
        for name, link in zip(self.namespaces, self.links):
            subprocess.run(['ip', 'netns', 'exec', name, 'tc', 'qdisc', 'del', 'dev', link, 'root'],
                           capture_output=True, timeout=30)
            if rate is None:
                continue
            bits = int(float(rate[:-4]) * {'k': 1e3, 'm': 1e6, 'g': 1e9}[rate[-4]])
            result = subprocess.run(['ip', 'netns', 'exec', name, 'tc', 'qdisc', 'add', 'dev', link, 'root', 'tbf',
                                     'rate', rate, 'burst', str(tbf_burst(bits) // 8), 'latency', '50ms'],
                                    capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                raise RuntimeError('tc tbf on {} failed: {}'.format(link, result.stderr.strip()))

    def address(self, host):
        """The address of host ``host``."""
        return self.addresses[host]

    def command(self, host, argv):
        """``argv`` run inside host ``host``."""
        return ['ip', 'netns', 'exec', self.namespaces[host], *argv]
