"""A mean over ranks that travels in fewer bits and adds in fp32: reduce-scatter by all-to-all, then all-gather.

An all-reduce in a half type adds in that type: every partial sum is rounded to 8 (bf16) or 11
(fp16) bits of mantissa, and integer steps of different scales cannot be summed at all.
:func:`mean` splits the vector into one chunk per rank instead. Each rank sends chunk ``j``, encoded, to rank ``j``
(``all_to_all_single``); rank ``j`` decodes the chunks it received, adds them in fp32 and divides by
the number of ranks, encodes its averaged chunk once and every rank gathers every averaged chunk
(``all_gather``). Each value is rounded twice, once on the way in and once on the way out; the sums
themselves are exact fp32 sums. Every rank decodes the same gathered bytes, so every rank ends with
the same values, bit for bit.

Over a ring this moves what a ring all-reduce of the encoded vector moves: ``2 (N - 1) / N`` times
its bytes over each rank's link. With two ranks (up to :data:`WHOLE_UP_TO`) that is the whole vector,
so each rank sends its whole encoded vector instead (one ``all_gather``) and every rank adds both in
fp32, in rank order: the same bytes in one collective instead of two in turn (the second waiting for
the first), and each value rounded once.

The encodings:

- ``'fp16'``, ``'bf16'``: the half type, 2 bytes a value.
- ``'int8'``: blocks of :data:`BLOCK` values, each an fp32 scale (the block's largest magnitude over
  127) and one signed byte a value rounded to the nearest step: 1.03 bytes a value, an error of at
  most half a step, 1/254 of the block's largest magnitude.
- ``'int4'``: blocks of :data:`BLOCK4` values, each an fp32 scale (the largest magnitude over 7) and
  4 bits a value (two to a byte): 0.5625 bytes a value, an error of at most 1/14 of the block's
  largest magnitude.

Only torch.distributed's public collectives are used; gloo supports both on CPU for every dtype here.
"""
import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives

#: Values that share one scale in the ``'int8'`` encoding.
BLOCK = 128
#: Values that share one scale in the ``'int4'`` encoding (smaller blocks: a coarser step needs a nearer maximum).
BLOCK4 = 64
#: Up to this many ranks each rank sends its whole encoded vector (one all-gather, rounded once): at two ranks
#: the bytes a reduce-scatter and an all-gather move together; beyond, those two move fewer.
WHOLE_UP_TO = 2
#: The encodings :func:`mean` accepts, with the dtype each value travels in.
ENCODINGS = {'fp16': torch.float16, 'bf16': torch.bfloat16, 'int8': torch.int8, 'int4': torch.uint8}
#: The integer encodings: ``(values a scale, largest step)``.
_INTEGER = {'int8': (BLOCK, 127), 'int4': (BLOCK4, 7)}


def quantize(values, block=BLOCK, levels=127):
    """Encode fp32 ``values`` (a length divisible by ``block``) as integer steps and one fp32 scale per block.

    Args:
        values (torch.Tensor): 1-D float32, ``len(values) % block == 0``
        block (int): values that share a scale
        levels (int): the largest step, at most 127: the block's largest magnitude becomes ``+-levels``

    Returns:
        tuple: ``(steps, scales)``: int8 values in ``[-levels, levels]`` and float32 scales,
        ``values ~ steps * scales`` block by block
    """
    blocks = values.view(-1, block)
    scales = blocks.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: steps 0, scale 0
    steps = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
    return steps.view(-1), scales


def dequantize(steps, scales):
    """The fp32 values :func:`quantize` encoded (within half a step of each).

    Args:
        steps (torch.Tensor): int8, ``len(scales)`` blocks of equal length
        scales (torch.Tensor): float32, one per block

    Returns:
        torch.Tensor: 1-D float32
    """
    return (steps.view(len(scales), -1).to(torch.float32) * scales[:, None]).view(-1)


def pack4(steps):
    """Two steps to a byte, each offset by 8 into 4 bits: the even-indexed one in the low 4 bits.

    Args:
        steps (torch.Tensor): int8 in ``[-7, 7]`` (``[-8, 7]`` round-trips too), an even length

    Returns:
        torch.Tensor: uint8, half the length
    """
    nibbles = (steps + 8).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def unpack4(packed):
    """The int8 steps :func:`pack4` packed.

    Args:
        packed (torch.Tensor): uint8

    Returns:
        torch.Tensor: int8, twice the length, in ``[-8, 7]``
    """
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1)
    return nibbles.view(-1).to(torch.int8) - 8


def _encode(values, encoding):
    if encoding not in _INTEGER:
        return [values.to(ENCODINGS[encoding])]
    steps, scales = quantize(values, *_INTEGER[encoding])
    return [pack4(steps) if encoding == 'int4' else steps, scales]


def _decode(parts, encoding):
    if encoding not in _INTEGER:
        return parts[0].to(torch.float32)
    return dequantize(unpack4(parts[0]) if encoding == 'int4' else parts[0], parts[1])


def padded_length(numel, world_size, encoding):
    """The length :func:`mean` pads a vector of ``numel`` values to: a chunk per rank, whole blocks in each."""
    unit = world_size * _INTEGER.get(encoding, (1,))[0]
    return -(-numel // unit) * unit


def wire_bytes(numel, world_size, encoding):
    """The bytes of the encoded (padded) vector: what an all-reduce of the same wire would be handed."""
    length = padded_length(numel, world_size, encoding)
    if encoding in _INTEGER:
        block = _INTEGER[encoding][0]
        return length // (2 if encoding == 'int4' else 1) + 4 * (length // block)
    return length * torch.empty((), dtype=ENCODINGS[encoding]).element_size()


def mean(values, encoding, group=None):
    """The mean of ``values`` over every rank, sent in ``encoding``, added in fp32; the same bits on every rank.

    Example:

        .. code-block:: python

            averaged = wire.mean(pseudo_gradient.float(), 'int8')   # 1.03 bytes a value on the wire

    Args:
        values (torch.Tensor): 1-D floating, this rank's values, the same length on every rank
        encoding (str): ``'fp16'``, ``'bf16'``, ``'int8'`` or ``'int4'``
        group (ProcessGroup): the group; the default one if None

    Returns:
        torch.Tensor: 1-D float32 of ``len(values)``, the mean over ranks

    .. warning:: A synchronization point: every rank must call it, with the same length and encoding.
    """
    return PendingMean(values, encoding, group).wait()


class PendingMean:
    """:func:`mean` in flight: its collectives posted with ``async_op=True``, to overlap computation.

    Construction posts the all-to-all; :meth:`advance` waits for it, adds the chunk this rank owns and
    posts the all-gather; :meth:`wait` advances if needed and returns the mean. Up to
    :data:`WHOLE_UP_TO` ranks, construction posts the one all-gather of the whole vectors and
    :meth:`advance` does nothing. Every rank must call them at the same points (the same step), so
    that the ranks' collectives match in order.

    Args:
        values (torch.Tensor): 1-D floating, this rank's values, the same length on every rank
        encoding (str): ``'fp16'``, ``'bf16'``, ``'int8'`` or ``'int4'``
        group (ProcessGroup): the group; the default one if None
    """

    def __init__(self, values, encoding, group=None):
        self.encoding, self.group, self.numel = encoding, group, values.numel()
        self.world = dist.get_world_size(group)
        self.device = values.device  # the values travel where the backend takes them (gloo: the CPU)
        length = padded_length(values.numel(), self.world, encoding)
        padded = torch.zeros(length, dtype=torch.float32, device=collectives.comm_device(values.device))
        padded[:values.numel()] = values
        sent = _encode(padded, encoding)
        #: Payload bytes handed to the collectives: the encoded vector, as an all-reduce of it would be handed.
        self.bytes = wire_bytes(values.numel(), self.world, encoding)
        self.whole = self.world <= WHOLE_UP_TO
        if self.whole:  # every rank's whole vector, in rank order
            self.gathered = [[torch.empty_like(part) for _ in range(self.world)] for part in sent]
            self.works = [dist.all_gather(pieces, part, group=group, async_op=True)
                          for pieces, part in zip(self.gathered, sent)]
            return
        self.received = [torch.empty_like(part) for part in sent]
        # rank j receives every rank's chunk j, in rank order
        self.works = [dist.all_to_all_single(out, part, group=group, async_op=True)
                      for out, part in zip(self.received, sent)]
        self.gathered = None

    def advance(self):
        """Wait for the all-to-all, add this rank's chunk in fp32 (in rank order) and post the all-gather."""
        if self.gathered is not None:  # already advanced, or one collective (whole vectors)
            return
        for work in self.works:
            work.wait()
        total = _sum(_decode(self.received, self.encoding).view(self.world, -1))
        self.gathered, self.works = [], []
        for part in _encode(total, self.encoding):
            pieces = [torch.empty_like(part) for _ in range(self.world)]
            self.works.append(dist.all_gather(pieces, part, group=self.group, async_op=True))
            self.gathered.append(pieces)

    def wait(self):
        """The mean, once every collective has completed.

        Returns:
            torch.Tensor: 1-D float32, the mean over ranks
        """
        self.advance()
        for work in self.works:
            work.wait()
        if self.whole:
            mean = _sum([_decode([pieces[r] for pieces in self.gathered], self.encoding) for r in range(self.world)])
        else:
            mean = _decode([torch.cat(pieces) for pieces in self.gathered], self.encoding)
        return mean[:self.numel].to(self.device)


def _sum(vectors):
    """The mean of ``vectors`` (fp32), added in rank order: the same bits on every rank that adds the same."""
    total = vectors[0].clone()
    for vector in vectors[1:]:
        total += vector
    return total.div_(len(vectors))
